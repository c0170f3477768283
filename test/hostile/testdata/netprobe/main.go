// Command netprobe reaches out from inside a sandbox the way a program
// there would, for the egress tests: names resolved by Go's own resolver
// through /etc/hosts and /etc/resolv.conf, TLS with the URL's host as SNI
// (certificates not verified: reachability is what the tests check).
// busybox's wget cannot resolve names (a static glibc without NSS modules)
// and its nc has no UDP, so the tests copy this into sandboxes instead.
//
//	netprobe get [-connect ADDR:PORT] URL   GET URL (at ADDR:PORT instead of
//	                                       the URL's host, which stays the
//	                                       Host header and SNI)
//	netprobe udp ADDR:PORT PAYLOAD         send a datagram, wait 1 s for its echo
//	netprobe dns [-tcp] [-type A|TXT] [-server ADDR] NAME
//	                                       one query (to the first resolver of
//	                                       /etc/resolv.conf by default)
//	netprobe hold ADDR:PORT DELAY PATH     connect, wait DELAY, then GET PATH
//	                                       on the connection
//	netprobe scan -prefix P -sha256 H[,H] -len N PATH...
//	                                       look for a secret by its prefix,
//	                                       SHA-256 and length (the secret
//	                                       itself never enters the sandbox)
//	                                       in the files under each PATH and
//	                                       every process's environ and cmdline
//	netprobe -for DURATION get|udp|dns ... repeat, every 20 ms, silently (a
//	                                       background attack in one process)
//
// Each prints what it got and exits 0 on success (a 2xx answer, an echo,
// an answer with addresses, nothing found), 1 on any other answer (or a
// find) and 2 when there was none.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

var out io.Writer = os.Stdout

func main() {
	args := os.Args[1:]
	if len(args) >= 2 && args[0] == "-for" {
		d, err := time.ParseDuration(args[1])
		if err != nil {
			usage()
		}
		out = io.Discard
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			run(args[2:])
		}
		return
	}
	os.Exit(run(args))
}

func run(args []string) int {
	if len(args) < 1 {
		usage()
	}
	switch rest := args[1:]; args[0] {
	case "get":
		return get(rest)
	case "udp":
		return udp(rest)
	case "dns":
		return dns(rest)
	case "hold":
		return hold(rest)
	case "scan":
		return scan(rest)
	}
	usage()
	return 2
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: netprobe [-for DURATION] get|udp|dns|hold|scan ...")
	os.Exit(2)
}

func none(err error) int {
	fmt.Fprintln(out, "error:", err)
	return 2
}

func get(args []string) int {
	fs := flag.NewFlagSet("get", flag.ExitOnError)
	connect := fs.String("connect", "", "dial this address instead of the URL's host")
	dial := fs.Duration("dial", 3*time.Second, "how long a connection may take to set up")
	fs.Parse(args)
	if fs.NArg() != 1 {
		usage()
	}
	d := &net.Dialer{Timeout: *dial}
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
		Proxy:           nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if *connect != "" {
				addr = *connect
			}
			return d.DialContext(ctx, "tcp4", addr)
		},
	}
	c := &http.Client{
		Timeout:       5 * time.Second,
		Transport:     tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	resp, err := c.Get(fs.Arg(0))
	if err != nil {
		return none(err)
	}
	defer resp.Body.Close()
	fmt.Fprintln(out, resp.Proto, resp.Status)
	io.Copy(out, resp.Body)
	if resp.StatusCode/100 != 2 {
		return 1
	}
	return 0
}

func udp(args []string) int {
	if len(args) != 2 {
		usage()
	}
	c, err := net.Dial("udp4", args[0])
	if err != nil {
		return none(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(args[1])); err != nil {
		return none(err)
	}
	c.SetReadDeadline(time.Now().Add(time.Second))
	b := make([]byte, 65535)
	n, err := c.Read(b)
	if err != nil {
		return none(err)
	}
	fmt.Fprintf(out, "echo: %s\n", b[:n])
	return 0
}

func dns(args []string) int {
	fs := flag.NewFlagSet("dns", flag.ExitOnError)
	tcp := fs.Bool("tcp", false, "query over TCP")
	typ := fs.String("type", "A", "A or TXT")
	server := fs.String("server", "", "resolver address (default: /etc/resolv.conf's first)")
	fs.Parse(args)
	if fs.NArg() != 1 {
		usage()
	}
	if *server == "" {
		r, err := firstResolver()
		if err != nil {
			return none(err)
		}
		*server = r
	}
	name, err := dnsmessage.NewName(strings.TrimSuffix(fs.Arg(0), ".") + ".")
	if err != nil {
		return none(err)
	}
	t := dnsmessage.TypeA
	if strings.EqualFold(*typ, "TXT") {
		t = dnsmessage.TypeTXT
	}
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: 4711, RecursionDesired: true})
	b.StartQuestions()
	b.Question(dnsmessage.Question{Name: name, Type: t, Class: dnsmessage.ClassINET})
	q, err := b.Finish()
	if err != nil {
		return none(err)
	}
	addr := net.JoinHostPort(*server, "53")
	var answer []byte
	if *tcp {
		c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
		if err != nil {
			return none(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(q))), q...)); err != nil {
			return none(err)
		}
		var l [2]byte
		if _, err := io.ReadFull(c, l[:]); err != nil {
			return none(err)
		}
		answer = make([]byte, binary.BigEndian.Uint16(l[:]))
		if _, err := io.ReadFull(c, answer); err != nil {
			return none(err)
		}
	} else {
		c, err := net.Dial("udp4", addr)
		if err != nil {
			return none(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write(q); err != nil {
			return none(err)
		}
		buf := make([]byte, 65535)
		n, err := c.Read(buf)
		if err != nil {
			return none(err)
		}
		answer = buf[:n]
	}
	var p dnsmessage.Parser
	h, err := p.Start(answer)
	if err != nil {
		return none(err)
	}
	p.SkipAllQuestions()
	fmt.Fprintln(out, "rcode:", h.RCode)
	found := false
	for {
		r, err := p.Answer()
		if err != nil {
			break
		}
		switch body := r.Body.(type) {
		case *dnsmessage.AResource:
			fmt.Fprintf(out, "address: %d.%d.%d.%d\n", body.A[0], body.A[1], body.A[2], body.A[3])
			found = true
		case *dnsmessage.TXTResource:
			fmt.Fprintf(out, "txt: %q\n", body.TXT)
			found = true
		}
	}
	if !found {
		return 1
	}
	return 0
}

func firstResolver() (string, error) {
	f, err := os.Open("/etc/resolv.conf")
	if err != nil {
		return "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) == 2 && f[0] == "nameserver" {
			return f[1], nil
		}
	}
	return "", errors.New("no nameserver in /etc/resolv.conf")
}

func hold(args []string) int {
	if len(args) != 3 {
		usage()
	}
	delay, err := time.ParseDuration(args[1])
	if err != nil {
		usage()
	}
	c, err := net.DialTimeout("tcp4", args[0], 3*time.Second)
	if err != nil {
		return none(err)
	}
	defer c.Close()
	fmt.Fprintln(out, "connected")
	time.Sleep(delay)
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", args[2]); err != nil {
		return none(err)
	}
	b, err := io.ReadAll(c)
	fmt.Fprintf(out, "%s", b)
	if len(b) == 0 {
		return none(fmt.Errorf("no answer: %v", err))
	}
	return 0
}

func scan(args []string) int {
	fs := flag.NewFlagSet("scan", flag.ExitOnError)
	prefix := fs.String("prefix", "", "what every secret starts with")
	sums := fs.String("sha256", "", "the secrets' SHA-256, hex, comma-separated")
	length := fs.Int("len", 0, "the secrets' length")
	fs.Parse(args)
	if *prefix == "" || *sums == "" || *length < len(*prefix) {
		usage()
	}
	want := map[[32]byte]bool{}
	for _, h := range strings.Split(*sums, ",") {
		b, err := hex.DecodeString(h)
		if err != nil || len(b) != 32 {
			usage()
		}
		want[[32]byte(b)] = true
	}
	p := []byte(*prefix)
	holds := func(b []byte) bool {
		for i := 0; ; i++ {
			j := bytes.Index(b[i:], p)
			if j < 0 {
				return false
			}
			i += j
			if i+*length <= len(b) && want[sha256.Sum256(b[i:i+*length])] {
				return true
			}
		}
	}
	found, files := 0, 0
	check := func(path string) {
		b, err := os.ReadFile(path)
		if err != nil {
			return
		}
		files++
		if holds(b) {
			fmt.Fprintln(out, "found:", path)
			found++
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		check(p + "/environ")
		check(p + "/cmdline")
	}
	for _, root := range fs.Args() {
		filepath.WalkDir(root, func(path string, d iofs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if d.IsDir() && (path == "/proc" || path == "/sys" || path == "/dev") {
				return filepath.SkipDir
			}
			if d.Type().IsRegular() {
				check(path)
			}
			return nil
		})
	}
	fmt.Fprintf(out, "scanned %d files, found %d\n", files, found)
	if found > 0 {
		return 1
	}
	return 0
}
