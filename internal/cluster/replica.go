package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log/slog"
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
// ctx ends; replicas divide projects' create rates by how many there are.
func (s *Store) RunReplica(ctx context.Context, id, address string, log *slog.Logger) {
	b, _ := json.Marshal(Replica{ID: id, Address: address, Started: time.Now().UTC()})
	for ctx.Err() == nil {
		err := s.replicaSession(ctx, id, string(b))
		if ctx.Err() != nil {
			return
		}
		log.Warn("replica registration lost; registering again", slog.Any("error", err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

func (s *Store) replicaSession(ctx context.Context, id, value string) error {
	gctx, cancel := s.ctx(ctx)
	g, err := s.cli.Grant(gctx, 10)
	if err == nil {
		_, err = s.cli.Put(gctx, s.key(dirReplicas, id), value, clientv3.WithLease(g.ID))
	}
	cancel()
	if err != nil {
		return unavailable(err, "register replica")
	}
	kctx, kcancel := context.WithCancel(ctx)
	defer kcancel()
	keep, err := s.cli.KeepAlive(kctx, g.ID)
	if err != nil {
		return unavailable(err, "keep replica lease")
	}
	for range keep {
	}
	if ctx.Err() != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		s.cli.Revoke(rctx, g.ID)
		cancel()
		return nil
	}
	return unavailable(context.DeadlineExceeded, "replica lease expired")
}

// RunSessionExpiry expires sessions on one replica of the cluster at a
// time: it campaigns for leadership (an etcd election bound to a lease)
// and runs m's expiry while it leads, until ctx ends. A new leader counts
// grace from when it took over.
func (s *Store) RunSessionExpiry(ctx context.Context, id string, m *session.Manager, log *slog.Logger) {
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
		el := concurrency.NewElection(sess, s.prefix+dirElection+"sessions")
		if err := el.Campaign(ctx, id); err != nil {
			sess.Close()
			continue
		}
		log.Info("this replica expires sessions")
		lctx, cancel := context.WithCancel(ctx)
		go func() {
			select {
			case <-sess.Done(): // leadership lost with the lease
			case <-lctx.Done():
			}
			cancel()
		}()
		m.Run(lctx)
		cancel()
		if ctx.Err() != nil {
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			el.Resign(rctx)
			rcancel()
		}
		sess.Close()
		if ctx.Err() == nil {
			log.Warn("lost session expiry leadership; campaigning again")
		}
	}
}
