package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
)

// Read your writes. Replicas serve from a view that a watch keeps, so a
// change reaches each one a little after etcd has it. Rather than have
// every request read etcd first (a round trip per call on the hot path),
// the writer waits: after a change to the cluster state it writes a sync
// barrier, and returns once every registered replica has acknowledged a
// barrier at least as new, which a replica does only once its view
// includes it (and, the watch being ordered, everything before it). The
// next call through any replica then sees the change.
const (
	keySync = dirCluster + "sync" // the barrier: any value; its revisions are what replicas acknowledge
	dirAcks = "acks/"             // <replica id> → the newest barrier revision its view includes, bound to its lease
)

// SyncTimeout is how long a write waits for replicas to acknowledge it
// before it reports them (UnconfirmedError). A live replica answers in
// milliseconds; one that does not is cut off from etcd or dead (its entry
// goes with its lease, 10 s after it stopped renewing).
const SyncTimeout = 5 * time.Second

// UnconfirmedError is what a write returns when etcd took it but some
// replicas (or the node it concerns) did not confirm seeing it within
// SyncTimeout. The write is done; they see it once they reach etcd again.
// A replica cut off from etcd for more than 3 s places no new sandboxes,
// but goes on authenticating with the keys it knew.
type UnconfirmedError struct {
	// Replicas lists the replicas (IDs and addresses) that did not
	// confirm; Node is the node that did not, if any.
	Replicas []string
	Node     string
}

func (e *UnconfirmedError) Error() string {
	var who []string
	if e.Node != "" {
		who = append(who, "node "+e.Node)
	}
	if len(e.Replicas) > 0 {
		who = append(who, "replica(s) "+strings.Join(e.Replicas, ", "))
	}
	return fmt.Sprintf("written to etcd, but %s did not confirm seeing it within %s (cut off from etcd, or stopped); they will when they reach etcd again", strings.Join(who, " and "), SyncTimeout)
}

// Sync returns once every registered apiserver replica's view includes the
// cluster state as of the call (nil), or after SyncTimeout with an
// *UnconfirmedError naming those that did not confirm. It costs one etcd
// write and a watch, and each replica one write.
func (s *Store) Sync(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, SyncTimeout)
	defer cancel()
	// Watch acknowledgements (and replicas going away) from now on, before
	// the barrier: a watch etcd registers at its current revision is
	// served as writes happen, while one that starts in the past waits for
	// etcd's catch-up pass (every 100 ms).
	acks := s.cli.Watch(ctx, s.prefix+dirAcks, clientv3.WithPrefix(), clientv3.WithCreatedNotify())
	gone := s.cli.Watch(ctx, s.prefix+dirReplicas, clientv3.WithPrefix(), clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
	for _, w := range []clientv3.WatchChan{acks, gone} {
		if wr, ok := <-w; !ok || wr.Err() != nil || !wr.Created {
			err := wr.Err()
			if err == nil {
				err = context.Cause(ctx)
			}
			if err == nil {
				err = errors.New("watch ended")
			}
			return unavailable(err, "watch replicas' acknowledgements")
		}
	}
	var nonce [8]byte
	rand.Read(nonce[:])
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpPut(s.prefix+keySync, hex.EncodeToString(nonce[:])),
		clientv3.OpGet(s.prefix+dirReplicas, clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return unavailable(err, "write sync barrier")
	}
	rev := resp.Header.Revision
	waiting := map[string]string{} // id → how to name it
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		id := strings.TrimPrefix(string(kv.Key), s.prefix+dirReplicas)
		waiting[id] = id
		var r Replica
		if json.Unmarshal(kv.Value, &r) == nil && r.Address != "" {
			waiting[id] = id + " at " + r.Address
		}
	}
	for len(waiting) > 0 {
		select {
		case wr, ok := <-acks:
			if !ok || wr.Err() != nil {
				return s.unconfirmed(ctx, waiting, "")
			}
			for _, ev := range wr.Events {
				if n, err := strconv.ParseInt(string(ev.Kv.Value), 10, 64); err == nil && n >= rev {
					delete(waiting, strings.TrimPrefix(string(ev.Kv.Key), s.prefix+dirAcks))
				}
			}
		case wr, ok := <-gone:
			if !ok || wr.Err() != nil {
				return s.unconfirmed(ctx, waiting, "")
			}
			for _, ev := range wr.Events {
				if ev.Kv.ModRevision > rev {
					delete(waiting, strings.TrimPrefix(string(ev.Kv.Key), s.prefix+dirReplicas))
				}
			}
		}
	}
	return nil
}

func (s *Store) unconfirmed(ctx context.Context, waiting map[string]string, node string) error {
	if ctx.Err() == nil {
		return unavailable(errors.New("watch ended"), "wait for replicas")
	}
	e := &UnconfirmedError{Node: node}
	for _, who := range waiting {
		e.Replicas = append(e.Replicas, who)
	}
	sort.Strings(e.Replicas)
	return e
}

// waitNode returns once node's published load satisfies ok, or at once
// when the node is not a member (its next registration publishes its
// state then). It fails with an *UnconfirmedError after SyncTimeout.
func (s *Store) waitNode(ctx context.Context, node string, ok func(*nodev1.Load) bool) error {
	ctx, cancel := context.WithTimeout(ctx, SyncTimeout)
	defer cancel()
	key := s.key(dirAlive, node)
	// Watch first (from etcd's current revision, see Sync), then read.
	w := s.cli.Watch(ctx, key, clientv3.WithCreatedNotify())
	if wr, ok := <-w; !ok || wr.Err() != nil || !wr.Created {
		return s.unconfirmed(ctx, nil, node)
	}
	resp, err := s.cli.Get(ctx, key)
	if err != nil {
		return unavailable(err, "read node "+node)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	l := &nodev1.Load{}
	if proto.Unmarshal(resp.Kvs[0].Value, l) == nil && ok(l) {
		return nil
	}
	for wr := range w {
		if wr.Err() != nil {
			break
		}
		for _, ev := range wr.Events {
			if ev.Type == clientv3.EventTypeDelete {
				return nil
			}
			l := &nodev1.Load{}
			if proto.Unmarshal(ev.Kv.Value, l) == nil && ok(l) {
				return nil
			}
		}
	}
	return s.unconfirmed(ctx, nil, node)
}
