// Package mountns runs the node process in a private mount namespace.
//
// Every sandbox mount the node makes (overlay root filesystems, image
// layers) then lives in that namespace: it never appears in the host's mount
// table and disappears with its last user, so a crashed node cannot leak
// mounts. On hosts with hybrid cgroups (v1 controllers plus a cgroup2 mount
// at /sys/fs/cgroup/unified) the namespace also hides the cgroup2 mount,
// which crun refuses to work with; crun then manages the v1 controllers and
// enforces limits.
//
// A process can only enter a new mount namespace before it starts threads,
// so Enter re-executes the program inside one.
package mountns

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

const marker = "DSEC_PRIVATE_MOUNTNS"

// Entered reports whether this process runs in the namespace Enter made.
func Entered() bool { return os.Getenv(marker) == "1" }

// Enter re-executes the current program in a private mount namespace and
// exits with its status; in the re-executed program it prepares the
// namespace and returns. Without root it returns an error and does nothing.
func Enter() error {
	if Entered() {
		return prepare()
	}
	if os.Geteuid() != 0 {
		return errors.New("a private mount namespace needs root")
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), marker+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// Go makes the new namespace's mounts private (MS_REC|MS_PRIVATE).
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	// The child receives terminal signals itself; forward the others.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("re-execute in a private mount namespace: %w", err)
	}
	go func() {
		for s := range sigs {
			cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			os.Exit(128 + int(ws.Signal()))
		}
		os.Exit(ee.ExitCode())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
	return nil
}

// HybridCgroups reports whether the host mounts cgroup v1 controllers and a
// cgroup2 hierarchy side by side, and whether the cgroup2 one is visible.
func HybridCgroups() (hybrid, unifiedVisible bool) {
	var st unix.Statfs_t
	if unix.Statfs("/sys/fs/cgroup", &st) != nil || st.Type == unix.CGROUP2_SUPER_MAGIC {
		return false, false
	}
	var u unix.Statfs_t
	if unix.Statfs("/sys/fs/cgroup/unified", &u) == nil && u.Type == unix.CGROUP2_SUPER_MAGIC {
		return true, true
	}
	// Hidden by prepare, or a v1-only host: tell them apart by the mountpoint.
	if _, err := os.Stat("/sys/fs/cgroup/unified"); err == nil {
		return true, false
	}
	return false, false
}

func prepare() error {
	if hybrid, visible := HybridCgroups(); hybrid && visible {
		if err := unix.Unmount("/sys/fs/cgroup/unified", unix.MNT_DETACH); err != nil {
			return fmt.Errorf("hide the cgroup2 mount: %w", err)
		}
	}
	return nil
}
