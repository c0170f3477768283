package node

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/trajectory"
)

// Rollout workers (a sandbox group): the agent of a rollout drives the
// sandboxes StartRolloutRequest.workers names through the dsec API served
// at its model gateway's address, with no key. The node answers there for
// the agent's project, and only for the workers of the agent's running
// rollouts. Each exec and file write the agent sends without a request
// ID gets one by its position in the rollout (workerID), so the same
// rollout run again by a new agent sandbox (a resume) is answered from
// the workers' logs, exactly as a trainer's calls with request IDs are,
// until a call differs from the recorded one: from there its calls get
// IDs of their own and run live, and the rollout says where it diverged.

// workerPrefix starts the request IDs the worker API gives a rollout's
// calls: workerPrefix + rollout ID + "/" + position, and for calls after
// a divergence "@" + the agent's sandbox ID.
const workerPrefix = "rollout:"

// workerCalls numbers the worker calls of one rollout of an agent.
type workerCalls struct {
	mu       sync.Mutex
	workers  map[string]bool
	next     uint64 // the last position given
	diverged string // where the calls went live ("": not)
	calls    int64
	replays  int64
}

// workerID is the request ID of the next call of rollout id of agent.
func (w *workerCalls) workerID(rollout, agent string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.next++
	id := workerPrefix + rollout + "/" + strconv.FormatUint(w.next, 10)
	if w.diverged != "" {
		id += "@" + agent
	}
	return id
}

// restore continues the numbering of a rollout whose agent ran on while
// the node restarted, from the request IDs in its workers' logs.
func (w *workerCalls) restore(n *Node, rollout, agent string) {
	prefix := workerPrefix + rollout + "/"
	for worker := range w.workers {
		if !n.logs.Exists(worker) {
			continue
		}
		log, err := n.logs.Log(worker)
		if err != nil {
			continue
		}
		entries, _, err := log.Read(0, 0)
		if err != nil {
			continue
		}
		for _, e := range entries {
			rest, ok := strings.CutPrefix(e.RequestId, prefix)
			if !ok {
				continue
			}
			pos, who, live := strings.Cut(rest, "@")
			if live && who != agent {
				continue // another agent's live calls
			}
			if i, err := strconv.ParseUint(pos, 10, 64); err == nil && i > w.next {
				w.next = i
			}
			if live && w.diverged == "" {
				w.diverged = "restored after a node restart: the calls had gone live at call " + pos
			}
			w.calls++
		}
	}
}

// workersOf finds the running rollout of agent that drives sandbox
// worker.
func (rs *rollouts) workersOf(agent, worker string) (*rollout, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for _, r := range rs.m {
		if r.view.GetSandboxId() == agent && r.workers != nil && r.workers.workers[worker] {
			return r, true
		}
	}
	return nil, false
}

type agentKey struct{}

// workerAPI serves the ProcessService and FilesystemService to the agents
// of rollouts (the handler of every sandbox's gateway: gateway.Sandbox's
// Workers, with the agent's sandbox in the request's context).
func (n *Node) workerAPI() http.Handler {
	n.workersOnce.Do(func() {
		opts := connect.WithInterceptors(workerGuard{n})
		mux := http.NewServeMux()
		mux.Handle(dsecv1connect.NewProcessServiceHandler(n.Service(), opts))
		mux.Handle(dsecv1connect.NewFilesystemServiceHandler(n.Service(), opts))
		n.workers = mux
	})
	return n.workers
}

// workersFor is the worker API of agent sandbox s.
func (n *Node) workersFor(s *sandbox) http.Handler {
	h := n.workerAPI()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := context.WithValue(r.Context(), agentKey{}, s)
		h.ServeHTTP(w, r.WithContext(tenant.With(ctx, tenant.Caller{Project: s.project})))
	})
}

// workerGuard admits an agent's call to a worker of its running
// rollouts, and numbers its exec and file writes.
type workerGuard struct{ n *Node }

// admit checks msg's sandbox and gives it a request ID if it takes one
// and has none. It returns the rollout and the ID it gave ("": none).
func (g workerGuard) admit(ctx context.Context, msg any) (*rollout, string, error) {
	agent, _ := ctx.Value(agentKey{}).(*sandbox)
	pm, ok := msg.(proto.Message)
	if agent == nil || !ok {
		return nil, "", errdefs.PermissionDenied("the worker API answers rollout agents only")
	}
	m := pm.ProtoReflect()
	if h := m.Descriptor().Fields().ByName("header"); h != nil {
		if !m.Has(h) {
			return nil, "", nil // a data chunk after the header
		}
		m = m.Mutable(h).Message()
	}
	fd := m.Descriptor().Fields().ByName("sandbox_id")
	if fd == nil {
		return nil, "", errdefs.PermissionDenied("the worker API answers calls on a sandbox only")
	}
	worker := m.Get(fd).String()
	r, ok := g.n.rollouts.workersOf(agent.id, worker)
	if !ok {
		return nil, "", errdefs.NotFound("sandbox %s is not a worker of a running rollout of sandbox %s", worker, agent.id)
	}
	rid := m.Descriptor().Fields().ByName("request_id")
	if rid == nil || m.Get(rid).String() != "" {
		return r, "", nil
	}
	id := r.workers.workerID(r.view.RolloutId, agent.id)
	m.Set(rid, protoreflect.ValueOfString(id))
	return r, id, nil
}

// answered counts a numbered call's outcome: replayed, or a divergence
// (the call's ID was recorded with another request: it runs again live).
func (g workerGuard) answered(r *rollout, id string, res any, err error) (diverged bool) {
	if id == "" {
		return false
	}
	w := r.workers
	w.mu.Lock()
	defer w.mu.Unlock()
	if trajectory.Reused(err) {
		if w.diverged == "" {
			w.diverged = "call " + strings.TrimPrefix(id, workerPrefix+r.view.RolloutId+"/") + " differs from the recorded one"
		}
		return true
	}
	if err != nil {
		return false
	}
	w.calls++
	if unreplayed(res) {
		w.replays++
	}
	return false
}

// unreplayed clears an answer's replayed flag, and says whether it was
// set: the agent cannot tell a resumed rollout's answers from live ones
// (its rollout counts them).
func unreplayed(res any) bool {
	switch v := res.(type) {
	case *dsecv1.ExecResult:
		was := v.Replayed
		v.Replayed = false
		return was
	case *dsecv1.FileInfo:
		was := v.Replayed
		v.Replayed = false
		return was
	}
	return false
}

func (g workerGuard) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		r, id, err := g.admit(ctx, req.Any())
		if err != nil {
			return nil, errwire.ToConnect(err)
		}
		resp, err := next(ctx, req)
		if g.answered(r, id, anyMsg(resp), err) {
			// Recorded differently: run it live, under an ID of its own.
			_, live, aerr := g.admit(ctx, clearID(req.Any()))
			if aerr != nil {
				return nil, errwire.ToConnect(aerr)
			}
			resp, err = next(ctx, req)
			g.answered(r, live, anyMsg(resp), err)
		}
		return resp, err
	}
}

func (g workerGuard) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (g workerGuard) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		gc := &guardedConn{StreamingHandlerConn: conn, g: g, ctx: ctx}
		err := next(ctx, gc)
		if gc.r != nil && gc.id != "" && err != nil {
			// A stream cannot be sent again: a conflict diverges the
			// rollout (its next calls run live), the agent sees the error.
			g.answered(gc.r, gc.id, nil, err)
		}
		return err
	}
}

// guardedConn admits the messages of a stream as they arrive.
type guardedConn struct {
	connect.StreamingHandlerConn
	g   workerGuard
	ctx context.Context
	r   *rollout
	id  string
}

// Send counts a numbered call's answer: a file write's, an exec stream's
// exit.
func (c *guardedConn) Send(msg any) error {
	if c.r != nil && c.id != "" {
		switch m := msg.(type) {
		case *dsecv1.FileInfo:
			c.g.answered(c.r, c.id, m, nil)
		case *dsecv1.ExecEvent:
			if x := m.GetExit(); x != nil {
				c.g.answered(c.r, c.id, x, nil)
			}
		}
	}
	return c.StreamingHandlerConn.Send(msg)
}

func (c *guardedConn) Receive(msg any) error {
	if err := c.StreamingHandlerConn.Receive(msg); err != nil {
		return err
	}
	r, id, err := c.g.admit(c.ctx, msg)
	if err != nil {
		return errwire.ToConnect(err)
	}
	if r != nil {
		c.r, c.id = r, id
	}
	return nil
}

func anyMsg(resp connect.AnyResponse) any {
	if resp == nil {
		return nil
	}
	return resp.Any()
}

// clearID empties msg's request ID, for admit to give it another.
func clearID(msg any) any {
	if pm, ok := msg.(proto.Message); ok {
		m := pm.ProtoReflect()
		if fd := m.Descriptor().Fields().ByName("request_id"); fd != nil {
			m.Clear(fd)
		}
	}
	return msg
}
