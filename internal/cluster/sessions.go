package cluster

import (
	"context"
	"encoding/json"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/session"
)

// Sessions keeps trainer sessions in etcd: session.Store for the control
// plane of a cluster. Expiry runs on one replica at a time (see
// RunSessionExpiry).
type Sessions struct{ s *Store }

var _ session.Store = Sessions{}

// Sessions returns the session store.
func (s *Store) Sessions() Sessions { return Sessions{s} }

func (ss Sessions) GetSession(ctx context.Context, key string) (*session.Record, error) {
	ctx, cancel := ss.s.ctx(ctx)
	defer cancel()
	resp, err := ss.s.cli.Get(ctx, ss.s.key(dirSessions, key))
	if err != nil {
		return nil, unavailable(err, "get session")
	}
	if len(resp.Kvs) == 0 {
		return nil, errdefs.NotFound("session %q not found", key)
	}
	r := new(session.Record)
	if err := json.Unmarshal(resp.Kvs[0].Value, r); err != nil {
		return nil, errdefs.Internal(err, "session %q is unreadable", key)
	}
	return r, nil
}

func (ss Sessions) PutSession(ctx context.Context, r *session.Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	ctx, cancel := ss.s.ctx(ctx)
	defer cancel()
	_, err = ss.s.cli.Put(ctx, ss.s.key(dirSessions, r.Key()), string(b))
	return unavailable(err, "put session")
}

func (ss Sessions) DeleteSession(ctx context.Context, key string) error {
	ctx, cancel := ss.s.ctx(ctx)
	defer cancel()
	_, err := ss.s.cli.Delete(ctx, ss.s.key(dirSessions, key))
	return unavailable(err, "delete session")
}

func (ss Sessions) ListSessions(ctx context.Context) ([]*session.Record, error) {
	var out []*session.Record
	err := ss.s.list(ctx, dirSessions, func(_ string, v []byte) {
		var r session.Record
		if json.Unmarshal(v, &r) == nil {
			out = append(out, &r)
		}
	})
	return out, err
}

func (ss Sessions) GetModels(ctx context.Context, key string) ([]byte, error) {
	ctx, cancel := ss.s.ctx(ctx)
	defer cancel()
	resp, err := ss.s.cli.Get(ctx, ss.s.key(dirModels, key))
	if err != nil {
		return nil, unavailable(err, "get model upstreams")
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	return resp.Kvs[0].Value, nil
}

func (ss Sessions) PutModels(ctx context.Context, key string, b []byte) error {
	ctx, cancel := ss.s.ctx(ctx)
	defer cancel()
	var err error
	if b == nil {
		_, err = ss.s.cli.Delete(ctx, ss.s.key(dirModels, key))
	} else {
		_, err = ss.s.cli.Put(ctx, ss.s.key(dirModels, key), string(b))
	}
	return unavailable(err, "put model upstreams")
}
