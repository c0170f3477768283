package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// Screenshot captures the VM's display (QMP screendump) as PNG, at the
// resolution the guest set (720x400 for an 80x25 text console).
func (i *instance) Screenshot(ctx context.Context) (*substrate.Screenshot, error) {
	q, err := i.VM.Monitor(ctx)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	png, w, h, err := qemu.Screendump(ctx, q, i.Path("screen-"+randomHex()+".png"))
	if err != nil {
		return nil, i.monitorErr(err, "take a screenshot")
	}
	return &substrate.Screenshot{PNG: png, Width: w, Height: h}, nil
}

// SendInput types, presses keys and moves and clicks the pointer, in
// order, through QMP input-send-event: keys go to the PS/2 keyboard,
// positions to the virtio tablet (absolute, scaled from the screen's
// pixels), buttons and the wheel to the pointer the guest uses.
func (i *instance) SendInput(ctx context.Context, actions []substrate.InputAction) error {
	q, err := i.VM.Monitor(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	var w, h int
	size := func() error {
		if w > 0 {
			return nil
		}
		_, w, h, err = qemu.Screendump(ctx, q, i.Path("screen-"+randomHex()+".png"))
		if err != nil {
			return i.monitorErr(err, "read the screen size")
		}
		return nil
	}
	at := func(p substrate.Point) (qemu.InputEvent, error) {
		if err := size(); err != nil {
			return qemu.InputEvent{}, err
		}
		if p.X < 0 || p.Y < 0 || p.X >= w || p.Y >= h {
			return qemu.InputEvent{}, errdefs.Invalid("position (%d, %d) is off the %dx%d screen", p.X, p.Y, w, h)
		}
		return qemu.InputEvent{Abs: true, X: p.X * qemu.AbsMax / max(w-1, 1), Y: p.Y * qemu.AbsMax / max(h-1, 1)}, nil
	}
	var events []qemu.InputEvent
	for _, a := range actions {
		switch {
		case a.Text != "":
			ev, err := qemu.TextEvents(a.Text)
			if err != nil {
				return errdefs.Invalid("%v", err)
			}
			events = append(events, ev...)
		case a.Keys != "":
			ev, err := qemu.KeyEvents(a.Keys)
			if err != nil {
				return errdefs.Invalid("%v", err)
			}
			events = append(events, ev...)
		case a.Move != nil:
			e, err := at(*a.Move)
			if err != nil {
				return err
			}
			events = append(events, e)
		case a.Click != nil:
			e, err := at(a.Click.Point)
			if err != nil {
				return err
			}
			b, err := button(a.Click.Button)
			if err != nil {
				return err
			}
			events = append(events, e)
			for k := 0; k < max(a.Click.Count, 1); k++ {
				events = append(events, qemu.InputEvent{Button: b, Down: true}, qemu.InputEvent{Button: b})
			}
		case a.Button != nil:
			b, err := button(a.Button.Button)
			if err != nil {
				return err
			}
			events = append(events, qemu.InputEvent{Button: b, Down: a.Button.Down})
		case a.Scroll != nil:
			wheel := func(n int, neg, pos string) {
				b := pos
				if n < 0 {
					b, n = neg, -n
				}
				for k := 0; k < n; k++ {
					events = append(events, qemu.InputEvent{Button: b, Down: true}, qemu.InputEvent{Button: b})
				}
			}
			wheel(a.Scroll.DY, "wheel-up", "wheel-down")
			wheel(a.Scroll.DX, "wheel-left", "wheel-right")
		default:
			return errdefs.Invalid("an input action sets nothing")
		}
	}
	if err := qemu.SendInput(ctx, q, events); err != nil {
		return i.monitorErr(err, "send input")
	}
	return nil
}

// vncPasswordTTL is how long an OpenVNC password is valid.
const vncPasswordTTL = time.Hour

// OpenVNC gives the VM's VNC server a new random password (QMP
// set_password; VNC authentication takes 8 characters) valid for an hour,
// and returns it with the server's loopback address (query-vnc).
func (i *instance) OpenVNC(ctx context.Context) (*substrate.VNC, error) {
	if !i.d.cfg.VNC {
		return nil, errdefs.Unimplemented("this node starts VMs without VNC (vm.vnc: true turns it on)")
	}
	q, err := i.VM.Monitor(ctx)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	var info struct {
		Enabled bool   `json:"enabled"`
		Host    string `json:"host"`
		Service string `json:"service"`
	}
	if err := q.Execute(ctx, "query-vnc", nil, &info); err != nil {
		return nil, i.monitorErr(err, "query the VNC server")
	}
	if !info.Enabled {
		return nil, errdefs.Unimplemented("this VM was started without VNC")
	}
	const letters = "abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
	b := make([]byte, 8)
	rand.Read(b)
	for k := range b {
		b[k] = letters[int(b[k])%len(letters)]
	}
	expires := time.Now().Add(vncPasswordTTL)
	if err := q.Execute(ctx, "set_password", map[string]any{"protocol": "vnc", "password": string(b)}, nil); err != nil {
		return nil, i.monitorErr(err, "set the VNC password")
	}
	if err := q.Execute(ctx, "expire_password", map[string]any{"protocol": "vnc", "time": fmt.Sprint(expires.Unix())}, nil); err != nil {
		return nil, i.monitorErr(err, "set the VNC password's expiry")
	}
	return &substrate.VNC{Address: net.JoinHostPort(info.Host, info.Service), Password: string(b), Expires: expires}, nil
}

// button maps a button name to QEMU's.
func button(name string) (string, error) {
	switch name {
	case "", "left":
		return "left", nil
	case "middle", "right":
		return name, nil
	}
	return "", errdefs.Invalid("mouse button %q (use left, middle or right)", name)
}

// monitorErr classifies a failed monitor command: gone if QEMU died,
// invalid if QEMU refused the command's arguments.
func (i *instance) monitorErr(err error, what string) error {
	if cerr := i.VM.Check(); cerr != nil {
		return cerr
	}
	var qe *qemu.QMPError
	if errors.As(err, &qe) && qe.Class == "GenericError" {
		return errdefs.Invalid("%s: %s", what, qe.Desc)
	}
	if e := errdefs.Classify(err); e.Kind == errdefs.KindCanceled || e.Kind == errdefs.KindDeadlineExceeded {
		return e
	}
	return errdefs.Internal(err, "%s", what)
}

func randomHex() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
