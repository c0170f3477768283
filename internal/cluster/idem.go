package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// claim records where the items of a create with an idempotency key were
// placed, so a retry (through any replica) goes to the same nodes, whose
// own idempotency keys then return the same sandboxes. One claim covers a
// whole batch: Nodes[i] is item i's node ("" while unplaced).
type claim struct {
	Nodes []string `json:"nodes"`
}

// claims reads and writes idempotency claims. Claims share an hourly lease
// (one lease grant per replica per hour, not one per claim) and live
// between ttl and ttl + 1h.
type claims struct {
	s   *Store
	ttl time.Duration

	mu    sync.Mutex
	lease clientv3.LeaseID
	until time.Time // when to grant the next lease
}

func (c *claims) key(project, key string) string { return c.s.key(dirIdem, project+"/"+key) }

// get returns the claim of key in project and its revision (nil, 0 if none).
func (c *claims) get(ctx context.Context, project, key string) (*claim, int64, error) {
	ctx, cancel := c.s.ctx(ctx)
	defer cancel()
	resp, err := c.s.cli.Get(ctx, c.key(project, key))
	if err != nil {
		return nil, 0, unavailable(err, "read idempotency key")
	}
	if len(resp.Kvs) == 0 {
		return nil, 0, nil
	}
	cl := &claim{}
	if err := json.Unmarshal(resp.Kvs[0].Value, cl); err != nil {
		return nil, 0, unavailable(err, "read idempotency key")
	}
	return cl, resp.Kvs[0].ModRevision, nil
}

// put writes cl if the claim's revision is still rev (0: if there is none)
// and returns the new revision; ok is false when another writer got there
// first.
func (c *claims) put(ctx context.Context, project, key string, cl *claim, rev int64) (newRev int64, ok bool, err error) {
	b, _ := json.Marshal(cl)
	k := c.key(project, key)
	for attempt := 0; ; attempt++ {
		lease, err := c.currentLease(ctx)
		if err != nil {
			return 0, false, err
		}
		tctx, cancel := c.s.ctx(ctx)
		cmp := clientv3.Compare(clientv3.ModRevision(k), "=", rev)
		if rev == 0 {
			cmp = clientv3.Compare(clientv3.CreateRevision(k), "=", 0)
		}
		resp, err := c.s.cli.Txn(tctx).If(cmp).Then(clientv3.OpPut(k, string(b), clientv3.WithLease(lease))).Commit()
		cancel()
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && attempt == 0 {
			c.mu.Lock()
			c.until = time.Time{} // the lease went (etcd lost it); take a new one
			c.mu.Unlock()
			continue
		}
		if err != nil {
			return 0, false, unavailable(err, "write idempotency key")
		}
		return resp.Header.Revision, resp.Succeeded, nil
	}
}

func (c *claims) currentLease(ctx context.Context) (clientv3.LeaseID, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Now().Before(c.until) {
		return c.lease, nil
	}
	ctx, cancel := c.s.ctx(ctx)
	defer cancel()
	resp, err := c.s.cli.Grant(ctx, int64((c.ttl+time.Hour)/time.Second))
	if err != nil {
		return 0, unavailable(err, "grant idempotency lease")
	}
	c.lease, c.until = resp.ID, time.Now().Add(time.Hour)
	return c.lease, nil
}
