package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

var marshal = protojson.MarshalOptions{Multiline: true, Indent: "  ", UseProtoNames: true, EmitUnpopulated: false}

// printJSON prints messages as JSON: one object, or an array.
func printJSON(w io.Writer, msgs ...proto.Message) {
	if len(msgs) == 1 {
		b, _ := marshal.Marshal(msgs[0])
		fmt.Fprintln(w, string(b))
		return
	}
	fmt.Fprintln(w, "[")
	for i, m := range msgs {
		b, _ := marshal.Marshal(m)
		sep := ","
		if i == len(msgs)-1 {
			sep = ""
		}
		fmt.Fprintln(w, string(b)+sep)
	}
	fmt.Fprintln(w, "]")
}

func table(header ...string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	return tw
}

// parseMemory accepts "512", "512M", "512Mi", "2G", "2Gi" and returns MiB.
func parseMemory(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	t := strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(strings.TrimSpace(s)), "B"), "I")
	mult := int64(1)
	switch {
	case strings.HasSuffix(t, "G"):
		mult, t = 1024, strings.TrimSuffix(t, "G")
	case strings.HasSuffix(t, "M"):
		t = strings.TrimSuffix(t, "M")
	case strings.HasSuffix(t, "K"):
		n, err := strconv.ParseInt(strings.TrimSuffix(t, "K"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("bad memory size %q", s)
		}
		return (n + 1023) / 1024, nil
	}
	n, err := strconv.ParseFloat(t, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad memory size %q (use e.g. 512M or 2G)", s)
	}
	return int64(n * float64(mult)), nil
}

// parseKV parses repeated k=v flags.
func parseKV(list []string, what string) (map[string]string, error) {
	if len(list) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, kv := range list {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%s %q: want key=value", what, kv)
		}
		m[k] = v
	}
	return m, nil
}

func ago(t time.Time) string {
	if t.IsZero() || t.Unix() <= 0 {
		return "-"
	}
	d := time.Since(t)
	if d < 0 {
		return "in " + (-d).Round(time.Second).String()
	}
	return d.Round(time.Second).String() + " ago"
}

func until(t time.Time) string {
	if t.IsZero() || t.Unix() <= 0 {
		return "-"
	}
	d := time.Until(t)
	if d < 0 {
		return "expired"
	}
	return d.Round(time.Second).String()
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1fG", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fM", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fK", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%dB", n)
}

// progressBar draws a one-line progress bar on stderr when it is a terminal.
type progressBar struct {
	label string
	last  time.Time
	tty   bool
}

func newProgress(label string) *progressBar {
	fi, _ := os.Stderr.Stat()
	return &progressBar{label: label, tty: fi != nil && fi.Mode()&os.ModeCharDevice != 0}
}

func (p *progressBar) update(phase, msg string, done, total int64) {
	if !p.tty {
		if time.Since(p.last) > 2*time.Second || phase == "done" {
			p.last = time.Now()
			if total > 0 {
				fmt.Fprintf(os.Stderr, "%s: %s %s %s/%s\n", p.label, phase, msg, humanBytes(done), humanBytes(total))
			} else {
				fmt.Fprintf(os.Stderr, "%s: %s %s\n", p.label, phase, msg)
			}
		}
		return
	}
	if time.Since(p.last) < 100*time.Millisecond && phase != "done" {
		return
	}
	p.last = time.Now()
	line := fmt.Sprintf("%s: %-8s %s", p.label, phase, msg)
	if total > 0 {
		const width = 30
		frac := min(float64(done)/float64(total), 1)
		bar := strings.Repeat("█", int(frac*width)) + strings.Repeat("░", width-int(frac*width))
		line = fmt.Sprintf("%s: %-8s [%s] %3.0f%% %s/%s", p.label, phase, bar, frac*100, humanBytes(done), humanBytes(total))
	}
	if len(line) > 110 {
		line = line[:110]
	}
	fmt.Fprintf(os.Stderr, "\r\033[K%s", line)
	if phase == "done" {
		fmt.Fprintln(os.Stderr)
	}
}

func (p *progressBar) finish() {
	if p.tty {
		fmt.Fprintln(os.Stderr)
	}
}
