package cluster

import (
	"context"
	"errors"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// errLeaseGone says etcd answered that a lease no longer exists: it expired
// (nobody renewed it for its TTL while etcd ran) or was revoked. Only this
// ends a membership; an etcd that does not answer never does.
var errLeaseGone = errors.New("lease expired or revoked")

// renewRetry is how often a lease whose keepalive stream gave up is asked
// for again while etcd does not answer: after etcd returns, a holder learns
// within about this (plus the client's reconnect, at most 1 s) whether its
// lease is still there.
const renewRetry = 250 * time.Millisecond

// keepLease renews lease id until ctx ends (it returns ctx's error) or etcd
// says the lease is gone (errLeaseGone). It outlives etcd outages: the
// client's keepalive stream gives up after a TTL without answers, and then
// keepLease asks every renewRetry until etcd answers — still there (etcd
// extends every lease by its TTL when it regains a leader, so a lease
// outlives an outage of etcd itself) or gone.
func (s *Store) keepLease(ctx context.Context, id clientv3.LeaseID) error {
	for {
		kctx, cancel := context.WithCancel(ctx)
		ch, err := s.cli.KeepAlive(kctx, id)
		if err == nil {
			for range ch { // closed when the stream gives up or the lease is gone
			}
		}
		cancel()
		for {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			octx, ocancel := context.WithTimeout(ctx, time.Second)
			_, err := s.cli.KeepAliveOnce(octx, id)
			ocancel()
			if err == nil {
				break // still ours: keep it again
			}
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				return errLeaseGone
			}
			select {
			case <-ctx.Done():
			case <-time.After(renewRetry):
			}
		}
	}
}
