package dsec

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Screenshot captures the sandbox's screen as PNG (kinds with the
// "screen" capability: vm), with its size in pixels.
func (s *Sandbox) Screenshot(ctx context.Context) (*dsecv1.ScreenshotResponse, error) {
	r, err := s.c.raw.Screenshot(ctx, connect.NewRequest(&dsecv1.ScreenshotRequest{SandboxId: s.ID}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Input sends keyboard and mouse actions to the sandbox's screen, in
// order (build them with TypeText, PressKeys, MoveMouse, Click,
// MouseButton and Scroll).
func (s *Sandbox) Input(ctx context.Context, actions ...*dsecv1.InputAction) error {
	_, err := s.c.raw.SendInput(ctx, connect.NewRequest(&dsecv1.SendInputRequest{SandboxId: s.ID, Actions: actions}))
	return err
}

// OpenVNC gives the sandbox's VNC server a new password and returns it
// with the server's address, on the node's loopback interface (a node
// started with vm.vnc).
func (s *Sandbox) OpenVNC(ctx context.Context) (*dsecv1.OpenVNCResponse, error) {
	r, err := s.c.raw.OpenVNC(ctx, connect.NewRequest(&dsecv1.OpenVNCRequest{SandboxId: s.ID}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// TypeText types text on a US keyboard layout ("\n" is Return).
func TypeText(text string) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Text{Text: text}}
}

// PressKeys presses a key combination such as "ctrl+c", "Return" or
// "alt+F4".
func PressKeys(combo string) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Keys{Keys: combo}}
}

// MoveMouse moves the pointer to a screen position (pixels).
func MoveMouse(x, y int) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Move{Move: &dsecv1.Point{X: int32(x), Y: int32(y)}}}
}

// Click moves the pointer to a position and clicks button ("left",
// "middle", "right"; "" is left) count times (0 is once).
func Click(x, y int, button string, count int) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Click{Click: &dsecv1.MouseClick{X: int32(x), Y: int32(y), Button: button, Count: int32(count)}}}
}

// MouseButton presses (down) or releases a button where the pointer is.
func MouseButton(button string, down bool) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Button{Button: &dsecv1.MouseButton{Button: button, Down: down}}}
}

// Scroll turns the mouse wheel: dy clicks down (negative: up), dx right.
func Scroll(dx, dy int) *dsecv1.InputAction {
	return &dsecv1.InputAction{Action: &dsecv1.InputAction_Scroll{Scroll: &dsecv1.MouseScroll{Dx: int32(dx), Dy: int32(dy)}}}
}
