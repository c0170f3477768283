package hostile

// Attacks on the host's disk from inside a container sandbox (finding 11):
// filling it with one file, or with files until no inode is left, so the
// node and every other sandbox fail. Each sandbox's writable layer is a
// file system of its own, of its disk_mb.

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	dsec "github.com/opendsec/dsec/sdk/go"
)

const fillDiskMB = 64

// dfRoot is `df -k /` inside sb: size and used KiB.
func dfRoot(t *testing.T, sb *dsec.Sandbox) (size, used int64) {
	t.Helper()
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("df -k / | tail -1"))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(r.Stdout))
	if len(f) < 3 {
		t.Fatalf("df inside: %q %q", r.Stdout, r.Stderr)
	}
	size, _ = strconv.ParseInt(f[1], 10, 64)
	used, _ = strconv.ParseInt(f[2], 10, 64)
	return size, used
}

// dataDirUse is the disk space the server's data directory takes (its
// files' allocated blocks: the sandbox images are sparse). The host's free
// space would say the same on a host of its own; this one is shared.
func dataDirUse(t *testing.T) int64 {
	var n int64
	filepath.WalkDir(srv(t).DataDir, func(p string, d fs.DirEntry, err error) error {
		var st unix.Stat_t
		if err == nil && unix.Lstat(p, &st) == nil {
			n += st.Blocks * 512
		}
		return nil
	})
	return n
}

func TestSandboxFillsOnlyItsOwnDisk(t *testing.T) { eachRuntime(t, testSandboxFillsOnlyItsOwnDisk) }

func testSandboxFillsOnlyItsOwnDisk(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt, DiskMB: fillDiskMB})
	t.Run("df inside shows the sandbox's disk", func(t *testing.T) {
		size, _ := dfRoot(t, sb)
		if size > fillDiskMB<<10 || size < fillDiskMB<<9 {
			// Checked before any unbounded write: on a host without
			// limits, `yes > /tmp/fill` would fill the host's disk.
			t.Fatalf("df / inside says %d KiB, want the sandbox's %d MiB", size, fillDiskMB)
		}
	})
	if t.Failed() {
		return
	}
	use := dataDirUse(t)
	t.Run("dd stops at the sandbox's disk, as a task failure", func(t *testing.T) {
		r, err := sb.Exec(ctxFor(t, 2*time.Minute), dsec.Cmd(fmt.Sprintf("dd if=/dev/zero of=/tmp/dd bs=1M count=%d", 2*fillDiskMB)))
		taskFailure(t, "dd", err)
		if r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "No space left") {
			t.Errorf("dd of %d MiB into a %d MiB disk: exit %d, stderr %q", 2*fillDiskMB, fillDiskMB, r.ExitCode, r.Stderr)
		}
		sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("rm /tmp/dd"))
	})
	t.Run("yes > /tmp/fill stops at the sandbox's disk", func(t *testing.T) {
		r, err := sb.Exec(ctxFor(t, 2*time.Minute), dsec.ExecOptions{Argv: []string{"/bin/sh", "-c", "yes > /tmp/fill"}, Timeout: 90 * time.Second})
		taskFailure(t, "yes", err)
		if r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "No space left") {
			t.Errorf("yes > /tmp/fill: exit %d, stderr %q", r.ExitCode, r.Stderr)
		}
	})
	t.Run("while it is full, the neighbour writes and the host keeps its space", func(t *testing.T) {
		if grew := dataDirUse(t) - use; grew > (fillDiskMB+16)<<20 {
			t.Errorf("the node's data directory grew by %d MiB for a %d MiB sandbox", grew>>20, fillDiskMB)
		}
		r, err := nb.sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("dd if=/dev/zero of=/tmp/nb bs=1M count=8 && rm /tmp/nb"))
		if err != nil || r.ExitCode != 0 {
			t.Errorf("the neighbour cannot write: %v %q", err, r.GetStderr())
		}
		nb.check(t)
	})
	t.Run("stats show the disk in use and its size", func(t *testing.T) {
		st, err := sb.Stats(ctxFor(t, time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		if st.DiskLimitMb != fillDiskMB || st.DiskBytes < fillDiskMB<<19 {
			t.Errorf("stats: disk %d bytes of %d MiB", st.DiskBytes, st.DiskLimitMb)
		}
	})
	t.Run("a file upload to the full disk is the caller's no-space error", func(t *testing.T) {
		_, err := sb.WriteFile(ctxFor(t, time.Minute), "/tmp/upload", strings.NewReader(strings.Repeat("x", 1<<20)), 0o644)
		if err == nil || kindOf(err) != "exhausted" || infraOf(err) {
			t.Errorf("upload to a full disk: %v (kind %q, infra %v), want exhausted, not infra", err, kindOf(err), infraOf(err))
		}
	})
	t.Run("removing the file gives the space back", func(t *testing.T) {
		if r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("rm /tmp/fill && echo x > /tmp/after")); err != nil || r.ExitCode != 0 {
			t.Errorf("after rm: %v %q", err, r.GetStderr())
		}
	})
}

func TestSandboxRunsOutOfItsOwnInodes(t *testing.T) { eachRuntime(t, testSandboxRunsOutOfItsOwnInodes) }

func testSandboxRunsOutOfItsOwnInodes(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt, DiskMB: fillDiskMB})
	if size, _ := dfRoot(t, sb); size > fillDiskMB<<10 {
		t.Fatalf("df / inside says %d KiB, want the sandbox's %d MiB (a touch loop would fill the host's inodes)", size, fillDiskMB)
	}
	// One process making files until the file system has no inode left
	// (bounded: 20000 is more than a 64 MiB disk has).
	r, err := sb.Exec(ctxFor(t, 3*time.Minute), dsec.ExecOptions{Argv: []string{"/bin/sh", "-c",
		"mkdir -p /tmp/many && cd /tmp/many && i=0; while [ $i -lt 20000 ]; do touch f$i f$((i+1)) f$((i+2)) f$((i+3)) || break; i=$((i+4)); done; echo made $i"},
		Timeout: 150 * time.Second})
	taskFailure(t, "touch loop", err)
	made := 0
	fmt.Sscanf(strings.TrimSpace(string(r.Stdout)), "made %d", &made)
	if made >= 20000 || !strings.Contains(string(r.Stderr), "No space left") {
		t.Errorf("touch loop: made %d files, stderr %q; want it stopped by the disk's inodes", made, lastLine(string(r.Stderr)))
	}
	t.Logf("made %d files", made)
	if r, err := nb.sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("touch /tmp/nb1 /tmp/nb2 && rm /tmp/nb1 /tmp/nb2")); err != nil || r.ExitCode != 0 {
		t.Errorf("the neighbour cannot make files: %v %q", err, r.GetStderr())
	}
	nb.check(t)
}

func TestDeletedSandboxLeavesNoDiskOrIDs(t *testing.T) {
	eachRuntime(t, testDeletedSandboxLeavesNoDiskOrIDs)
}

func testDeletedSandboxLeavesNoDiskOrIDs(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	node := nodePid(t)
	loops := func() int {
		n := 0
		m, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
		for _, f := range m {
			if b, _ := os.ReadFile(f); strings.HasPrefix(string(b), srv(t).DataDir) {
				n++
			}
		}
		return n
	}
	mounts := func() int {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", node))
		return strings.Count(string(b), "\n")
	}
	// The node records each id range in use on the host as
	// /run/dsec/ids/<index>; the sandbox's is found from its uid_map (or,
	// under gVisor, whose kernel has user namespaces of its own, from the
	// host owner of a file its root makes).
	rangeOf := func(sb *dsec.Sandbox) string {
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("cat /proc/self/uid_map"))
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(r.Stdout))
		host := 0
		if len(f) == 3 && f[2] == "65536" {
			host, _ = strconv.Atoi(f[1])
		}
		if rt == "gvisor" {
			name := fmt.Sprintf("range-%d", time.Now().UnixNano())
			if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("touch /tmp/"+name+"; sync")); err != nil {
				t.Fatal(err)
			}
			var st unix.Stat_t
			if err := unix.Stat(findUpperFile(t, filepath.Join("tmp", name)), &st); err != nil {
				t.Fatal(err)
			}
			host = int(st.Uid)
		}
		if host < 1<<30 {
			return ""
		}
		return filepath.Join("/run/dsec/ids", strconv.Itoa((host-1<<30)/65536))
	}
	// Settled: the pool of file systems and user namespaces made ahead is
	// full once a create has come and gone.
	warm := create(t, c, dsec.CreateOptions{Runtime: rt})
	warm.Close()
	time.Sleep(2 * time.Second)
	loopsBefore, mountsBefore := loops(), mounts()
	sb, err := c.Create(ctxFor(t, 2*time.Minute), dsec.CreateOptions{Runtime: rt, Image: "busybox", DiskMB: fillDiskMB, TTL: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("dd if=/dev/zero of=/tmp/x bs=1M count=8")); err != nil {
		t.Fatal(err)
	}
	rng := rangeOf(sb)
	t.Run("while it runs it holds a file system and an id range", func(t *testing.T) {
		if _, err := os.Lstat(rng); rng == "" || err != nil {
			t.Errorf("no id range recorded for the sandbox (%q): %v", rng, err)
		}
		if loops() == 0 {
			t.Errorf("no loop device holds a sandbox's disk")
		}
		if size, _ := dfRoot(t, sb); size > fillDiskMB<<10 {
			t.Errorf("df / inside: %d KiB", size)
		}
	})
	nb.check(t)
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	t.Run("after delete its range, loop device and mounts are gone", func(t *testing.T) {
		deadline := time.Now().Add(20 * time.Second)
		for {
			l, m := loops(), mounts()
			_, err := os.Lstat(rng)
			if l <= loopsBefore && m <= mountsBefore && err != nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("after delete: loop devices %d→%d, node mounts %d→%d, id range %s still recorded: %v", loopsBefore, l, mountsBefore, m, rng, err == nil)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
}
