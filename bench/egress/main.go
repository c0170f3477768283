// Command egress times what an egress policy adds to a sandbox's
// connection set-up, side by side (not a test: numbers, never pass/fail).
// One sandbox network without a policy and one under a policy, made by
// internal/network.Manager as the node makes them, reach a web server in
// an "internet" namespace (dsectest.Internet); each connection is timed
// from the sandbox's connect() to the first byte of the answer to its
// first request (what a client waits for before it can use a
// connection), then closed:
//
//   - HTTP to port 80: without a policy the kernel NATs it; under a
//     policy the node's egress proxy takes it (redirected), reads the Host
//     header, decides (by the name's pinned addresses, or by an address
//     rule), dials the destination and splices;
//   - TLS to port 443 (the handshake done): the proxy reads the SNI;
//   - TCP to port 8080: under a policy only the kernel's sets decide (no
//     proxy).
//
// and then the throughput of a 64 MiB download on port 80 (median of the
// runs), which the proxy copies in user space.
//
// The policy has 64 rules besides the ones that allow the server, so the
// check is not trivially short. Runs alternate between the two sandboxes
// so load on the host affects both alike. Needs root and nft. Run it as
//
//	go run ./bench/egress [-n 500] [-runs 5]
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/nsthread"
)

func main() {
	n := flag.Int("n", 500, "connections per case and run")
	runs := flag.Int("runs", 5, "runs; medians of the runs are reported")
	flag.Parse()
	if os.Geteuid() != 0 {
		fatal(fmt.Errorf("needs root"))
	}
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	tb := dsectest.Program()
	defer tb.Close()
	in := dsectest.StartInternet(tb, 1)
	const host = "www.bench.test"
	in.Set(host, in.Web[0])
	runDir, err := os.MkdirTemp("", "dsec-bench-egress-")
	if err != nil {
		fatal(err)
	}
	defer os.RemoveAll(runDir)
	pid := os.Getpid() % 10000
	table, bridge := fmt.Sprintf("dsbe_%d", pid), fmt.Sprintf("dsbe%d", pid)
	m, err := network.New(network.Config{
		Bridge: bridge, Subnet: fmt.Sprintf("10.%d.0.0/24", 200+pid%50), Table: table,
		RunDir: filepath.Join(runDir, "netns"), DNS: []string{in.DNS.String()},
	}, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		fatal(err)
	}
	defer func() {
		m.Close()
		exec.Command("ip", "link", "del", bridge).Run()
		exec.Command("nft", "delete", "table", "inet", table).Run()
		exec.Command("nft", "delete", "table", "bridge", table).Run()
	}()
	if why := m.EgressUnavailable(); why != "" {
		fatal(fmt.Errorf("egress unavailable: %s", why))
	}

	open, err := m.Setup(context.Background(), fmt.Sprintf("be%d-open", pid), network.Options{Mode: network.ModeEgress})
	if err != nil {
		fatal(err)
	}
	defer m.Release(open)
	var rules []string
	for i := 0; i < 32; i++ {
		rules = append(rules, fmt.Sprintf("allow 203.0.%d.0/24", i), fmt.Sprintf("deny *.blocked%d.test", i))
	}
	rules = append(rules, "allow "+host, "allow "+netip.PrefixFrom(in.Web[0], 32).String())
	pol := &network.Policy{}
	for _, r := range rules {
		action, dest, _ := strings.Cut(r, " ")
		rule, err := network.ParseRule(action, dest)
		if err != nil {
			fatal(err)
		}
		pol.Rules = append(pol.Rules, rule)
	}
	policed, err := m.Setup(context.Background(), fmt.Sprintf("be%d-pol", pid), network.Options{Mode: network.ModeEgress, Policy: pol})
	if err != nil {
		fatal(err)
	}
	defer m.Release(policed)

	web := in.Web[0].String()
	cases := []struct {
		name string
		conn func() (time.Duration, error)
	}{
		{"HTTP :80, Host header", func() (time.Duration, error) { return httpFirstByte(web+":80", host) }},
		{"TLS :443, SNI (handshake)", func() (time.Duration, error) { return tlsHandshake(web+":443", host) }},
		{"TCP :8080 (kernel sets only)", func() (time.Duration, error) { return httpFirstByte(web+":8080", host) }},
	}
	sandboxes := []struct {
		name string
		a    *network.Attachment
	}{{"no policy", open}, {"policy", policed}}
	// The policed sandbox resolves the name once (as a client would), which
	// pins its address.
	nsthread.NetNS(policed.NetNS, func() error {
		_, err := net.DefaultResolver.LookupHost(context.Background(), host)
		return err
	})
	p50s := make([][][]time.Duration, len(cases)) // case, sandbox, run
	for c := range cases {
		p50s[c] = make([][]time.Duration, len(sandboxes))
	}
	for r := 0; r < *runs; r++ {
		for c, cs := range cases {
			for s, sb := range sandboxes {
				var ds []time.Duration
				err := nsthread.NetNS(sb.a.NetNS, func() error {
					for i := 0; i < 20; i++ { // warm up
						if _, err := cs.conn(); err != nil {
							return err
						}
					}
					for i := 0; i < *n; i++ {
						d, err := cs.conn()
						if err != nil {
							return err
						}
						ds = append(ds, d)
					}
					return nil
				})
				if err != nil {
					fatal(fmt.Errorf("%s, %s: %w", cs.name, sb.name, err))
				}
				p50s[c][s] = append(p50s[c][s], pct(ds, 50))
			}
		}
	}
	fmt.Printf("dsec egress policy benchmark — %d CPUs, load %s, %s\n", runtime.NumCPU(), loadavg(), time.Now().Format(time.RFC3339))
	fmt.Printf("%d connections per case, sandbox and run, %d runs; p50 per run, median of runs; policy of %d rules\n\n", *n, *runs, len(rules))
	fmt.Printf("%-30s %12s %12s %12s\n", "connection set-up", "no policy", "policy", "added")
	for c, cs := range cases {
		a, b := median(p50s[c][0]), median(p50s[c][1])
		fmt.Printf("%-30s %12s %12s %12s\n", cs.name, round(a), round(b), round(b-a))
	}
	// Throughput: the proxy copies every byte of a port 80 or 443
	// connection in user space.
	const size = 64 << 20
	rate := make([][]float64, len(sandboxes))
	for r := 0; r < *runs; r++ {
		for s, sb := range sandboxes {
			err := nsthread.NetNS(sb.a.NetNS, func() error {
				t0 := time.Now()
				c, err := net.DialTimeout("tcp4", web+":80", 3*time.Second)
				if err != nil {
					return err
				}
				defer c.Close()
				fmt.Fprintf(c, "GET /bytes?n=%d HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", size, host)
				got, err := io.Copy(io.Discard, c)
				if err != nil || got < size {
					return fmt.Errorf("download: %d bytes, %v", got, err)
				}
				rate[s] = append(rate[s], float64(got)/time.Since(t0).Seconds()/(1<<20))
				return nil
			})
			if err != nil {
				fatal(fmt.Errorf("throughput, %s: %w", sb.name, err))
			}
		}
	}
	sort.Float64s(rate[0])
	sort.Float64s(rate[1])
	fmt.Printf("\n%-30s %9.0f MiB/s %6.0f MiB/s\n", "HTTP :80, 64 MiB download", rate[0][len(rate[0])/2], rate[1][len(rate[1])/2])
}

// httpFirstByte connects to addr, sends a GET for host and waits for the
// answer's first byte.
func httpFirstByte(addr, host string) (time.Duration, error) {
	t0 := time.Now()
	c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host); err != nil {
		return 0, err
	}
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return 0, err
	}
	d := time.Since(t0)
	if b[0] != 'H' {
		return 0, fmt.Errorf("answer starts with %q", b[:])
	}
	return d, nil
}

// tlsHandshake connects to addr and completes a TLS handshake with SNI
// host (the certificate is not verified: only time counts).
func tlsHandshake(addr, host string) (time.Duration, error) {
	t0 := time.Now()
	d := net.Dialer{Timeout: 3 * time.Second}
	c, err := tls.DialWithDialer(&d, "tcp4", addr, &tls.Config{ServerName: host, InsecureSkipVerify: true})
	if err != nil {
		return 0, err
	}
	dur := time.Since(t0)
	c.Close()
	return dur, nil
}

func pct(ds []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)*p/100]
}

func median(ds []time.Duration) time.Duration { return pct(ds, 50) }

func round(d time.Duration) string {
	if d < 0 {
		return "-" + round(-d)
	}
	return d.Round(time.Microsecond).String()
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench/egress:", err)
	dsectest.Exit(1) // the internet's namespace goes too
}
