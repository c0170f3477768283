package image

import (
	"context"
	"crypto/sha256"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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
	t.Run("another store imports the cached build, by tar or by links, to the same layers", func(t *testing.T) {
		// importInto bootstraps base into a new store in dir, by tar only
		// with noLinks, and checks it has the first store's layers.
		importInto := func(dir string, noLinks bool, how string) *Store {
			st, err := Open(dir, slog.Default())
			if err != nil {
				t.Fatal(err)
			}
			st.noLinks = noLinks
			start := time.Now()
			again, err := st.Bootstrap(ctx, "base", "e2b-base", BootstrapOptions{CacheDir: cache}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("imported %s in %v", how, time.Since(start))
			if strings.Join(again.Layers, ",") != strings.Join(img.Layers, ",") || again.Digest != img.Digest {
				t.Fatalf("import %s: %v %s, first %v %s", how, again.Layers, again.Digest, img.Layers, img.Digest)
			}
			return st
		}
		byTar := importInto(t.TempDir(), true, "by tar")
		// The import by tar recorded the layers: the next links them
		// where the cache and the store share a file system.
		dir := t.TempDir()
		byLinks := importInto(dir, false, "by links")
		var storeFS, cacheFS syscall.Stat_t
		if err := syscall.Stat(dir, &storeFS); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Stat(cache, &cacheFS); err != nil {
			t.Fatal(err)
		}
		shared := storeFS.Dev == cacheFS.Dev
		for i, l := range img.Layers {
			a, b := byTar.LayerDir(l), byLinks.LayerDir(l)
			whiteouts, opaque := sameTree(t, a, b)
			t.Logf("layer %d: the same tree by tar and by links (%d whiteouts, %d opaque directories)", i, whiteouts, opaque)
			// Linked: the layer's files are the build's (directories), or
			// its EROFS image is the host's copy (images).
			tarFile, linkFile := filepath.Join(a, "usr/bin/bash"), filepath.Join(b, "usr/bin/bash")
			if ok, _ := byLinks.Erofs(); ok {
				id := strings.TrimPrefix(l, "sha256:")
				tarFile, linkFile = byTar.erofsFile(id), byLinks.erofsFile(id)
			}
			var tarBash, linkBash syscall.Stat_t
			syscall.Lstat(tarFile, &tarBash)
			syscall.Lstat(linkFile, &linkBash)
			if i == 0 && (linkBash.Nlink > 1) != shared {
				t.Errorf("%s in the linked layer has %d links (store and cache on one file system: %v)", linkFile, linkBash.Nlink, shared)
			}
			if i == 0 && tarBash.Nlink != 1 {
				t.Errorf("%s in the layer by tar has %d links", tarFile, tarBash.Nlink)
			}
		}
	})
}

// sameTree fails t where the trees at a and b differ in a name, a type,
// an owner, a mode, a size, a modification time, a device, a symlink's
// target, an extended attribute or a regular file's content; files linked
// together in one must be in the other. It counts b's whiteouts and
// opaque directories.
func sameTree(t *testing.T, a, b string) (whiteouts, opaque int) {
	t.Helper()
	type entry struct {
		st     syscall.Stat_t
		target string
		xattrs string
		sum    [32]byte
	}
	read := func(root string) (map[string]*entry, map[string]string) {
		out := map[string]*entry{}
		firstOf := map[uint64]string{}
		linkedTo := map[string]string{} // a path → the first path of its inode
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil {
				t.Fatal(err)
			}
			rel, _ := filepath.Rel(root, p)
			if rel == "." {
				return nil
			}
			e := &entry{}
			if err := syscall.Lstat(p, &e.st); err != nil {
				t.Fatal(err)
			}
			var names []string
			buf := make([]byte, 4096)
			if n, err := unix.Llistxattr(p, buf); err == nil {
				for _, name := range strings.Split(string(buf[:n]), "\x00") {
					if name != "" {
						v, _ := getXattr(p, name)
						names = append(names, name+"="+string(v))
					}
				}
			}
			sort.Strings(names)
			e.xattrs = strings.Join(names, ",")
			switch e.st.Mode & syscall.S_IFMT {
			case syscall.S_IFLNK:
				e.target, _ = os.Readlink(p)
			case syscall.S_IFREG:
				if prev, ok := firstOf[e.st.Ino]; ok {
					linkedTo[rel] = prev
				} else {
					firstOf[e.st.Ino] = rel
				}
				f, err := os.Open(p)
				if err != nil {
					t.Fatal(err)
				}
				h := sha256.New()
				io.Copy(h, f)
				f.Close()
				copy(e.sum[:], h.Sum(nil))
			}
			out[rel] = e
			return nil
		})
		return out, linkedTo
	}
	ta, la := read(a)
	tb, lb := read(b)
	for rel, x := range ta {
		y, ok := tb[rel]
		if !ok {
			t.Errorf("%s: only in the layer by tar", rel)
			continue
		}
		if x.st.Mode != y.st.Mode || x.st.Uid != y.st.Uid || x.st.Gid != y.st.Gid || x.st.Rdev != y.st.Rdev ||
			x.st.Mtim != y.st.Mtim || x.target != y.target || x.xattrs != y.xattrs || x.sum != y.sum ||
			(x.st.Mode&syscall.S_IFMT != syscall.S_IFDIR && x.st.Size != y.st.Size) {
			t.Errorf("%s differs: by tar mode %o uid %d gid %d rdev %d mtime %v size %d -> %q xattrs %q; by links mode %o uid %d gid %d rdev %d mtime %v size %d -> %q xattrs %q",
				rel, x.st.Mode, x.st.Uid, x.st.Gid, x.st.Rdev, x.st.Mtim, x.st.Size, x.target, x.xattrs,
				y.st.Mode, y.st.Uid, y.st.Gid, y.st.Rdev, y.st.Mtim, y.st.Size, y.target, y.xattrs)
		}
		if la[rel] != lb[rel] {
			t.Errorf("%s: linked to %q by tar, %q by links", rel, la[rel], lb[rel])
		}
		if y.st.Mode&syscall.S_IFMT == syscall.S_IFCHR && y.st.Rdev == 0 {
			whiteouts++
		}
		if strings.Contains(y.xattrs, "trusted.overlay.opaque=y") {
			opaque++
		}
	}
	for rel := range tb {
		if _, ok := ta[rel]; !ok {
			t.Errorf("%s: only in the layer by links", rel)
		}
	}
	return whiteouts, opaque
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
