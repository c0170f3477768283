package dsectest

import (
	"fmt"
	"os"
	"sync"
)

// ProgramTB runs the harness from a program (a benchmark): failures print
// and exit, cleanups run at Close.
type ProgramTB struct {
	mu       sync.Mutex
	cleanups []func()
	dirs     []string
}

// Program returns a TB for programs. Call Close before exiting.
func Program() *ProgramTB { return &ProgramTB{} }

func (b *ProgramTB) Helper()                      {}
func (b *ProgramTB) Fatal(args ...any)            { b.fail(fmt.Sprint(args...)) }
func (b *ProgramTB) Fatalf(f string, args ...any) { b.fail(fmt.Sprintf(f, args...)) }
func (b *ProgramTB) Skip(args ...any)             { b.fail(fmt.Sprint(args...)) }
func (b *ProgramTB) Skipf(f string, args ...any)  { b.fail(fmt.Sprintf(f, args...)) }
func (b *ProgramTB) Logf(f string, args ...any)   { fmt.Fprintf(os.Stderr, f+"\n", args...) }
func (b *ProgramTB) Failed() bool                 { return false }
func (b *ProgramTB) Cleanup(f func())             { b.mu.Lock(); b.cleanups = append(b.cleanups, f); b.mu.Unlock() }

func (b *ProgramTB) fail(msg string) {
	b.Close()
	fmt.Fprintln(os.Stderr, "bench:", msg)
	os.Exit(1)
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
}
