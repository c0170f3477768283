package qemu

import (
	"bytes"
	"fmt"
	"image/color"
	"reflect"
	"testing"
)

func TestKeyEvents(t *testing.T) {
	cases := []struct {
		combo string
		want  []string // "+code" down, "-code" up
		err   bool
	}{
		{combo: "Return", want: []string{"+ret", "-ret"}},
		{combo: "ctrl+c", want: []string{"+ctrl", "+c", "-c", "-ctrl"}},
		{combo: "ctrl+alt+Delete", want: []string{"+ctrl", "+alt", "+delete", "-delete", "-alt", "-ctrl"}},
		{combo: "shift+Tab", want: []string{"+shift", "+tab", "-tab", "-shift"}},
		{combo: "alt+F4", want: []string{"+alt", "+f4", "-f4", "-alt"}},
		{combo: "ctrl++", want: []string{"+ctrl", "+shift", "+equal", "-equal", "-shift", "-ctrl"}},
		{combo: "/", want: []string{"+slash", "-slash"}},
		{combo: "ctrl+nosuchkey", err: true},
		{combo: "ctrl+", err: true},
	}
	for _, c := range cases {
		t.Run(c.combo, func(t *testing.T) {
			ev, err := KeyEvents(c.combo)
			if c.err {
				if err == nil {
					t.Fatalf("got %v, want an error", ev)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := describe(ev); !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
}

func TestTextEvents(t *testing.T) {
	ev, err := TextEvents("aB!\n")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"+a", "-a", "+shift", "+b", "-b", "-shift", "+shift", "+1", "-1", "-shift", "+ret", "-ret"}
	if got := describe(ev); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for r := rune(0x20); r < 0x7f; r++ {
		if _, err := TextEvents(string(r)); err != nil {
			t.Errorf("printable ASCII %q cannot be typed: %v", r, err)
		}
	}
	if _, err := TextEvents("é"); err == nil {
		t.Fatal("typed a character no US keyboard has")
	}
}

func describe(ev []InputEvent) []string {
	var out []string
	for _, e := range ev {
		sign := "-"
		if e.Down {
			sign = "+"
		}
		out = append(out, sign+e.Key)
	}
	return out
}

func TestDecodePPM(t *testing.T) {
	var b bytes.Buffer
	fmt.Fprintf(&b, "P6\n2 1\n255\n")
	b.Write([]byte{255, 0, 0, 0, 0, 255})
	img, err := decodePPM(&b)
	if err != nil {
		t.Fatal(err)
	}
	if img.Bounds().Dx() != 2 || img.Bounds().Dy() != 1 {
		t.Fatalf("bounds %v", img.Bounds())
	}
	if got := color.RGBAModel.Convert(img.At(1, 0)).(color.RGBA); got != (color.RGBA{0, 0, 255, 255}) {
		t.Fatalf("pixel %v", got)
	}
	if _, err := decodePPM(bytes.NewReader([]byte("P3\n1 1\n255\n0 0 0"))); err == nil {
		t.Fatal("decoded a text PPM")
	}
}
