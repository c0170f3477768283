package dsectest

import (
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// ProgramTB runs the harness from a program (a benchmark): failures print
// and exit, cleanups run at Close. A program leaves nothing behind on any
// exit path: its failures (Fatal, Exit), an interrupt or termination
// signal, and a normal end (Close) all run the cleanups.
type ProgramTB struct {
	mu       sync.Mutex
	cleanups []func()
	dirs     []string
	failed   bool
}

var (
	programsMu sync.Mutex
	programs   []*ProgramTB
	signalOnce sync.Once
)

// Program returns a TB for programs. Call Close before exiting normally;
// leave in any other way through Exit (or b.Fatal). An interrupt (Ctrl-C)
// or SIGTERM closes every program and exits.
func Program() *ProgramTB {
	b := &ProgramTB{}
	programsMu.Lock()
	programs = append(programs, b)
	programsMu.Unlock()
	signalOnce.Do(func() {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
		go func() {
			s := <-sigs
			fmt.Fprintf(os.Stderr, "bench: %v: cleaning up\n", s)
			Exit(130)
		}()
	})
	return b
}

// Exit closes every program (its servers, sandboxes, networks and
// directories), then exits with code: what a program calls instead of
// os.Exit.
func Exit(code int) {
	programsMu.Lock()
	ps := append([]*ProgramTB(nil), programs...)
	programsMu.Unlock()
	for i := len(ps) - 1; i >= 0; i-- {
		ps[i].Close()
	}
	os.Exit(code)
}

func (b *ProgramTB) Helper()                      {}
func (b *ProgramTB) Fatal(args ...any)            { b.fail(fmt.Sprint(args...)) }
func (b *ProgramTB) Fatalf(f string, args ...any) { b.fail(fmt.Sprintf(f, args...)) }
func (b *ProgramTB) Skip(args ...any)             { b.fail(fmt.Sprint(args...)) }
func (b *ProgramTB) Skipf(f string, args ...any)  { b.fail(fmt.Sprintf(f, args...)) }
func (b *ProgramTB) Logf(f string, args ...any)   { fmt.Fprintf(os.Stderr, f+"\n", args...) }
func (b *ProgramTB) Failed() bool                 { b.mu.Lock(); defer b.mu.Unlock(); return b.failed }
func (b *ProgramTB) Cleanup(f func())             { b.mu.Lock(); b.cleanups = append(b.cleanups, f); b.mu.Unlock() }

func (b *ProgramTB) fail(msg string) {
	fmt.Fprintln(os.Stderr, "bench:", msg)
	Exit(1)
}

// TempDir makes a directory removed at Close.
func (b *ProgramTB) TempDir() string {
	d, err := os.MkdirTemp("", "dsec-bench-")
	if err != nil {
		b.fail(err.Error())
	}
	b.mu.Lock()
	b.dirs = append(b.dirs, d)
	b.mu.Unlock()
	return d
}

// CloseWith closes b after a test binary's run whose exit code is code: a
// failed run (code != 0) marks b failed first, so its servers print their
// logs as they close, as a failed test's own servers do.
func (b *ProgramTB) CloseWith(code int) {
	if code != 0 {
		b.mu.Lock()
		b.failed = true
		b.mu.Unlock()
	}
	b.Close()
}

// Close runs the cleanups, newest first.
func (b *ProgramTB) Close() {
	b.mu.Lock()
	fns, dirs := b.cleanups, b.dirs
	b.cleanups, b.dirs = nil, nil
	b.mu.Unlock()
	for i := len(fns) - 1; i >= 0; i-- {
		fns[i]()
	}
	for _, d := range dirs {
		os.RemoveAll(d)
	}
	programsMu.Lock()
	for i, p := range programs {
		if p == b {
			programs = append(programs[:i], programs[i+1:]...)
			break
		}
	}
	last := len(programs) == 0
	programsMu.Unlock()
	if last {
		removeBuiltBinaries() // the program is ending: nothing runs them any more
	}
}
