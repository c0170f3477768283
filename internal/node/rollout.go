package node

import (
	"bytes"
	"context"
	"log/slog"
	"maps"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/substrate"
)

// Rollouts: an agent command that runs on in its sandbox when the trainer
// that started it goes, watched by the node, scored by a verifier when it
// ends. Its record is the trajectory log: a rollout_start entry before the
// agent starts (its progress is the log after it: the agent's model calls,
// the commands sent to the sandbox) and a rollout_end entry with its
// outcome. The agent is a background process tagged rolloutTag+id, which
// a node that restarts attaches to again.

// Rollout states.
const (
	RolloutRunning   = "running"
	RolloutSucceeded = "succeeded"
	RolloutFailed    = "failed"
	RolloutInfra     = "infra"
	RolloutCanceled  = "canceled"
)

const (
	rolloutTag     = "rollout:"
	maxRolloutWait = 300 * time.Second
)

// rolloutIDRe: the agent's tag (rolloutTag + ID) fits the 128 bytes of
// a process tag.
var rolloutIDRe = regexp.MustCompile(`^[A-Za-z0-9._-]{1,120}$`)

// rollouts are the rollouts the node watches, by sandbox and rollout ID.
type rollouts struct {
	startMu sync.Mutex // orders starts, so a rollout ID starts once

	mu sync.Mutex
	m  map[string]*rollout
}

// rollout is a rollout the node watches: its view, the end's once it
// ended (done closed).
type rollout struct {
	mu   sync.Mutex
	view *dsecv1.Rollout
	done chan struct{}
	// workers numbers the agent's calls to its workers (nil: none).
	workers *workerCalls
}

func rolloutKey(sandbox, id string) string { return sandbox + "/" + id }

func (rs *rollouts) get(sandbox, id string) *rollout {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.m[rolloutKey(sandbox, id)]
}

func (rs *rollouts) put(r *rollout) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.m == nil {
		rs.m = map[string]*rollout{}
	}
	rs.m[rolloutKey(r.view.SandboxId, r.view.RolloutId)] = r
}

func (rs *rollouts) drop(r *rollout) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	delete(rs.m, rolloutKey(r.view.SandboxId, r.view.RolloutId))
}

func (r *rollout) current() *dsecv1.Rollout {
	r.mu.Lock()
	v := proto.Clone(r.view).(*dsecv1.Rollout)
	r.mu.Unlock()
	if w := r.workers; w != nil {
		w.mu.Lock()
		v.WorkerCalls, v.WorkerReplays, v.Divergence = w.calls, w.replays, w.diverged
		w.mu.Unlock()
	}
	return v
}

// StartRollout starts an agent command as a rollout, or answers the
// rollout the sandbox has under that ID (the caller reattaches).
func (n *Node) StartRollout(ctx context.Context, req *dsecv1.StartRolloutRequest) (*dsecv1.Rollout, error) {
	id := req.GetRolloutId()
	if !rolloutIDRe.MatchString(id) {
		return nil, errdefs.Invalid("rollout_id must be 1 to 120 letters, digits, '.', '_' or '-'")
	}
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	n.rollouts.startMu.Lock()
	defer n.rollouts.startMu.Unlock()
	if v, err := n.rolloutView(s.id, id); err != nil || v != nil {
		return v, err
	}
	c, err := s.ctrOf("")
	if err != nil {
		return nil, err
	}
	pg, err := c.procs()
	if err != nil {
		return nil, err
	}
	timeout := req.GetTimeoutS()
	if timeout == 0 {
		timeout = n.cfg.MaxExecTimeout.Seconds()
	}
	env := req.GetEnv()
	var workers *workerCalls
	if len(req.GetWorkers()) > 0 {
		if workers, err = n.rolloutWorkers(ctx, s, req.GetWorkers()); err != nil {
			return nil, err
		}
		env = maps.Clone(env)
		if env == nil {
			env = map[string]string{}
		}
		if env["DSEC_URL"] == "" {
			env["DSEC_URL"] = "http://127.0.0.1:" + strconv.Itoa(gateway.Port)
		}
		env["DSEC_WORKERS"] = strings.Join(req.GetWorkers(), ",")
	}
	x, err := n.guestExec(c, &dsecv1.ExecRequest{
		Argv: req.GetArgv(), Cmd: req.GetCmd(), Env: env, Cwd: req.GetCwd(), User: req.GetUser(),
		TimeoutS: timeout, Tag: rolloutTag + id,
	}, false)
	if err != nil {
		return nil, err
	}
	if v := req.GetVerifier(); v != nil {
		if _, err := n.guestExec(c, &dsecv1.ExecRequest{Argv: v.Argv, Cmd: v.Cmd, TimeoutS: v.TimeoutS}, true); err != nil {
			return nil, errdefs.Invalid("verifier: %v", errdefs.Classify(err).Msg)
		}
	}
	log, err := n.logs.Log(s.id)
	if err != nil {
		return nil, errdefs.Internal(err, "open trajectory log")
	}
	view := &dsecv1.Rollout{SandboxId: s.id, RolloutId: id, State: RolloutRunning, StartedAt: timestamppb.Now(), Request: req}
	// The start is logged before the agent runs: its progress follows it.
	e, err := log.Append(&dsecv1.LogEntry{Op: "rollout_start", At: view.StartedAt, Argv: x.Argv, Rollout: view})
	if err != nil {
		return nil, errdefs.Internal(err, "record the rollout in the trajectory log")
	}
	view.StartSeq = e.Seq
	s.touch()
	// Watched (and its workers reachable) before the agent runs.
	r := &rollout{view: view, done: make(chan struct{}), workers: workers}
	n.rollouts.put(r)
	// The agent outlives this call: its stream is the node's.
	p, err := pg.Start(n.life, x)
	if err != nil {
		n.rollouts.drop(r)
		err = n.callFailed(s, err)
		end := proto.Clone(view).(*dsecv1.Rollout)
		end.State, end.Detail = RolloutFailed, "the agent did not start: "+errdefs.Classify(err).Msg
		if errdefs.IsInfra(err) {
			end.State = RolloutInfra
		}
		n.endRollout(s.id, end)
		return nil, err
	}
	go n.watchRollout(s, r, p)
	return n.counted(r.current())
}

// rolloutWorkers checks the workers of a rollout of agent sandbox s: live
// sandboxes of the caller's on this node, reached through s's gateway.
func (n *Node) rolloutWorkers(ctx context.Context, s *sandbox, ids []string) (*workerCalls, error) {
	if s.gw == nil {
		return nil, errdefs.Invalid("a rollout with workers needs its sandbox's model gateway (model_gateway.enabled): its agent reaches the workers there")
	}
	for _, w := range ids {
		if w == s.id {
			return nil, errdefs.Invalid("workers: %s is the agent's own sandbox", w)
		}
		if _, err := n.live(ctx, w); err != nil {
			if errdefs.Is(err, errdefs.KindNotFound) {
				return nil, errdefs.NotFound("workers: sandbox %s not found on node %s (a rollout's workers run on its agent's node: create the agent with node_selector dsec.io/node=<the worker's node>)", w, n.cfg.Name)
			}
			return nil, err
		}
	}
	return &workerCalls{workers: setOf(ids)}, nil
}

func setOf(ids []string) map[string]bool {
	out := make(map[string]bool, len(ids))
	for _, id := range ids {
		out[id] = true
	}
	return out
}

// GetRollout answers a rollout, once it ended or wait_s passed.
func (n *Node) GetRollout(ctx context.Context, req *dsecv1.GetRolloutRequest) (*dsecv1.Rollout, error) {
	if _, _, err := n.find(ctx, req.GetSandboxId()); err != nil {
		return nil, err
	}
	if w := req.GetWaitS(); w < 0 || w > maxRolloutWait.Seconds() {
		return nil, errdefs.Invalid("wait_s out of range [0, %g]", maxRolloutWait.Seconds())
	}
	if r := n.rollouts.get(req.GetSandboxId(), req.GetRolloutId()); r != nil && req.GetWaitS() > 0 {
		t := time.NewTimer(time.Duration(req.GetWaitS() * float64(time.Second)))
		defer t.Stop()
		select {
		case <-r.done:
		case <-t.C:
		case <-ctx.Done():
			return nil, errdefs.Classify(ctx.Err())
		}
	}
	v, err := n.rolloutView(req.GetSandboxId(), req.GetRolloutId())
	if err == nil && v == nil {
		err = errdefs.NotFound("sandbox %s has no rollout %q", req.GetSandboxId(), req.GetRolloutId())
	}
	return v, err
}

// rolloutKeepalive is how often WatchRollout says it is there while
// nothing happens (proxies close idle streams).
const rolloutKeepalive = 15 * time.Second

// WatchRollout sends a rollout's progress (see the proto): the rollout
// while it runs, its sandbox's log entries from req.FromSeq as they are
// written, and the rollout once it ended.
func (n *Node) WatchRollout(ctx context.Context, req *dsecv1.WatchRolloutRequest, send func(*dsecv1.RolloutEvent) error) error {
	sb, id := req.GetSandboxId(), req.GetRolloutId()
	v, err := n.GetRollout(ctx, &dsecv1.GetRolloutRequest{SandboxId: sb, RolloutId: id})
	if err != nil {
		return err
	}
	if v.State == RolloutRunning {
		if err := send(&dsecv1.RolloutEvent{Event: &dsecv1.RolloutEvent_Rollout{Rollout: v}}); err != nil {
			return err
		}
	}
	from := req.GetFromSeq()
	if from == 0 {
		from = v.StartSeq + 1
	}
	keep := time.NewTicker(rolloutKeepalive)
	defer keep.Stop()
	for {
		log, err := n.logs.Log(sb)
		if err != nil {
			return errdefs.Internal(err, "open trajectory log")
		}
		changed := log.Changed()
		entries, next, err := log.Read(from, 256)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if r := e.GetRollout(); r != nil && r.RolloutId == id && e.Op == "rollout_end" {
				// The entry is the rollout as it ended: the node's own
				// record of it may not say so yet (the end is logged
				// first), and a view from it would read "running".
				end := proto.Clone(r).(*dsecv1.Rollout)
				if end.StartSeq == 0 {
					end.StartSeq = v.StartSeq
				}
				end, err := n.counted(end)
				if err != nil {
					return err
				}
				return send(&dsecv1.RolloutEvent{Event: &dsecv1.RolloutEvent_Rollout{Rollout: end}})
			}
			if err := send(&dsecv1.RolloutEvent{Event: &dsecv1.RolloutEvent_Entry{Entry: e}}); err != nil {
				return err
			}
		}
		from = next
		if len(entries) == 256 {
			continue
		}
		select {
		case <-changed:
		case <-keep.C:
			if err := send(&dsecv1.RolloutEvent{Event: &dsecv1.RolloutEvent_Keepalive{Keepalive: true}}); err != nil {
				return err
			}
		case <-ctx.Done():
			return errdefs.Classify(ctx.Err())
		case <-n.stop:
			return errdefs.Unavailable("node %s is stopping", n.cfg.Name)
		}
	}
}

// rolloutView is a sandbox's rollout id as it is (nil if none): the
// node's while it watches it, else its log's.
func (n *Node) rolloutView(sandbox, id string) (*dsecv1.Rollout, error) {
	if r := n.rollouts.get(sandbox, id); r != nil {
		return n.counted(r.current())
	}
	if !n.logs.Exists(sandbox) {
		return nil, nil
	}
	log, err := n.logs.Log(sandbox)
	if err != nil {
		return nil, errdefs.Internal(err, "open trajectory log")
	}
	entries, _, err := log.Read(0, 0)
	if err != nil {
		return nil, err
	}
	var v *dsecv1.Rollout
	for _, e := range entries {
		if r := e.GetRollout(); r != nil && r.RolloutId == id {
			v = r
			if e.Op == "rollout_start" {
				v.StartSeq = e.Seq
			}
		}
	}
	if v == nil {
		return nil, nil
	}
	return n.counted(v)
}

// counted fills in v's progress from its sandbox's log.
func (n *Node) counted(v *dsecv1.Rollout) (*dsecv1.Rollout, error) {
	log, err := n.logs.Log(v.SandboxId)
	if err != nil {
		return nil, errdefs.Internal(err, "open trajectory log")
	}
	entries, _, err := log.Read(v.StartSeq+1, 0)
	if err != nil {
		return nil, err
	}
	v.ModelCalls, v.Commands = 0, 0
	for _, e := range entries {
		if r := e.GetRollout(); r != nil && r.RolloutId == v.RolloutId {
			break // its end
		}
		switch e.Op {
		case "model_call":
			v.ModelCalls++
		case "rollout_start", "rollout_end":
		default:
			v.Commands++
		}
	}
	return v, nil
}

// watchRollout waits for a rollout's agent to end, scores it and records
// its end. It returns without an end when the node closes (the next node
// attaches to the agent again: readoptRollouts).
func (n *Node) watchRollout(s *sandbox, r *rollout, p *guest.Process) {
	defer p.Close()
	var stdout, stderr []byte
	var exit *guestv1.Exit
	var lost error
	for exit == nil && lost == nil {
		m, err := p.Recv()
		switch {
		case err != nil:
			lost = err
		case m.GetOutput() != nil:
			if m.GetOutput().Fd == 2 {
				stderr = keepTail(stderr, m.GetOutput().Data)
			} else {
				stdout = keepTail(stdout, m.GetOutput().Data)
			}
		case m.GetExit() != nil:
			exit = m.GetExit()
		}
	}
	select {
	case <-n.stop:
		return
	default:
	}
	end := r.current()
	switch {
	case exit != nil:
		res := n.result(s, exit, p.ID)
		if len(res.Stdout) == 0 && len(res.Stderr) == 0 {
			res.Stdout, res.Stderr = stdout, stderr
		}
		end.Result = res
		end.State = RolloutFailed
		if exit.ExitCode == 0 && exit.Signal == 0 && !exit.TimedOut {
			end.State = RolloutSucceeded
		}
	case s.currentState().ending() && !s.endedInfra():
		end.State, end.Detail = RolloutCanceled, "the sandbox was deleted while the agent ran"
	default:
		end.State, end.Detail = RolloutInfra, "the sandbox's agent went away: "+errdefs.Classify(n.callFailed(s, lost)).Msg
	}
	if bad := n.infraModelCall(s.id, end.StartSeq); bad != "" && end.State != RolloutCanceled {
		end.State, end.Detail = RolloutInfra, bad
	}
	if v := end.Request.GetVerifier(); v != nil && (end.State == RolloutSucceeded || end.State == RolloutFailed) {
		n.verify(s, end, v)
	}
	// The end is logged and the record says so in one step: a view taken
	// after a watch saw the end in the log must not read "running" (run
	// 65: a reattached watch got running, the last entry, then the end).
	r.mu.Lock()
	n.endRollout(s.id, end)
	r.view = end
	r.mu.Unlock()
	close(r.done)
	n.rollouts.drop(r)
}

// endedInfra reports whether s ended for the platform's sake.
func (s *sandbox) endedInfra() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ending != nil && s.ending.infra
}

// infraModelCall names the first model call since the log entry start
// that failed for the platform's or an upstream's sake ("" if none).
func (n *Node) infraModelCall(sandbox string, start uint64) string {
	log, err := n.logs.Log(sandbox)
	if err != nil {
		return ""
	}
	entries, _, _ := log.Read(start+1, 0)
	for _, e := range entries {
		if e.Op == "model_call" && e.GetError().GetInfra() {
			return "model call " + strconv.FormatUint(e.GetModelCall().GetIndex(), 10) + " failed: " + e.GetError().GetMessage()
		}
	}
	return ""
}

// verify runs the verifier and records its exit and reward in end.
func (n *Node) verify(s *sandbox, end *dsecv1.Rollout, v *dsecv1.RolloutVerifier) {
	c, err := s.ctrOf("")
	if err == nil {
		var x *guestv1.Exec
		x, err = n.guestExec(c, &dsecv1.ExecRequest{Argv: v.Argv, Cmd: v.Cmd, TimeoutS: v.TimeoutS}, true)
		if err == nil {
			var exit *guestv1.Exit
			exit, err = c.guest.Run(n.life, x)
			if err == nil {
				end.Verifier = n.result(s, exit, "")
				end.Reward, end.HasReward = reward(exit.Stdout)
				return
			}
		}
	}
	err = n.callFailed(s, err)
	end.Detail = "the verifier did not run: " + errdefs.Classify(err).Msg
	if errdefs.IsInfra(err) {
		end.State = RolloutInfra
	}
}

// reward is the last non-empty line of out, as a number.
func reward(out []byte) (float64, bool) {
	lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
	if len(lines) == 0 {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(bytes.TrimSpace(lines[len(lines)-1])), 64)
	return f, err == nil
}

// endRollout records a rollout's end in its sandbox's log.
func (n *Node) endRollout(sandbox string, end *dsecv1.Rollout) {
	end.EndedAt = timestamppb.Now()
	log, err := n.logs.Log(sandbox)
	if err == nil {
		_, err = log.Append(&dsecv1.LogEntry{Op: "rollout_end", At: end.EndedAt, Rollout: end})
	}
	if err != nil {
		n.log.Error("record a rollout's end", slog.String("sandbox_id", sandbox), slog.String("rollout_id", end.RolloutId), slog.Any("error", err))
	}
	if n.sandboxes.get(sandbox) == nil {
		n.logs.Forget(sandbox) // the sandbox ended: its log closes again
	}
}

// readoptRollouts watches again the rollouts of a re-adopted sandbox
// that had not ended: their agents ran on while the node was away.
func (n *Node) readoptRollouts(s *sandbox) {
	if !n.logs.Exists(s.id) {
		return
	}
	log, err := n.logs.Log(s.id)
	if err != nil {
		return
	}
	entries, _, err := log.Read(0, 0)
	if err != nil {
		return
	}
	open := map[string]*dsecv1.Rollout{}
	var order []string
	for _, e := range entries {
		r := e.GetRollout()
		switch {
		case r == nil:
		case e.Op == "rollout_start":
			r.StartSeq = e.Seq
			open[r.RolloutId] = r
			order = append(order, r.RolloutId)
		case e.Op == "rollout_end":
			delete(open, r.RolloutId)
		}
	}
	for _, id := range order {
		view := open[id]
		if view == nil {
			continue
		}
		r := &rollout{view: view, done: make(chan struct{})}
		if ws := view.GetRequest().GetWorkers(); len(ws) > 0 {
			r.workers = &workerCalls{workers: setOf(ws)}
			r.workers.restore(n, id, s.id)
		}
		c, err := s.ctrOf("")
		var p *guest.Process
		if err == nil {
			var pg substrate.ProcessGuest
			if pg, err = c.procs(); err == nil {
				p, err = pg.Attach(n.life, "", rolloutTag+id, false)
			}
		}
		if err != nil {
			view.State, view.Detail = RolloutInfra, "the agent was lost across a node restart: "+errdefs.Classify(err).Msg
			n.endRollout(s.id, view)
			continue
		}
		n.rollouts.put(r)
		go n.watchRollout(s, r, p)
	}
}
