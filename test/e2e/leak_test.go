package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// mountPoints lists the mount points in a process's mount namespace,
// leaving out the node's pool of sandbox file systems (RUN_DIR/disks/…):
// the pool keeps up to four made ahead or recycled, whatever sandboxes
// come and go, so the test bounds it separately.
func mountPoints(pid int, poolDir string) (points []string, pool int) {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		if strings.HasPrefix(f[4], poolDir+"/") {
			pool++
			continue
		}
		points = append(points, f[4])
	}
	return points, pool
}

// without is a's elements that b lacks, counting repeats (a mount point
// can be mounted over).
func without(a, b []string) []string {
	have := map[string]int{}
	for _, x := range b {
		have[x]++
	}
	var out []string
	for _, x := range a {
		if have[x] > 0 {
			have[x]--
			continue
		}
		out = append(out, x)
	}
	return out
}

func TestHundredCreateDeleteCyclesLeaveNothingBehind(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 10*time.Minute)
	abs, _ := filepath.Abs(filepath.Join(srv.DataDir, "container"))
	runDir := srv.RunDir()
	runtimeDir := filepath.Join(runDir, "runtime")
	// The node's own mount namespace (where sandboxes' overlays, disks and
	// network namespaces are mounted), not the server's: the host's shows
	// none of them.
	node := srv.NodePid()
	mountsBefore, _ := mountPoints(node, filepath.Join(runDir, "disks"))
	if _, pool := mountPoints(node, filepath.Join(runDir, "disks")); pool == 0 {
		t.Fatalf("the check below would not see sandbox file systems: none mounted under %s/disks in the node (pid %d)", runDir, node)
	}

	var ids []string
	for i := 0; i < 100; i++ {
		mode := "none"
		if i%2 == 1 {
			mode = "egress"
		}
		sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Network: mode, MemoryMB: 64})
		if err != nil {
			t.Fatalf("cycle %d create: %v", i, err)
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("echo x > /tmp/f; sleep 100 >/dev/null 2>&1 &")); err != nil {
			t.Fatalf("cycle %d exec: %v", i, err)
		}
		if _, err := net.InterfaceByName(vethOf(sb.ID)); mode == "egress" && err != nil {
			t.Fatalf("cycle %d: the check below would not see the sandbox's veth: %v", i, err)
		}
		if i == 0 {
			for _, p := range []string{filepath.Join(runtimeDir, sb.ID), filepath.Join(srv.DataDir, "sandboxes", sb.ID), "/sys/fs/cgroup/pids/dsec/" + sb.ID} {
				if _, err := os.Stat(p); err != nil {
					t.Fatalf("the check below would not see a sandbox's %s: %v", p, err)
				}
			}
		}
		if i == 1 {
			_, table := srv.Network()
			if out, _ := exec.Command("nft", "list", "set", "bridge", table, "sources").CombinedOutput(); !strings.Contains(string(out), vethOf(sb.ID)) {
				t.Fatalf("the check below would not see the sandbox's bridge table element: %s", out)
			}
		}
		if err := sb.Close(); err != nil {
			t.Fatalf("cycle %d delete: %v", i, err)
		}
		ids = append(ids, sb.ID)
	}
	// The trash is emptied in the background: what is left is looked for
	// until nothing is or a minute has passed.
	leftovers := func() (left []string) {
		points, pool := mountPoints(node, filepath.Join(runDir, "disks"))
		if extra := without(points, mountsBefore); len(extra) > 0 {
			left = append(left, fmt.Sprintf("%d mounts (%s)", len(extra), strings.Join(extra, ", ")))
		}
		// The pool's bound (container.diskPoolMax), mounted and on disk.
		if pool > 4 {
			left = append(left, fmt.Sprintf("%d sandbox file systems mounted (the pool keeps at most 4)", pool))
		}
		if imgs, _ := filepath.Glob(filepath.Join(abs, "disks", "*.img")); len(imgs) > 4 {
			left = append(left, fmt.Sprintf("%d sandbox file system images (the pool keeps at most 4)", len(imgs)))
		}
		for _, id := range ids {
			for _, p := range []string{
				"/sys/fs/cgroup/pids/dsec/" + id, "/sys/fs/cgroup/memory/dsec/" + id, "/sys/fs/cgroup/dsec/" + id,
				filepath.Join(runtimeDir, id), filepath.Join(srv.DataDir, "sandboxes", id),
			} {
				if _, err := os.Stat(p); err == nil {
					left = append(left, p)
				}
			}
		}
		if ents, _ := os.ReadDir(filepath.Join(srv.DataDir, "trash")); len(ents) > 0 {
			left = append(left, fmt.Sprintf("%d trash entries", len(ents)))
		}
		// The host-side veth of each sandbox (network.vethName): other tests on
		// this host add and remove interfaces of their own meanwhile.
		for _, id := range ids {
			name := vethOf(id)
			for _, n := range []string{name, name + "p"} {
				if _, err := net.InterfaceByName(n); err == nil {
					left = append(left, "network interface "+n)
				}
			}
		}
		// The bridge table's per-sandbox source elements and the host's
		// permanent neighbour entries for sandboxes.
		bridge, table := srv.Network()
		if out, err := exec.Command("nft", "list", "set", "bridge", table, "sources").CombinedOutput(); err != nil {
			left = append(left, fmt.Sprintf("unreadable bridge table: %v: %s", err, out))
		} else if strings.Contains(string(out), "elements") {
			left = append(left, "bridge table elements: "+string(out))
		}
		if out, _ := exec.Command("ip", "neigh", "show", "dev", bridge, "nud", "permanent").CombinedOutput(); len(strings.TrimSpace(string(out))) > 0 {
			left = append(left, "permanent neighbour entries: "+string(out))
		}
		if list, _ := c.List(ctx, ""); len(list) > 0 {
			left = append(left, fmt.Sprintf("%d listed sandboxes", len(list)))
		}
		return left
	}
	left := leftovers()
	for deadline := time.Now().Add(time.Minute); len(left) > 0 && time.Now().Before(deadline); left = leftovers() {
		time.Sleep(100 * time.Millisecond)
	}
	if len(left) > 0 {
		t.Fatalf("after 100 create/delete cycles, left behind: %s", strings.Join(left, "; "))
	}
}

// vethOf is the host-side veth name of a sandbox (as internal/network
// names it).
func vethOf(id string) string {
	name := "ds" + strings.ReplaceAll(id, "-", "")
	return name[:min(len(name), 13)]
}
