package node

import (
	"context"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

// The model gateway of the node's sandboxes (internal/gateway): each
// sandbox created with model_gateway enabled has its agent listen on
// gateway.Port of its loopback for as long as it lives, and the node
// serves the gateway on that listener. Its calls go to the upstreams of
// the sandbox's session, read through the registry the node is given
// (UseModelRegistry), and are appended to the sandbox's trajectory log.

// modelRegistry holds the node's gateway.Resolver (nil until set: calls
// are answered 503, infra).
type modelRegistry struct {
	r atomic.Pointer[gateway.Resolver]
}

func (m *modelRegistry) resolve(ctx context.Context, project, session string) (*dsecv1.ModelUpstreams, error) {
	r := m.r.Load()
	if r == nil {
		return nil, errdefs.Unavailable("the node has no model registry")
	}
	return (*r)(ctx, project, session)
}

// UseModelRegistry sets where the model gateway reads a session's
// upstreams: the control plane's session store. Call it once, at start.
func (n *Node) UseModelRegistry(r gateway.Resolver) { n.models.r.Store(&r) }

// gatewayRetry bounds the wait between attempts to (re)open a sandbox's
// gateway listener: its agent unreachable (a VM paused or restoring) or
// the port held by a process of the sandbox.
const gatewayRetry = 5 * time.Second

// checkModelGateway validates spec's model_gateway (normalize).
func checkModelGateway(spec *dsecv1.SandboxSpec) error {
	mg := spec.ModelGateway
	if mg == nil {
		return nil
	}
	if !mg.Enabled {
		if mg.FastForwardFrom != "" {
			return errdefs.Invalid("model_gateway.fast_forward_from needs model_gateway.enabled")
		}
		spec.ModelGateway = nil
		return nil
	}
	if substrate.Kind(spec.Kind) == substrate.KindFunction {
		return errdefs.Invalid("kind function has no model gateway (use container, microvm or vm)")
	}
	return nil
}

// modelGateway returns the gateway's view of a new sandbox of project
// with spec: its session, and the completed calls of the sandbox it is
// fast-forwarded from (which must be one the project reaches on this
// node, when check). nil when spec has no gateway.
func (n *Node) modelGateway(ctx context.Context, project string, spec *dsecv1.SandboxSpec, check bool) (*gateway.Sandbox, error) {
	mg := spec.GetModelGateway()
	if !mg.GetEnabled() {
		return nil, nil
	}
	sb := &gateway.Sandbox{Project: project, Session: spec.Session}
	if from := mg.FastForwardFrom; from != "" {
		if check {
			if _, _, err := n.find(tenant.With(ctx, tenant.Caller{Project: project}), from); err != nil {
				return nil, errdefs.NotFound("model_gateway.fast_forward_from: sandbox %s not found on node %s", from, n.cfg.Name)
			}
		}
		if n.logs.Exists(from) {
			log, err := n.logs.Log(from)
			if err != nil {
				return nil, errdefs.Internal(err, "open trajectory log")
			}
			entries, _, err := log.Read(0, 0)
			if err != nil {
				return nil, err
			}
			sb.Prefix = gateway.Completed(entries)
		}
	}
	return sb, nil
}

// openGateway opens a new sandbox's gateway listener before the sandbox
// goes live, so its first process finds the gateway, and serves it from
// then on (serveGateway). ctx bounds the opening.
func (n *Node) openGateway(ctx context.Context, s *sandbox) error {
	main, err := s.ctrOf("")
	if err != nil {
		return err
	}
	pg, err := guestCan[substrate.PortGuest](main, "has no model gateway")
	if err != nil {
		return err
	}
	// The listener lives as long as the sandbox, not the create call.
	lctx, cancel := context.WithCancel(context.Background())
	stop := context.AfterFunc(ctx, cancel)
	l, err := pg.Listen(lctx, gateway.Port)
	if !stop() || err != nil {
		cancel()
		if err == nil {
			l.Close()
			err = ctx.Err()
		}
		return errdefs.Unavailable("open the model gateway in the sandbox: %v", err)
	}
	n.serveGateway(lctx, cancel, s, l)
	return nil
}

// serveGateway serves s's model gateway until s ends (or the node
// closes): on first if given (opened under life, which end ends), and on
// a listener it opens again whenever one ends while s lives (a VM paused
// and resumed). life is the gateway's, not a call's: nil makes one.
// s.gw is set.
func (n *Node) serveGateway(life context.Context, end context.CancelFunc, s *sandbox, first net.Listener) {
	ctx, cancel := life, end
	sb := s.gw
	sb.ID = s.id
	sb.Touch = s.touch
	sb.Workers = n.workersFor(s)
	sb.Record = func(c *dsecv1.ModelCall, start time.Time, d time.Duration, err error) {
		s.touch()
		e := &dsecv1.LogEntry{Op: "model_call", At: timestamppb.New(start.UTC()), DurationMs: d.Milliseconds(), ModelCall: c}
		if err != nil {
			e.Error = ItemError(err)
		}
		log, lerr := n.logs.Log(s.id)
		if lerr == nil {
			_, lerr = log.Append(e)
		}
		if lerr != nil {
			n.log.Error("record a model call", slog.String("sandbox_id", s.id), slog.Any("error", lerr))
		}
		n.m.Logged(c.Replayed)
		outcome := "ok"
		switch {
		case c.Replayed:
			outcome = "replayed"
		case errdefs.Is(err, errdefs.KindCanceled):
			outcome = "canceled"
		case errdefs.IsInfra(err):
			outcome = "infra"
		case err != nil:
			outcome = "error"
		}
		n.m.ModelCall(outcome, d, c.PromptTokens, c.CompletionTokens)
	}
	if ctx == nil {
		ctx, cancel = context.WithCancel(context.Background())
	}
	kick := make(chan struct{}, 1)
	s.mu.Lock()
	s.gwStop, s.gwKick = cancel, kick
	s.mu.Unlock()
	go func() {
		select {
		case <-n.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	go func() {
		wait := 50 * time.Millisecond
		warned := false
		if first != nil {
			n.gw.Serve(s.gw, first)
			first.Close()
		}
		for ctx.Err() == nil {
			main, err := s.ctrOf("")
			if err != nil {
				return
			}
			pg, err := guestCan[substrate.PortGuest](main, "has no model gateway")
			if err != nil {
				n.log.Warn("model gateway unavailable", slog.String("sandbox_id", s.id), slog.Any("error", err))
				return
			}
			l, err := pg.Listen(ctx, gateway.Port)
			if err == nil {
				wait, warned = 50*time.Millisecond, false
				n.gw.Serve(sb, l)
				l.Close()
			} else if errdefs.Is(err, errdefs.KindConflict) && !warned {
				warned = true
				n.log.Warn("a process of the sandbox holds the model gateway's port", slog.String("sandbox_id", s.id), slog.Int("port", gateway.Port))
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-kick:
				t.Stop()
				wait = 25 * time.Millisecond
			case <-t.C:
			}
			wait = min(2*wait, gatewayRetry)
		}
	}()
}

// stopGateway ends s's gateway listener (release).
func (s *sandbox) stopGateway() {
	s.mu.Lock()
	stop := s.gwStop
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// readoptGateway serves the gateway of a sandbox re-adopted after a node
// restart, its calls numbered on from its own log.
func (n *Node) readoptGateway(s *sandbox) {
	if !s.spec.GetModelGateway().GetEnabled() {
		return
	}
	// Its source was checked at create (and may be re-adopted after it):
	// its log is read as it is.
	gw, err := n.modelGateway(context.Background(), s.project, s.spec, false)
	if err != nil {
		// Its recording is gone: what is left of its prefix goes live.
		n.log.Warn("model gateway restored without its fast-forward", slog.String("sandbox_id", s.id), slog.Any("error", err))
		gw = &gateway.Sandbox{Project: s.project, Session: s.spec.Session}
	}
	if n.logs.Exists(s.id) {
		if log, err := n.logs.Log(s.id); err == nil {
			if own, _, err := log.Read(0, 0); err == nil {
				gw.Continue(own)
			}
		}
	}
	s.gw = gw
	n.serveGateway(nil, nil, s, nil)
}
