package function

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
)

// A function sandbox (kind "function" through the generic API) holds no
// container of its own: each exec is one call in a pooled worker, in a
// fresh directory, leaving nothing behind. It is stateless by design, so
// files, PTYs and streaming answer Unimplemented, and its instances are
// neither Pausers nor Snapshotters.

type instance struct {
	d     *Driver
	image string
	env   []string
	done  chan struct{}
	once  sync.Once
}

type instanceState struct {
	Image string   `json:"image"`
	Env   []string `json:"env,omitempty"`
}

// Create implements substrate.Driver.
func (d *Driver) Create(ctx context.Context, s *substrate.Spec) (substrate.Instance, error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("function calls cannot run on this node: %s", d.caps.Reason)
	}
	if s.Network.Mode != "" && s.Network.Mode != "none" {
		return nil, errdefs.Unimplemented("function sandboxes have no network")
	}
	img := s.Image.Name
	if img == "" {
		img = d.cfg.Image
	}
	return &instance{d: d, image: img, env: s.Env, done: make(chan struct{})}, nil
}

// Attach implements substrate.Driver.
func (d *Driver) Attach(ctx context.Context, s *substrate.Spec, raw []byte) (substrate.Instance, error) {
	var st instanceState
	if err := json.Unmarshal(raw, &st); err != nil {
		return nil, errdefs.Internal(err, "decode function sandbox state")
	}
	return &instance{d: d, image: st.Image, env: st.Env, done: make(chan struct{})}, nil
}

func (i *instance) Guest() substrate.Guest { return &callGuest{i: i} }

func (i *instance) State() []byte {
	b, _ := json.Marshal(instanceState{Image: i.image, Env: i.env})
	return b
}

func (i *instance) Done() <-chan struct{} { return i.done }
func (i *instance) Check(context.Context) error {
	select {
	case <-i.done:
		return errdefs.Gone("function sandbox deleted")
	default:
		return nil
	}
}
func (i *instance) Stats(context.Context) (substrate.Stats, error) { return substrate.Stats{}, nil }

func (i *instance) Destroy(context.Context) error {
	i.once.Do(func() { close(i.done) })
	return nil
}

// callGuest runs each exec as one function call.
type callGuest struct{ i *instance }

var errStateless = errdefs.Unimplemented("function sandboxes run commands to completion only, without a PTY (use kind container)")

func (g *callGuest) Hello(context.Context) (*guestv1.HelloReply, error) {
	return &guestv1.HelloReply{Version: "function"}, nil
}

func (g *callGuest) Run(ctx context.Context, x *guestv1.Exec) (*guestv1.Exit, error) {
	if x.Pty {
		return nil, errStateless
	}
	d := g.i.d
	p := d.poolFor(g.i.image)
	w, slot, err := p.acquire(ctx)
	if err != nil {
		return nil, err
	}
	st := &guestv1.CallStep{Argv: x.Argv, Stdin: x.StdinData, TimeoutMs: x.TimeoutMs, MaxOutput: x.MaxOutput, RlimitNproc: 256, RlimitNofile: 4096}
	call := &guestv1.Call{Dir: slotDir(slot), Uid: uint32(uidBase + slot), DiskBytes: d.cfg.CallDiskMB << 20, Steps: []*guestv1.CallStep{st}, Env: append(append([]string(nil), g.i.env...), x.Env...)}
	cctx, cancel := context.WithTimeout(ctx, time.Duration(x.TimeoutMs)*time.Millisecond+30*time.Second)
	defer cancel()
	out, err := w.agent.Call(cctx, call)
	if err != nil {
		p.release(w, slot, "call failed: "+err.Error())
		return nil, errdefs.Unavailable("function worker failed").WithCause(err)
	}
	p.release(w, slot, out.DirtyReason)
	if len(out.Steps) == 0 {
		return nil, errdefs.Unavailable("function worker did not run the command: %s", out.DirtyReason)
	}
	return out.Steps[0], nil
}

func (g *callGuest) Sync(context.Context) error                   { return nil }
func (g *callGuest) SetDeadline(context.Context, time.Time) error { return nil }
func (g *callGuest) SetEnv(context.Context, []string) error       { return nil }
