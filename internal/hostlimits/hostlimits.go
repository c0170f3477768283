// Package hostlimits checks the kernel limits a node packed with sandboxes
// needs, raises the ones it may, and says what it changed and what it could
// not. A host's defaults are sized for a workstation: kernel.pid_max 32768
// stops a node at ~3,000 idle sandboxes (each holds a few tasks), 128
// inotify instances are shared by every process of a uid, and the node
// holds file descriptors for every sandbox.
package hostlimits

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Sysctl is one kernel limit a dense node wants at least Want of.
type Sysctl struct {
	Name string // dotted, e.g. "kernel.pid_max"
	Want int64
	Why  string
}

// Wanted are the limits Tune raises. Each is a floor: a host set higher
// keeps its value.
var Wanted = []Sysctl{
	{"kernel.pid_max", 4194304, "every sandbox holds a few tasks (its runtime and its agent's threads)"},
	{"kernel.threads-max", 1048576, "every sandbox holds a few tasks"},
	{"fs.inotify.max_user_instances", 8192, "file watches (WatchDir) of every sandbox without a user namespace share root's instances"},
	{"fs.inotify.max_user_watches", 1048576, "file watches (WatchDir) of every sandbox without a user namespace share root's watches"},
	{"net.netfilter.nf_conntrack_max", 1048576, "every egress connection of every sandbox is tracked"},
	{"fs.file-max", 1048576, "the node and the agents hold descriptors for every sandbox"},
	{"net.core.somaxconn", 4096, "the API listener takes bursts of connections"},
}

// Change is what Tune found for one limit.
type Change struct {
	Name     string
	Was, Now int64
	Err      error // why it could not be raised (then Now == Was)
}

// Tune raises each of limits that is below its floor, under root (a
// directory with the layout of /proc/sys), and the process's open-file
// limit to its hard limit. It never lowers anything. Limits the kernel does
// not have (a module not loaded) are left out.
func Tune(root string, limits []Sysctl) []Change {
	var out []Change
	for _, l := range limits {
		p := filepath.Join(root, strings.ReplaceAll(l.Name, ".", "/"))
		b, err := os.ReadFile(p)
		if err != nil {
			continue // not on this kernel
		}
		was, err := strconv.ParseInt(strings.Fields(string(b) + " 0")[0], 10, 64)
		if err != nil || was >= l.Want {
			continue
		}
		c := Change{Name: l.Name, Was: was, Now: was}
		if err := os.WriteFile(p, []byte(strconv.FormatInt(l.Want, 10)), 0o644); err != nil {
			c.Err = err
		} else if b, err := os.ReadFile(p); err == nil {
			c.Now, _ = strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
			if c.Now < l.Want {
				c.Err = fmt.Errorf("the kernel capped it at %d", c.Now)
			}
		}
		out = append(out, c)
	}
	return out
}

// RaiseNoFile raises the process's soft open-file limit to its hard limit
// and returns the new soft limit.
func RaiseNoFile() (uint64, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, err
	}
	if rl.Cur < rl.Max {
		rl.Cur = rl.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
			return 0, err
		}
	}
	return rl.Cur, nil
}

// Apply tunes the host's limits (/proc/sys) and the process's open files,
// and logs each change and each limit it could not raise. It returns an
// error only if nothing could be read at all.
func Apply(log *slog.Logger) error {
	if _, err := os.Stat("/proc/sys/kernel"); err != nil {
		return errors.New("no /proc/sys: kernel limits cannot be checked")
	}
	why := map[string]string{}
	for _, l := range Wanted {
		why[l.Name] = l.Why
	}
	for _, c := range Tune("/proc/sys", Wanted) {
		if c.Err != nil {
			log.Warn("kernel limit too low for a dense node; raise it on the host", slog.String("sysctl", c.Name), slog.Int64("value", c.Was), slog.String("why", why[c.Name]), slog.Any("error", c.Err))
			continue
		}
		log.Info("raised a kernel limit for a dense node", slog.String("sysctl", c.Name), slog.Int64("from", c.Was), slog.Int64("to", c.Now))
	}
	if n, err := RaiseNoFile(); err != nil {
		log.Warn("cannot raise the open-file limit", slog.Any("error", err))
	} else if n < 1<<20 {
		log.Info("open-file limit (each sandbox holds a few descriptors in the node)", slog.Uint64("limit", n))
	}
	return nil
}
