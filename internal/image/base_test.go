package image

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/tenant"
)

// TestBootstrapBase builds (or takes from DSEC_CACHE_DIR) the "base"
// recipe: E2B's base template, a layer on top of the "debian" recipe's.
func TestBootstrapBase(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap (scripts/setup.sh installs it)")
	}
	if testing.Short() {
		t.Skip("builds the debian and base root filesystems when not cached")
	}
	cache := os.Getenv("DSEC_CACHE_DIR")
	if cache == "" {
		cache = t.TempDir()
	}
	ctx, cancel := context.WithTimeout(tenant.System(context.Background()), 20*time.Minute)
	defer cancel()
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	debian, err := s.Bootstrap(ctx, "debian", "", BootstrapOptions{CacheDir: cache}, nil)
	if err != nil {
		t.Fatal(err)
	}
	img, err := s.Bootstrap(ctx, "base", "", BootstrapOptions{CacheDir: cache}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("the image is debian's layer and one of its own", func(t *testing.T) {
		if len(img.Layers) != 2 || img.Layers[0] != debian.Layers[0] {
			t.Fatalf("layers %v, debian's %v", img.Layers, debian.Layers)
		}
	})
	t.Run("its config makes user the default user, its home the working directory, and allows privilege escalation", func(t *testing.T) {
		c := img.Config
		if c.User != BaseUser || !c.PrivilegeEscalation || c.Workdir != "/home/user" || !strings.Contains(strings.Join(c.Env, " "), "PATH=") {
			t.Fatalf("config %+v", c)
		}
		if d := debian.Config; d.User != "" || d.PrivilegeEscalation {
			t.Fatalf("debian's config changed: %+v", d)
		}
	})
	top := s.LayerDir(img.Layers[1])
	t.Run("the layer has the user, its home and its sudoers entry", func(t *testing.T) {
		passwd, _ := os.ReadFile(filepath.Join(top, "etc/passwd"))
		if !strings.Contains(string(passwd), "\nuser:x:1000:1000::/home/user:/bin/bash\n") {
			t.Errorf("etc/passwd:\n%s", passwd)
		}
		group, _ := os.ReadFile(filepath.Join(top, "etc/group"))
		if !strings.Contains(string(group), "\nsudo:x:27:user\n") || !strings.Contains(string(group), "\nuser:x:1000:\n") {
			t.Errorf("etc/group:\n%s", group)
		}
		wantOwner(t, filepath.Join(top, "home/user"), 1000, 0o755|os.ModeDir)
		wantOwner(t, filepath.Join(top, "home/user/.bashrc"), 1000, 0o644)
		sudoers := filepath.Join(top, "etc/sudoers.d/user")
		wantOwner(t, sudoers, 0, 0o440)
		if b, _ := os.ReadFile(sudoers); string(b) != "user ALL=(ALL:ALL) NOPASSWD: ALL\n" {
			t.Errorf("sudoers entry %q", b)
		}
	})
	t.Run("the layer has sudo setuid root, curl, git and the python name", func(t *testing.T) {
		wantOwner(t, filepath.Join(top, "usr/bin/sudo"), 0, 0o755|os.ModeSetuid)
		for _, f := range []string{"usr/bin/curl", "usr/bin/git", "usr/lib/git-core/git-daemon"} {
			if st, err := os.Stat(filepath.Join(top, f)); err != nil || st.Mode()&0o111 == 0 {
				t.Errorf("%s: %v", f, err)
			}
		}
		if target, err := os.Readlink(filepath.Join(top, "usr/bin/python")); err != nil || target != "python3" {
			t.Errorf("usr/bin/python -> %q, %v", target, err)
		}
	})
	t.Run("the layer leaves out the host's resolver and apt's lists", func(t *testing.T) {
		for _, f := range []string{"etc/resolv.conf", "etc/apt/sources.list", "usr/sbin/policy-rc.d"} {
			if _, err := os.Lstat(filepath.Join(top, f)); err == nil {
				t.Errorf("%s is in the layer", f)
			}
		}
		for _, dir := range []string{"var/lib/apt/lists", "var/log"} {
			ents, _ := os.ReadDir(filepath.Join(top, dir))
			for _, e := range ents {
				if e.Name() != "partial" && e.Name() != "lock" {
					t.Errorf("%s/%s is in the layer", dir, e.Name())
				}
			}
		}
	})
	t.Run("neither layer keeps the build's dpkg setting", func(t *testing.T) {
		for _, l := range img.Layers {
			if _, err := os.Lstat(filepath.Join(s.LayerDir(l), "etc/dpkg/dpkg.cfg.d/dsec-build-unsafe-io")); err == nil {
				t.Errorf("layer %s keeps dpkg's force-unsafe-io", l)
			}
		}
	})
	t.Run("another store imports the cached build", func(t *testing.T) {
		s2, err := Open(t.TempDir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		again, err := s2.Bootstrap(ctx, "base", "e2b-base", BootstrapOptions{CacheDir: cache}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(again.Layers, ",") != strings.Join(img.Layers, ",") || again.Digest != img.Digest {
			t.Fatalf("second import: %v %s, first %v %s", again.Layers, again.Digest, img.Layers, img.Digest)
		}
		t.Logf("imported from the cache in %v", time.Since(start))
	})
}

// wantOwner checks that p is owned by uid (and the same gid) with mode.
func wantOwner(t *testing.T, p string, uid uint32, mode os.FileMode) {
	t.Helper()
	st, err := os.Lstat(p)
	if err != nil {
		t.Error(err)
		return
	}
	sys := st.Sys().(*syscall.Stat_t)
	if sys.Uid != uid || sys.Gid != uid || st.Mode() != mode {
		t.Errorf("%s: uid %d gid %d mode %v, want %d %d %v", p, sys.Uid, sys.Gid, st.Mode(), uid, uid, mode)
	}
}
