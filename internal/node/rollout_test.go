package node

import (
	"strings"
	"testing"

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
		got, err := tn.GetRollout(bg, &dsecv1.GetRolloutRequest{SandboxId: sb.Id, RolloutId: "r1"})
		if err != nil || got.Commands != 1 {
			t.Fatalf("r1's commands: %v, %v", got, err)
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
