// Command testreport reads `go test -json` on stdin and prints what a
// person needs: each package's result, the output of every failed test,
// and every skipped test with its reason. It exits non-zero when a test
// failed, when a package failed to build, or when a test skipped for any
// reason but missing hardware this host cannot have (a KVM that boots,
// vhost-vsock, a GPU): CI installs everything else, so any other skip means
// a must-run test did not run.
//
//	go test -json ./... | go run ./scripts/testreport
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// hardware matches the skip reasons CI accepts: hardware the host lacks.
var hardware = regexp.MustCompile(`(?i)\b(kvm|vhost-vsock|gpu|nvidia)\b`)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

type key struct{ pkg, test string }

func main() {
	os.Exit(report(os.Stdin, os.Stdout))
}

func report(in io.Reader, out io.Writer) int {
	output := map[key]*strings.Builder{}
	var skips []string
	var failed, badSkips int
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil || e.Action == "" {
			// Not an event (a build error printed as text): show it.
			fmt.Fprintln(out, string(line))
			continue
		}
		k := key{e.Package, e.Test}
		switch e.Action {
		case "output":
			b := output[k]
			if b == nil {
				b = new(strings.Builder)
				output[k] = b
			}
			if b.Len() < 1<<20 {
				b.WriteString(e.Output)
			}
		case "fail":
			if e.Test != "" {
				if b := output[k]; b != nil {
					fmt.Fprint(out, b.String())
				}
				// Subtests' own output belongs to their parent's failure.
				if !strings.Contains(e.Test, "/") {
					failed++
				}
				continue
			}
			failed++
			fmt.Fprintf(out, "FAIL\t%s\t%.3fs\n", e.Package, e.Elapsed)
			if b := output[k]; b != nil {
				// Package-level output: a panic, a build failure, a timeout.
				fmt.Fprint(out, tail(b.String(), 200))
			}
		case "pass":
			if e.Test == "" {
				fmt.Fprintf(out, "ok  \t%s\t%.3fs\n", e.Package, e.Elapsed)
			}
		case "skip":
			if e.Test == "" {
				continue // a package without tests
			}
			reason := skipReason(output[k])
			skips = append(skips, fmt.Sprintf("%s %s: %s", e.Package, e.Test, reason))
			if !hardware.MatchString(reason) {
				badSkips++
				skips[len(skips)-1] = "NOT ALLOWED " + skips[len(skips)-1]
			}
		}
		if e.Action == "pass" || e.Action == "fail" || e.Action == "skip" {
			delete(output, k)
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintln(out, "testreport:", err)
		return 2
	}
	if len(skips) > 0 {
		sort.Strings(skips)
		fmt.Fprintf(out, "\nskipped tests (%d; only missing hardware may skip):\n", len(skips))
		for _, s := range skips {
			fmt.Fprintln(out, "  "+s)
		}
	}
	switch {
	case failed > 0:
		fmt.Fprintf(out, "\n%d failed\n", failed)
		return 1
	case badSkips > 0:
		fmt.Fprintf(out, "\n%d tests skipped that CI must run (install what they name: scripts/setup.sh)\n", badSkips)
		return 1
	}
	return 0
}

// skipReason is the message a test skipped with: its output, less the
// framework's own lines.
func skipReason(b *strings.Builder) string {
	if b == nil {
		return "(no reason given)"
	}
	var lines []string
	for _, l := range strings.Split(b.String(), "\n") {
		t := strings.TrimSpace(l)
		if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- SKIP") {
			continue
		}
		lines = append(lines, t)
	}
	if len(lines) == 0 {
		return "(no reason given)"
	}
	return strings.Join(lines, " ")
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.SplitAfter(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "")
}
