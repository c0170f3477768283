// Command dsec-guest is the agent inside every dsec sandbox. The node starts
// it as the sandbox's init with a listening socket; see internal/guest/agent.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/opendsec/dsec/internal/guest/agent"
)

func main() {
	listenFD := flag.Int("listen-fd", -1, "serve on this inherited listening socket")
	listen := flag.String("listen", "", "serve on this unix socket path (for tests and debugging)")
	version := flag.Bool("version", false, "print the protocol version and exit")
	deadline := flag.Int64("deadline", 0, "unix time (seconds) at which to end the sandbox if the node has not")
	flag.Parse()
	if *version {
		fmt.Println(agent.Version)
		return
	}
	// The agent is small and mostly idle; keep its heap small in every one
	// of thousands of sandboxes.
	debug.SetGCPercent(50)
	if os.Getenv("GOMAXPROCS") == "" {
		// Calls are I/O-bound; one P keeps per-sandbox memory and threads down.
		runtime.GOMAXPROCS(1)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	var l net.Listener
	var err error
	switch {
	case *listenFD >= 0:
		l, err = agent.ListenFD(*listenFD)
	case *listen != "":
		os.Remove(*listen)
		l, err = net.Listen("unix", *listen)
	default:
		err = fmt.Errorf("one of -listen-fd and -listen is required")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest:", err)
		os.Exit(2)
	}
	agent.Harden()
	a := agent.New(log)
	if *deadline > 0 {
		a.SetDeadline(time.Unix(*deadline, 0))
	}
	if err := a.Serve(l); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest:", err)
		os.Exit(1)
	}
}
