package node

import (
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

func TestInputActionsAreValidated(t *testing.T) {
	text := func(s string) *dsecv1.InputAction {
		return &dsecv1.InputAction{Action: &dsecv1.InputAction_Text{Text: s}}
	}
	many := make([]*dsecv1.InputAction, maxInputActions+1)
	for i := range many {
		many[i] = text("x")
	}
	cases := []struct {
		name    string
		actions []*dsecv1.InputAction
		ok      bool
	}{
		{"an action of each sort converts", []*dsecv1.InputAction{
			text("ls\n"),
			{Action: &dsecv1.InputAction_Keys{Keys: "ctrl+c"}},
			{Action: &dsecv1.InputAction_Move{Move: &dsecv1.Point{X: 1, Y: 2}}},
			{Action: &dsecv1.InputAction_Click{Click: &dsecv1.MouseClick{X: 3, Y: 4, Button: "right", Count: 2}}},
			{Action: &dsecv1.InputAction_Button{Button: &dsecv1.MouseButton{Down: true}}},
			{Action: &dsecv1.InputAction_Scroll{Scroll: &dsecv1.MouseScroll{Dy: -3}}},
		}, true},
		{"no actions is invalid", nil, false},
		{"an empty action is invalid", []*dsecv1.InputAction{{}}, false},
		{"empty text is invalid", []*dsecv1.InputAction{text("")}, false},
		{"too many actions are invalid", many, false},
		{"too much text is invalid", []*dsecv1.InputAction{text(strings.Repeat("x", maxInputText+1))}, false},
		{"a scroll of nothing is invalid", []*dsecv1.InputAction{{Action: &dsecv1.InputAction_Scroll{Scroll: &dsecv1.MouseScroll{}}}}, false},
		{"a click count out of range is invalid", []*dsecv1.InputAction{{Action: &dsecv1.InputAction_Click{Click: &dsecv1.MouseClick{Count: 11}}}}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, err := inputActions(c.actions)
			if c.ok {
				if err != nil || len(out) != len(c.actions) {
					t.Fatalf("got %v %v", out, err)
				}
				if out[3].Click.Button != "right" || out[3].Click.Count != 2 || out[5].Scroll.DY != -3 || !out[4].Button.Down {
					t.Fatalf("converted %+v", out)
				}
				return
			}
			if !errdefs.Is(err, errdefs.KindInvalid) {
				t.Fatalf("got %v, want invalid", err)
			}
		})
	}
}
