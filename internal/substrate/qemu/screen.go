package qemu

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"image"
	"image/png"
	"io"
	"os"
	"strings"
	"time"
)

// Screendump captures the VM's display as a PNG through QMP's screendump,
// which QEMU writes to path (removed afterwards). QEMU 7.1 and later
// write PNG themselves; older ones write PPM, which is converted here.
// It returns the image and its size (the guest's display mode).
func Screendump(ctx context.Context, q *QMP, path string) (pngData []byte, width, height int, err error) {
	defer os.Remove(path)
	err = q.Execute(ctx, "screendump", map[string]any{"filename": path, "format": "png"}, nil)
	var qe *QMPError
	if errors.As(err, &qe) && strings.Contains(qe.Desc, "format") {
		// No PNG support (QEMU < 7.1 or built without libpng).
		if err := q.Execute(ctx, "screendump", map[string]any{"filename": path}, nil); err != nil {
			return nil, 0, 0, err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, 0, 0, err
		}
		img, err := decodePPM(bytes.NewReader(b))
		if err != nil {
			return nil, 0, 0, fmt.Errorf("decode the screendump: %w", err)
		}
		var buf bytes.Buffer
		if err := (&png.Encoder{CompressionLevel: png.BestSpeed}).Encode(&buf, img); err != nil {
			return nil, 0, 0, err
		}
		r := img.Bounds()
		return buf.Bytes(), r.Dx(), r.Dy(), nil
	}
	if err != nil {
		return nil, 0, 0, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, 0, 0, err
	}
	cfg, err := png.DecodeConfig(bytes.NewReader(b))
	if err != nil {
		return nil, 0, 0, fmt.Errorf("decode the screendump: %w", err)
	}
	return b, cfg.Width, cfg.Height, nil
}

// decodePPM decodes a binary PPM (P6, 8 bits per sample), the format of
// QEMU's screendump.
func decodePPM(r io.Reader) (image.Image, error) {
	br := bufio.NewReader(r)
	var magic string
	var w, h, maxv int
	if _, err := fmt.Fscan(br, &magic, &w, &h, &maxv); err != nil {
		return nil, err
	}
	if magic != "P6" || maxv != 255 || w <= 0 || h <= 0 || w > 1<<14 || h > 1<<14 {
		return nil, fmt.Errorf("unsupported PPM %s %dx%d max %d", magic, w, h, maxv)
	}
	if _, err := br.ReadByte(); err != nil { // the one whitespace before the data
		return nil, err
	}
	pix := make([]byte, w*h*3)
	if _, err := io.ReadFull(br, pix); err != nil {
		return nil, err
	}
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	for i, j := 0, 0; i < len(pix); i, j = i+3, j+4 {
		img.Pix[j], img.Pix[j+1], img.Pix[j+2], img.Pix[j+3] = pix[i], pix[i+1], pix[i+2], 0xff
	}
	return img, nil
}

// InputEvent is one event of QMP's input-send-event: a key (by QEMU key
// code) or mouse button going down or up, or an absolute pointer
// position.
type InputEvent struct {
	Key    string // QEMU key code ("a", "ret", "ctrl", ...)
	Button string // "left", "middle", "right", "wheel-up", ...
	Down   bool
	// Abs sets the pointer to X, Y in QEMU's absolute range [0, AbsMax].
	Abs  bool
	X, Y int
}

// AbsMax is the largest absolute pointer coordinate QEMU takes.
const AbsMax = 0x7fff

// SendInput sends events to the VM's keyboard and pointer, in order. Key
// events go in small batches with a pause between them: a PS/2 keyboard
// holds only 16 bytes of scancodes (QEMU drops what does not fit), and a
// guest under emulation drains them slowly. Pointer events are not
// limited.
func SendInput(ctx context.Context, q *QMP, events []InputEvent) error {
	const keysPerBatch = 6 // key events: three keys pressed and released
	for len(events) > 0 {
		n, keys := 0, 0
		for n < len(events) && (events[n].Key == "" || keys < keysPerBatch) {
			if events[n].Key != "" {
				keys++
			}
			n++
		}
		var list []map[string]any
		for _, e := range events[:n] {
			switch {
			case e.Key != "":
				list = append(list, map[string]any{"type": "key", "data": map[string]any{
					"down": e.Down, "key": map[string]any{"type": "qcode", "data": e.Key}}})
			case e.Button != "":
				list = append(list, map[string]any{"type": "btn", "data": map[string]any{"down": e.Down, "button": e.Button}})
			case e.Abs:
				list = append(list,
					map[string]any{"type": "abs", "data": map[string]any{"axis": "x", "value": e.X}},
					map[string]any{"type": "abs", "data": map[string]any{"axis": "y", "value": e.Y}})
			}
		}
		if err := q.Execute(ctx, "input-send-event", map[string]any{"events": list}, nil); err != nil {
			return err
		}
		events = events[n:]
		if keys > 0 && len(events) > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(15 * time.Millisecond):
			}
		}
	}
	return nil
}

// keyNames maps key names (lower case; xdotool's and common aliases) to
// QEMU key codes.
var keyNames = map[string]string{
	"ctrl": "ctrl", "control": "ctrl", "ctrl_l": "ctrl", "control_l": "ctrl", "ctrl_r": "ctrl_r", "control_r": "ctrl_r",
	"alt": "alt", "alt_l": "alt", "alt_r": "alt_r", "altgr": "alt_r",
	"shift": "shift", "shift_l": "shift", "shift_r": "shift_r",
	"super": "meta_l", "super_l": "meta_l", "super_r": "meta_r", "meta": "meta_l", "win": "meta_l", "cmd": "meta_l",
	"return": "ret", "enter": "ret", "kp_enter": "kp_enter",
	"escape": "esc", "esc": "esc", "tab": "tab", "space": "spc", "backspace": "backspace",
	"delete": "delete", "del": "delete", "insert": "insert", "home": "home", "end": "end",
	"pageup": "pgup", "page_up": "pgup", "prior": "pgup", "pagedown": "pgdn", "page_down": "pgdn", "next": "pgdn",
	"up": "up", "down": "down", "left": "left", "right": "right",
	"caps_lock": "caps_lock", "capslock": "caps_lock", "num_lock": "num_lock", "scroll_lock": "scroll_lock",
	"print": "print", "sysrq": "sysrq", "pause": "pause", "menu": "menu",
	"minus": "minus", "equal": "equal", "comma": "comma", "period": "dot", "dot": "dot", "slash": "slash",
	"backslash": "backslash", "semicolon": "semicolon", "apostrophe": "apostrophe", "grave": "grave_accent",
	"bracketleft": "bracket_left", "bracketright": "bracket_right",
}

func init() {
	for i := 1; i <= 12; i++ {
		keyNames[fmt.Sprintf("f%d", i)] = fmt.Sprintf("f%d", i)
	}
}

// charKeys maps each printable ASCII character of a US keyboard to its
// key code and whether shift is held.
var charKeys = func() map[rune]struct {
	code  string
	shift bool
} {
	m := map[rune]struct {
		code  string
		shift bool
	}{}
	set := func(plain, shifted rune, code string) {
		m[plain] = struct {
			code  string
			shift bool
		}{code, false}
		if shifted != 0 {
			m[shifted] = struct {
				code  string
				shift bool
			}{code, true}
		}
	}
	for c := 'a'; c <= 'z'; c++ {
		set(c, c-'a'+'A', string(c))
	}
	for i, s := range ")!@#$%^&*(" {
		set(rune('0'+i), s, string(rune('0'+i)))
	}
	for _, k := range []struct {
		plain, shifted rune
		code           string
	}{
		{'-', '_', "minus"}, {'=', '+', "equal"}, {'[', '{', "bracket_left"}, {']', '}', "bracket_right"},
		{'\\', '|', "backslash"}, {';', ':', "semicolon"}, {'\'', '"', "apostrophe"}, {'`', '~', "grave_accent"},
		{',', '<', "comma"}, {'.', '>', "dot"}, {'/', '?', "slash"},
		{' ', 0, "spc"}, {'\n', 0, "ret"}, {'\t', 0, "tab"},
	} {
		set(k.plain, k.shifted, k.code)
	}
	return m
}()

// TextEvents are the key presses that type text on a US keyboard. Only
// printable ASCII, newline and tab can be typed.
func TextEvents(text string) ([]InputEvent, error) {
	var out []InputEvent
	for _, r := range text {
		k, ok := charKeys[r]
		if !ok {
			return nil, fmt.Errorf("cannot type %q: only printable ASCII, newline and tab", r)
		}
		if k.shift {
			out = append(out, InputEvent{Key: "shift", Down: true})
		}
		out = append(out, InputEvent{Key: k.code, Down: true}, InputEvent{Key: k.code})
		if k.shift {
			out = append(out, InputEvent{Key: "shift"})
		}
	}
	return out, nil
}

// KeyEvents are the events of a key combination such as "ctrl+alt+Delete"
// or "Return": each key pressed in order, then released in reverse. A
// key is a name (case-insensitive: ctrl, alt, shift, super, Return, Escape,
// Tab, space, BackSpace, Delete, Home, End, Page_Up, Up, F1..F12, ...) or a
// single character ("c", "/", "7").
func KeyEvents(combo string) ([]InputEvent, error) {
	parts := strings.Split(combo, "+")
	if combo == "+" {
		parts = []string{"+"}
	} else if strings.HasSuffix(combo, "++") {
		parts = append(strings.Split(strings.TrimSuffix(combo, "++"), "+"), "+")
	}
	var codes []string
	for _, p := range parts {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, fmt.Errorf("key combination %q has an empty key", combo)
		}
		if code, ok := keyNames[strings.ToLower(p)]; ok {
			codes = append(codes, code)
			continue
		}
		if r := []rune(p); len(r) == 1 {
			if k, ok := charKeys[r[0]]; ok {
				if k.shift {
					codes = append(codes, "shift")
				}
				codes = append(codes, k.code)
				continue
			}
		}
		return nil, fmt.Errorf("unknown key %q in %q", p, combo)
	}
	var out []InputEvent
	for _, c := range codes {
		out = append(out, InputEvent{Key: c, Down: true})
	}
	for i := len(codes) - 1; i >= 0; i-- {
		out = append(out, InputEvent{Key: codes[i]})
	}
	return out, nil
}
