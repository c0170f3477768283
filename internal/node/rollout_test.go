package node

import (
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway/gatewaytest"
)

func (tn *testNode) waitRollout(id, rollout string) *dsecv1.Rollout {
	tn.t.Helper()
	for i := 0; i < 10; i++ {
		r, err := tn.GetRollout(bg, &dsecv1.GetRolloutRequest{SandboxId: id, RolloutId: rollout, WaitS: 30})
		if err != nil {
			tn.t.Fatal(err)
		}
		if r.State != RolloutRunning {
			return r
		}
	}
	tn.t.Fatalf("rollout %s did not end", rollout)
	return nil
}

func TestARolloutRunsOnScoredByItsVerifier(t *testing.T) {
	tn := newTestNode(t, nil)
	sb := tn.create(bg, nil)
	start := func(id, cmd string) *dsecv1.Rollout {
		t.Helper()
		r, err := tn.StartRollout(bg, &dsecv1.StartRolloutRequest{SandboxId: sb.Id, RolloutId: id, Cmd: cmd,
			Verifier: &dsecv1.RolloutVerifier{Cmd: "test -f /tmp/answer && echo scoring && echo 0.75 || echo 0"}})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	// The agents wait on fifos for a command of the trainer's (which the
	// rollout's progress then counts).
	tn.sh(bg, sb.Id, "mkfifo /tmp/ready /tmp/go")
	r := start("r1", "read x < /tmp/ready; echo thinking; echo 42 > /tmp/answer; echo to stderr >&2")
	if r.State != RolloutRunning || r.StartSeq == 0 {
		t.Fatalf("started as %v", r)
	}
	tn.sh(bg, sb.Id, "echo a command of the rollout")
	tn.sh(bg, sb.Id, "echo go > /tmp/ready")
	end := tn.waitRollout(sb.Id, "r1")
	if end.State != RolloutSucceeded || !end.HasReward || end.Reward != 0.75 || end.Result.GetExitCode() != 0 {
		t.Fatalf("ended as %v", end)
	}
	if string(end.Result.Stdout) != "thinking\n" || string(end.Result.Stderr) != "to stderr\n" || end.Verifier.GetExitCode() != 0 {
		t.Fatalf("result %q %q, verifier %v", end.Result.Stdout, end.Result.Stderr, end.Verifier)
	}

	t.Run("starting it again reattaches and runs nothing", func(t *testing.T) {
		again := start("r1", "echo a second agent > /tmp/second")
		if again.State != RolloutSucceeded || again.StartSeq != r.StartSeq {
			t.Fatalf("restart answered %v", again)
		}
		if out, _ := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "test -e /tmp/second"}); out.ExitCode == 0 {
			t.Fatal("the second start ran its command")
		}
	})

	t.Run("an agent that fails is the task's failure, still scored", func(t *testing.T) {
		start("r2", "rm -f /tmp/answer; exit 3")
		end := tn.waitRollout(sb.Id, "r2")
		if end.State != RolloutFailed || end.Result.GetExitCode() != 3 || !end.HasReward || end.Reward != 0 {
			t.Fatalf("ended as %v", end)
		}
	})

	t.Run("a rollout outlives a node restart", func(t *testing.T) {
		// The agent waits for a file the test writes once the node is back.
		start("r3", "read x < /tmp/go; echo 1 > /tmp/answer")
		tn.restart(nil)
		if r, _ := tn.GetRollout(bg, &dsecv1.GetRolloutRequest{SandboxId: sb.Id, RolloutId: "r3"}); r.GetState() != RolloutRunning {
			t.Fatalf("after the restart: %v", r)
		}
		tn.sh(bg, sb.Id, "echo go > /tmp/go")
		if end := tn.waitRollout(sb.Id, "r3"); end.State != RolloutSucceeded || end.Reward != 0.75 {
			t.Fatalf("ended as %v", end)
		}
	})

	t.Run("the log counts its progress", func(t *testing.T) {
		// The command that let the agent go may be logged after its end.
		got, err := tn.GetRollout(bg, &dsecv1.GetRolloutRequest{SandboxId: sb.Id, RolloutId: "r1"})
		if err != nil || got.Commands < 1 || got.Commands > 2 {
			t.Fatalf("r1's commands: %v, %v", got, err)
		}
	})

	t.Run("a watch streams its progress as it happens, and ends with it", func(t *testing.T) {
		tn.sh(bg, sb.Id, "mkfifo /tmp/w4")
		start("r4", "read x < /tmp/w4; echo 1 > /tmp/answer")
		events := make(chan *dsecv1.RolloutEvent, 16)
		watched := make(chan error, 1)
		go func() {
			watched <- tn.WatchRollout(bg, &dsecv1.WatchRolloutRequest{SandboxId: sb.Id, RolloutId: "r4"}, func(ev *dsecv1.RolloutEvent) error {
				events <- ev
				return nil
			})
		}()
		next := func() *dsecv1.RolloutEvent {
			t.Helper()
			select {
			case ev := <-events:
				return ev
			case err := <-watched:
				// The watch sends its last event before it returns: when
				// both are ready, select may take the end first.
				select {
				case ev := <-events:
					watched <- err
					return ev
				default:
				}
				t.Fatalf("the watch ended early: %v", err)
			case <-time.After(time.Minute):
				t.Fatal("no event within a minute")
			}
			return nil
		}
		if ev := next(); ev.GetRollout().GetState() != RolloutRunning {
			t.Fatalf("first event %v", ev)
		}
		// A command of the trainer's is streamed while the agent still waits.
		tn.sh(bg, sb.Id, "echo progress")
		ev := next()
		if ev.GetEntry().GetOp() != "exec" || !strings.Contains(strings.Join(ev.GetEntry().GetArgv(), " "), "echo progress") {
			t.Fatalf("second event %v", ev)
		}
		seen := ev.GetEntry().GetSeq()
		tn.sh(bg, sb.Id, "echo go > /tmp/w4")
		var last *dsecv1.RolloutEvent
		for last = next(); last.GetRollout() == nil; last = next() {
		}
		// The exec that let the agent go may be logged after the end (the
		// agent exits as the fifo is written, before that exec answers).
		if last.GetRollout().GetState() != RolloutSucceeded || last.GetRollout().GetCommands() < 1 {
			t.Fatalf("last event %v", last)
		}
		if err := <-watched; err != nil {
			t.Fatalf("the watch of an ended rollout: %v", err)
		}
		// A trainer that reattaches after the entry it saw gets the rest.
		var again []*dsecv1.RolloutEvent
		err := tn.WatchRollout(bg, &dsecv1.WatchRolloutRequest{SandboxId: sb.Id, RolloutId: "r4", FromSeq: seen + 1}, func(ev *dsecv1.RolloutEvent) error {
			again = append(again, ev)
			return nil
		})
		n := len(again)
		if err != nil || n == 0 || n > 2 || again[n-1].GetRollout().GetState() != RolloutSucceeded || (n == 2 && again[0].GetEntry().GetSeq() != seen+1) {
			t.Fatalf("reattached: %v, %v", again, err)
		}
		if err := tn.WatchRollout(as("other"), &dsecv1.WatchRolloutRequest{SandboxId: sb.Id, RolloutId: "r4"}, func(*dsecv1.RolloutEvent) error { return nil }); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("another project watches the rollout: %v", err)
		}
	})

	t.Run("bad requests", func(t *testing.T) {
		for _, req := range []*dsecv1.StartRolloutRequest{
			{SandboxId: sb.Id, RolloutId: "has space", Cmd: "true"},
			{SandboxId: sb.Id, RolloutId: "x"},
			{SandboxId: sb.Id, RolloutId: "y", Cmd: "true", Verifier: &dsecv1.RolloutVerifier{}},
		} {
			if _, err := tn.StartRollout(bg, req); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Errorf("%v: %v", req, err)
			}
		}
		if _, err := tn.GetRollout(as("other"), &dsecv1.GetRolloutRequest{SandboxId: sb.Id, RolloutId: "r1"}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("another project reads the rollout: %v", err)
		}
	})
}

func TestARolloutWhoseModelUpstreamFailsIsInfra(t *testing.T) {
	tn := newTestNode(t, nil)
	m := gatewaytest.NewModel(t)
	m.Set(func(m *gatewaytest.Model) { m.Mode = "garbage" })
	withModels(t, tn, m)
	sb := tn.create(bg, &dsecv1.SandboxSpec{Session: "s", ModelGateway: &dsecv1.ModelGateway{Enabled: true}})
	body := `{"model":"policy","messages":[{"role":"user","content":"hi"}]}`
	if _, err := tn.StartRollout(bg, &dsecv1.StartRolloutRequest{SandboxId: sb.Id, RolloutId: "r", Cmd: `wget -q -O - --post-data '` + body + `' "$OPENAI_BASE_URL/chat/completions"; exit 1`}); err != nil {
		t.Fatal(err)
	}
	end := tn.waitRollout(sb.Id, "r")
	if end.State != RolloutInfra || !strings.Contains(end.Detail, "model call 1") || end.ModelCalls != 1 {
		t.Fatalf("ended as %v", end)
	}
}

func TestARolloutsAgentDrivesItsWorkersAndAResumeIsAnsweredFromTheirLogs(t *testing.T) {
	tn := newTestNode(t, nil)
	worker := tn.create(bg, nil)
	other := tn.create(bg, nil)
	tn.sh(bg, worker.Id, "touch /tmp/count")
	agentIn := func(from string) *dsecv1.SandboxSpec {
		return &dsecv1.SandboxSpec{ModelGateway: &dsecv1.ModelGateway{Enabled: true, FastForwardFrom: from}}
	}
	// The agent runs commands in its worker through the dsec API its
	// environment names, with busybox's wget (no key), and prints what
	// the worker answered.
	agent := func(cmds ...string) string {
		script := `call() { wget -q -O - --header 'Content-Type: application/json' --post-data "{\"sandboxId\":\"$DSEC_WORKERS\",\"cmd\":\"$1\"}" "$DSEC_URL/dsec.v1.ProcessService/Exec" || exit 9; echo; }`
		for _, c := range cmds {
			script += "\ncall '" + c + "'"
		}
		return script
	}
	count := func() string { return strings.TrimSpace(tn.sh(bg, worker.Id, "wc -l < /tmp/count")) }
	run := func(sb, cmd string) *dsecv1.Rollout {
		t.Helper()
		if _, err := tn.StartRollout(bg, &dsecv1.StartRolloutRequest{SandboxId: sb, RolloutId: "traj", Cmd: cmd, Workers: []string{worker.Id}}); err != nil {
			t.Fatal(err)
		}
		end := tn.waitRollout(sb, "traj")
		if end.State != RolloutSucceeded {
			t.Fatalf("the agent's rollout ended as %v", end)
		}
		return end
	}
	step1, step2 := "echo one >> /tmp/count", "echo two >> /tmp/count"

	first := tn.create(bg, agentIn(""))
	end := run(first.Id, agent(step1, step2))
	if count() != "2" || end.WorkerCalls != 2 || end.WorkerReplays != 0 || end.Divergence != "" {
		t.Fatalf("the first run: %s lines in the worker, rollout %v", count(), end)
	}

	t.Run("the same rollout in a new agent sandbox is answered from the worker's log", func(t *testing.T) {
		again := tn.create(bg, agentIn(first.Id))
		end := run(again.Id, agent(step1, step2))
		if count() != "2" || end.WorkerCalls != 2 || end.WorkerReplays != 2 || end.Divergence != "" {
			t.Fatalf("the resume: %s lines in the worker, rollout %v", count(), end)
		}
	})

	t.Run("a resumed agent that sends another call runs live from there, and says where", func(t *testing.T) {
		third := tn.create(bg, agentIn(first.Id))
		end := run(third.Id, agent(step1, "echo three >> /tmp/count", step2))
		if count() != "4" || end.WorkerCalls != 3 || end.WorkerReplays != 1 || !strings.Contains(end.Divergence, "call 2 differs") {
			t.Fatalf("the diverged run: %s lines in the worker, rollout %v", count(), end)
		}
	})

	t.Run("the agent reaches its rollout's workers only, and only while it runs", func(t *testing.T) {
		tn.sh(bg, first.Id, "mkfifo /tmp/hold")
		if _, err := tn.StartRollout(bg, &dsecv1.StartRolloutRequest{SandboxId: first.Id, RolloutId: "held", Cmd: "read x < /tmp/hold", Workers: []string{worker.Id}}); err != nil {
			t.Fatal(err)
		}
		call := func(target string) int32 {
			res, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: first.Id, Cmd: `wget -q -O - --header 'Content-Type: application/json' --post-data '{"sandboxId":"` + target + `","cmd":"true"}' "http://127.0.0.1:4319/dsec.v1.ProcessService/Exec"`})
			if err != nil {
				t.Fatal(err)
			}
			return res.ExitCode
		}
		if code := call(other.Id); code == 0 {
			t.Fatal("the agent ran a command in a sandbox that is not its worker")
		}
		if code := call(worker.Id); code != 0 {
			t.Fatalf("the agent's call to its worker exited %d", code)
		}
		tn.sh(bg, first.Id, "echo go > /tmp/hold")
		tn.waitRollout(first.Id, "held")
		if code := call(worker.Id); code == 0 {
			t.Fatal("the agent reached its worker after its rollout ended")
		}
	})

	t.Run("bad workers", func(t *testing.T) {
		plain := tn.create(bg, nil)
		for _, req := range []*dsecv1.StartRolloutRequest{
			{SandboxId: plain.Id, RolloutId: "w1", Cmd: "true", Workers: []string{worker.Id}},
			{SandboxId: first.Id, RolloutId: "w2", Cmd: "true", Workers: []string{first.Id}},
		} {
			if _, err := tn.StartRollout(bg, req); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Errorf("%v: %v", req, err)
			}
		}
		foreign, err := tn.Create(as("b"), &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, Project: "b"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tn.StartRollout(bg, &dsecv1.StartRolloutRequest{SandboxId: first.Id, RolloutId: "w3", Cmd: "true", Workers: []string{foreign.Id}}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("another project's sandbox as a worker: %v", err)
		}
	})
}
