package cluster

import (
	"context"
	"encoding/json"
	"sort"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
)

// dirHooks holds the webhooks registered through the API: <id> → the
// events.Hook (JSON, its secret included). Read on demand (the replica
// that delivers rereads them).
const dirHooks = "webhooks/"

// Hooks are the cluster's webhook registrations (events.HookStore).
func (s *Store) Hooks() Hooks { return Hooks{s} }

// Hooks keeps webhook registrations in etcd.
type Hooks struct{ s *Store }

// PutHook implements events.HookStore.
func (h Hooks) PutHook(ctx context.Context, hk *events.Hook) error {
	b, err := json.Marshal(hk)
	if err != nil {
		return err
	}
	wctx, cancel := h.s.ctx(ctx)
	defer cancel()
	if _, err := h.s.cli.Put(wctx, h.s.key(dirHooks, hk.ID), string(b)); err != nil {
		return unavailable(err, "put webhook")
	}
	return nil
}

// DeleteHook implements events.HookStore.
func (h Hooks) DeleteHook(ctx context.Context, id string) error {
	wctx, cancel := h.s.ctx(ctx)
	defer cancel()
	resp, err := h.s.cli.Delete(wctx, h.s.key(dirHooks, id))
	if err != nil {
		return unavailable(err, "delete webhook")
	}
	if resp.Deleted == 0 {
		return errdefs.NotFound("webhook %s not found", id)
	}
	return nil
}

// Hooks implements events.HookStore.
func (h Hooks) Hooks(ctx context.Context) ([]*events.Hook, error) {
	var out []*events.Hook
	err := h.s.list(ctx, dirHooks, func(_ string, v []byte) {
		var hk events.Hook
		if json.Unmarshal(v, &hk) == nil {
			out = append(out, &hk)
		}
	})
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, err
}
