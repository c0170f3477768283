package e2e

import (
	"bytes"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// Volumes on a real server: ext4 images on loop devices, real crun
// sandboxes, a real restart.
func TestVolumes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	vol, err := c.CreateVolume(ctx, "work", dsec.VolumeOptions{SizeMB: 16})
	if err != nil {
		t.Fatal(err)
	}
	mount := func(ro bool) []dsec.VolumeMount {
		return []dsec.VolumeMount{{Name: "work", Path: "/work", ReadOnly: ro}}
	}
	run := func(t *testing.T, sb *dsec.Sandbox, cmd string) string {
		t.Helper()
		r, err := sb.Exec(ctx, dsec.Cmd(cmd))
		if err != nil {
			t.Fatal(err)
		}
		return string(r.Stdout) + string(r.Stderr)
	}
	var owner *dsec.Sandbox
	top := t
	t.Run("what one sandbox writes the next reads, as its root's", func(t *testing.T) {
		first := create(t, c, dsec.CreateOptions{Volumes: mount(false)})
		if out := run(t, first, "echo from-the-first > /work/f && mkdir /work/d && chown 1000 /work/d && echo ok"); out != "ok\n" {
			t.Fatalf("first sandbox: %q", out)
		}
		first.Close()
		owner = create(top, c, dsec.CreateOptions{Volumes: mount(false)}) // it lives on for the tests below
		if out := run(t, owner, "cat /work/f; stat -c %u /work/f /work/d; echo more >> /work/f && echo appended"); out != "from-the-first\n0\n1000\nappended\n" {
			t.Fatalf("next sandbox: %q", out)
		}
	})
	t.Run("a second read-write mount is refused while the first sandbox lives", func(t *testing.T) {
		_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Volumes: mount(false)})
		if kind(err) != "conflict" || !strings.Contains(err.Error(), owner.ID) {
			t.Fatalf("second read-write mount: %v, want a conflict naming %s", err, owner.ID)
		}
	})
	t.Run("read-only mounts are shared, and refuse writes", func(t *testing.T) {
		for range 2 {
			reader := create(t, c, dsec.CreateOptions{Volumes: mount(true)})
			if out := run(t, reader, "cat /work/f; touch /work/g"); !strings.HasPrefix(out, "from-the-first\nmore\n") || !strings.Contains(out, "Read-only file system") {
				t.Fatalf("read-only sandbox: %q", out)
			}
		}
	})
	t.Run("writing past the size fails with ENOSPC inside and the host is fine", func(t *testing.T) {
		out := run(t, owner, "dd if=/dev/zero of=/work/fill bs=1M count=64 2>&1; df -k /work | tail -1")
		if !strings.Contains(out, "No space left on device") {
			t.Fatalf("filling the volume: %q", out)
		}
		var st syscall.Stat_t
		img := filepath.Join(srv.DataDir, "volumes", vol.Id+".img")
		if err := syscall.Stat(img, &st); err != nil {
			t.Fatal(err)
		}
		if used := st.Blocks * 512; used > 17<<20 {
			t.Fatalf("the volume's image takes %d bytes of the host's disk, more than its 16 MiB", used)
		}
		if out := run(t, owner, "rm /work/fill && echo 'the volume works again' > /work/h && cat /work/h"); out != "the volume works again\n" {
			t.Fatalf("after the fill: %q", out)
		}
		if resp, err := http.Get(srv.URL + "/healthz"); err != nil || resp.StatusCode != 200 {
			t.Fatalf("server after the fill: %v %v", resp, err)
		}
	})
	t.Run("a mounted volume is not deleted", func(t *testing.T) {
		err := c.DeleteVolume(ctx, "work")
		if kind(err) != "conflict" {
			t.Fatalf("delete of a mounted volume: %v, want conflict", err)
		}
	})
	t.Run("after a restart the volume, its content and its owner are kept", func(t *testing.T) {
		srv.Restart()
		got, err := c.GetVolume(ctx, "work")
		if err != nil || got.Id != vol.Id || got.Writer != owner.ID || got.SizeMb != 16 {
			t.Fatalf("after restart: %v %v", got, err)
		}
		if out := run(t, owner, "cat /work/h && echo after > /work/after && cat /work/after"); out != "the volume works again\nafter\n" {
			t.Fatalf("the owner after restart: %q", out)
		}
		var b bytes.Buffer
		if _, err := c.ReadVolumeFile(ctx, "work", "/after", &b); err != nil || b.String() != "after\n" {
			t.Fatalf("read through the API after restart: %q %v", b.String(), err)
		}
		if _, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Volumes: mount(false)}); kind(err) != "conflict" {
			t.Fatalf("a second read-write mount after restart: %v, want conflict", err)
		}
		if err := c.DeleteVolume(ctx, "work"); kind(err) != "conflict" {
			t.Fatalf("delete of a mounted volume after restart: %v, want conflict", err)
		}
	})
	t.Run("once no sandbox mounts it, it is deleted with its image", func(t *testing.T) {
		for _, sb := range mustList(t, c) {
			c.Delete(ctx, sb)
		}
		if err := c.DeleteVolume(ctx, "work"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.GetVolume(ctx, vol.Id); kind(err) != "not_found" {
			t.Fatalf("get after delete: %v", err)
		}
		if _, err := os.Stat(filepath.Join(srv.DataDir, "volumes", vol.Id+".img")); !os.IsNotExist(err) {
			t.Fatalf("the image is still there: %v", err)
		}
	})
}

func mustList(t *testing.T, c *dsec.Client) []string {
	t.Helper()
	list, err := c.List(ctxFor(t, time.Minute), "")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, sb := range list {
		ids = append(ids, sb.Id)
	}
	return ids
}

func TestVolumeCLI(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	ctx := ctxFor(t, 3*time.Minute)
	cli := func(args ...string) string {
		t.Helper()
		out, errOut, code := srv.CLI(ctx, "", args...)
		if code != 0 {
			t.Fatalf("dsec %s: exit %d: %s", strings.Join(args, " "), code, errOut)
		}
		return out
	}
	id := strings.TrimSpace(cli("volume", "create", "cli-vol", "--size", "32M"))
	if !strings.HasPrefix(id, "vol-") {
		t.Fatalf("volume create printed %q", id)
	}
	sb := strings.TrimSpace(cli("create", "--image", "busybox", "--volume", "cli-vol:/v"))
	ro := strings.TrimSpace(cli("create", "--image", "busybox", "--volume", "cli-vol:/v:ro"))
	if out := cli("exec", sb, "--", "sh", "-c", "echo via-cli > /v/x"); out != "" {
		t.Fatalf("exec: %q", out)
	}
	if out := cli("exec", ro, "--", "cat", "/v/x"); out != "via-cli\n" {
		t.Fatalf("read-only reader: %q", out)
	}
	ls := cli("volume", "ls")
	for _, want := range []string{"cli-vol", id, "32.0M", sb + " (rw)", ro + " (ro)"} {
		if !strings.Contains(ls, want) {
			t.Errorf("volume ls lacks %q:\n%s", want, ls)
		}
	}
	if _, errOut, code := srv.CLI(ctx, "", "volume", "rm", "cli-vol"); code == 0 || !strings.Contains(errOut, "mounted by sandbox") {
		t.Fatalf("volume rm of a mounted volume: exit %d: %s", code, errOut)
	}
	if _, errOut, code := srv.CLI(ctx, "", "create", "--image", "busybox", "--volume", "cli-vol"); code == 0 || !strings.Contains(errOut, "NAME:/PATH") {
		t.Fatalf("a malformed --volume: exit %d: %s", code, errOut)
	}
	cli("rm", sb, ro)
	cli("volume", "rm", "cli-vol")
	if ls := cli("volume", "ls"); strings.Contains(ls, "cli-vol") {
		t.Fatalf("volume ls after rm:\n%s", ls)
	}
}
