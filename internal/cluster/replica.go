package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"net"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/opendsec/dsec/internal/session"
)

// NewReplicaID returns a random apiserver replica ID.
func NewReplicaID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// RunReplica keeps this apiserver replica's entry (bound to a lease) until
// ctx ends: replicas divide projects' create rates by how many there are,
// and writers wait for every registered replica to acknowledge a sync
// barrier (see Store.Sync), which st does. Like a node's membership, the
// entry outlives etcd outages; it is written again only when etcd says
// its lease is gone.
func (s *Store) RunReplica(ctx context.Context, id, address string, st *State, log *slog.Logger) {
	b, _ := json.Marshal(Replica{ID: id, Address: address, Started: time.Now().UTC()})
	for ctx.Err() == nil {
		err := s.replicaSession(ctx, id, string(b), st)
		if ctx.Err() != nil {
			return
		}
		log.Warn("replica registration lost; registering again", slog.Any("error", err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (s *Store) replicaSession(ctx context.Context, id, value string, st *State) error {
	gctx, cancel := s.ctx(ctx)
	s.takeOverReplica(gctx, id, value)
	g, err := s.cli.Grant(gctx, 10)
	var put *clientv3.PutResponse
	if err == nil {
		put, err = s.cli.Put(gctx, s.key(dirReplicas, id), value, clientv3.WithLease(g.ID))
	}
	cancel()
	if err != nil {
		return unavailable(err, "register replica")
	}
	if st != nil {
		st.registered(id, g.ID, put.Header.Revision)
	}
	err = s.keepLease(ctx, g.ID)
	if ctx.Err() != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		s.cli.Revoke(rctx, g.ID)
		cancel()
		return nil
	}
	return err
}

// takeOverReplica revokes the registration of a previous replica process
// at this replica's address (it died: this process holds the address now),
// so writers stop waiting for it at once rather than when its lease
// expires. Replicas listening on a wildcard address share no identity by
// address and take nothing over.
func (s *Store) takeOverReplica(ctx context.Context, id, value string) {
	var me Replica
	if json.Unmarshal([]byte(value), &me) != nil {
		return
	}
	host, _, err := net.SplitHostPort(me.Address)
	if ip := net.ParseIP(host); err != nil || host == "" || (ip != nil && ip.IsUnspecified()) {
		return
	}
	resp, err := s.cli.Get(ctx, s.prefix+dirReplicas, clientv3.WithPrefix())
	if err != nil {
		return
	}
	for _, kv := range resp.Kvs {
		var r Replica
		if json.Unmarshal(kv.Value, &r) == nil && r.ID != id && r.Address == me.Address && kv.Lease != 0 {
			s.cli.Revoke(ctx, clientv3.LeaseID(kv.Lease))
		}
	}
}

// RunSessionExpiry expires sessions on one replica of the cluster at a
// time (RunLeader). A new leader counts grace from when it took over.
func (s *Store) RunSessionExpiry(ctx context.Context, id string, m *session.Manager, log *slog.Logger) {
	s.RunLeader(ctx, id, "sessions", "session expiry", m.Run, log)
}

// RunLeader runs run on one replica of the cluster at a time, until ctx
// ends: it campaigns for leadership of election (an etcd election bound
// to a lease) and runs run while it leads; run's context ends when the
// leadership is lost, and the replica campaigns again.
func (s *Store) RunLeader(ctx context.Context, id, election, what string, run func(context.Context), log *slog.Logger) {
	for ctx.Err() == nil {
		sess, err := concurrency.NewSession(s.cli, concurrency.WithTTL(10), concurrency.WithContext(ctx))
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			continue
		}
		el := concurrency.NewElection(sess, s.prefix+dirElection+election)
		if err := el.Campaign(ctx, id); err != nil {
			sess.Close()
			continue
		}
		log.Info("this replica leads " + what)
		lctx, cancel := context.WithCancel(ctx)
		go func() {
			select {
			case <-sess.Done(): // leadership lost with the lease
			case <-lctx.Done():
			}
			cancel()
		}()
		run(lctx)
		cancel()
		if ctx.Err() != nil {
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			el.Resign(rctx)
			rcancel()
		}
		sess.Close()
		if ctx.Err() == nil {
			log.Warn("lost the leadership of " + what + "; campaigning again")
		}
	}
}
