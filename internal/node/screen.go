package node

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
)

// Limits of one SendInput call.
const (
	maxInputActions = 1024
	maxInputText    = 16384
)

// screen returns a live sandbox whose kind has a screen, and the screen.
func (n *Node) screen(ctx context.Context, id string) (*sandbox, substrate.Screen, error) {
	s, err := n.live(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	scr, err := can[substrate.Screen](s, "has no screen (use kind vm)")
	return s, scr, err
}

// Screenshot captures a sandbox's screen as PNG. A paused sandbox is
// resumed first, as for any call.
func (n *Node) Screenshot(ctx context.Context, req *dsecv1.ScreenshotRequest) (*dsecv1.ScreenshotResponse, error) {
	s, scr, err := n.screen(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	shot, err := scr.Screenshot(ctx)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return &dsecv1.ScreenshotResponse{Png: shot.PNG, Width: int32(shot.Width), Height: int32(shot.Height)}, nil
}

// SendInput sends keyboard and mouse actions to a sandbox's screen, in
// order. Input is not part of the trajectory log.
func (n *Node) SendInput(ctx context.Context, req *dsecv1.SendInputRequest) error {
	actions, err := inputActions(req.GetActions())
	if err != nil {
		return err
	}
	s, scr, err := n.screen(ctx, req.GetSandboxId())
	if err != nil {
		return err
	}
	if err := scr.SendInput(ctx, actions); err != nil {
		return n.callFailed(s, err)
	}
	return nil
}

// OpenVNC gives a sandbox's VNC server a new password and returns it
// with the server's loopback address.
func (n *Node) OpenVNC(ctx context.Context, req *dsecv1.OpenVNCRequest) (*dsecv1.OpenVNCResponse, error) {
	s, scr, err := n.screen(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	v, err := scr.OpenVNC(ctx)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return &dsecv1.OpenVNCResponse{Address: v.Address, Password: v.Password, ExpiresAt: timestamppb.New(v.Expires)}, nil
}

// inputActions validates API input actions and converts them for the
// driver.
func inputActions(in []*dsecv1.InputAction) ([]substrate.InputAction, error) {
	if len(in) == 0 {
		return nil, errdefs.Invalid("actions is empty")
	}
	if len(in) > maxInputActions {
		return nil, errdefs.Invalid("at most %d input actions per call", maxInputActions)
	}
	text := 0
	out := make([]substrate.InputAction, 0, len(in))
	for i, a := range in {
		var x substrate.InputAction
		switch v := a.GetAction().(type) {
		case *dsecv1.InputAction_Text:
			if v.Text == "" {
				return nil, errdefs.Invalid("action %d: empty text", i)
			}
			text += len(v.Text)
			x.Text = v.Text
		case *dsecv1.InputAction_Keys:
			if v.Keys == "" || len(v.Keys) > 256 {
				return nil, errdefs.Invalid("action %d: keys must be 1 to 256 characters", i)
			}
			x.Keys = v.Keys
		case *dsecv1.InputAction_Move:
			x.Move = &substrate.Point{X: int(v.Move.GetX()), Y: int(v.Move.GetY())}
		case *dsecv1.InputAction_Click:
			c := v.Click
			if c.GetCount() < 0 || c.GetCount() > 10 {
				return nil, errdefs.Invalid("action %d: click count %d out of range [1, 10]", i, c.GetCount())
			}
			x.Click = &substrate.Click{Point: substrate.Point{X: int(c.GetX()), Y: int(c.GetY())}, Button: c.GetButton(), Count: int(c.GetCount())}
		case *dsecv1.InputAction_Button:
			x.Button = &substrate.Button{Button: v.Button.GetButton(), Down: v.Button.GetDown()}
		case *dsecv1.InputAction_Scroll:
			dx, dy := v.Scroll.GetDx(), v.Scroll.GetDy()
			if dx < -100 || dx > 100 || dy < -100 || dy > 100 || (dx == 0 && dy == 0) {
				return nil, errdefs.Invalid("action %d: scroll by 1 to 100 clicks", i)
			}
			x.Scroll = &substrate.Scroll{DX: int(dx), DY: int(dy)}
		default:
			return nil, errdefs.Invalid("action %d sets no action", i)
		}
		out = append(out, x)
	}
	if text > maxInputText {
		return nil, errdefs.Invalid("at most %d characters of text per call", maxInputText)
	}
	return out, nil
}
