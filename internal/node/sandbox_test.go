package node

import (
	"testing"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestSandboxStates(t *testing.T) {
	all := []state{stateRunning, statePaused, stateDeleting, stateDeleted, stateFailed}
	allowed := map[[2]state]bool{
		{stateRunning, statePaused}: true, {stateRunning, stateDeleting}: true,
		{statePaused, stateRunning}: true, {statePaused, stateDeleting}: true,
		{stateDeleting, stateDeleted}: true, {stateDeleting, stateFailed}: true,
	}
	for _, from := range all {
		for _, to := range all {
			move := [2]state{from, to}
			t.Run(from.String()+" to "+to.String(), func(t *testing.T) {
				s := &sandbox{id: "x", state: from}
				err := s.moveLocked(to)
				switch {
				case allowed[move] && err != nil:
					t.Fatalf("refused: %v", err)
				case allowed[move] && s.state != to:
					t.Fatalf("state %s after the move", s.state)
				case !allowed[move] && err == nil:
					t.Fatal("allowed")
				case !allowed[move] && s.state != from:
					t.Fatalf("a refused move changed the state to %s", s.state)
				case !allowed[move] && from.ending() && !to.ending() && !errdefs.Is(err, errdefs.KindNotFound):
					t.Fatalf("a call on an ending sandbox got %v, want not found", err)
				}
			})
		}
	}

	t.Run("a release that fails puts the state back, and only a deleting one", func(t *testing.T) {
		s := &sandbox{state: stateDeleting}
		s.undeleteLocked(statePaused)
		if s.state != statePaused {
			t.Fatalf("state %s", s.state)
		}
		s.state = stateDeleted
		s.undeleteLocked(stateRunning)
		if s.state != stateDeleted {
			t.Fatalf("a deleted sandbox came back %s", s.state)
		}
	})

	t.Run("names read back as their states, deleting shows as deleted", func(t *testing.T) {
		for _, st := range all {
			if parseState(st.String()) != st {
				t.Errorf("%s reads back as %s", st, parseState(st.String()))
			}
		}
		if parseState("") != 0 || parseState("frozen") != 0 {
			t.Error("unknown names read as states")
		}
		if stateDeleting.public() != "deleted" || statePaused.public() != "paused" {
			t.Error("public names")
		}
	})
}
