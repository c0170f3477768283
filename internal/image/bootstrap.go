package image

import (
	"archive/tar"
	"bufio"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Recipes are the base images Bootstrap can build offline.
var Recipes = []string{"busybox", "debian", "polyglot", "base"}

// DebianPackages are installed in the "debian" recipe on top of minbase.
var DebianPackages = []string{"bash", "coreutils", "python3", "gcc", "g++", "libc6-dev", "make", "ca-certificates", "procps"}

// PolyglotPackages are installed in the "polyglot" recipe, a layer on top
// of the "debian" recipe's: the toolchain of every SandboxFusion language that
// Debian packages (the function substrate's languages.go), and the test
// runners of its test modes (pytest, go test, JUnit 5, Jest). Julia, Lean
// and Swift are not packaged by Debian 12; SandboxFusion's C# runs on
// .NET, which Debian does not package either, so C# runs on Mono here.
var PolyglotPackages = []string{
	"golang-go", "nodejs", "node-typescript", "jest", "openjdk-17-jdk-headless", "junit5",
	"rustc", "php-cli", "ruby", "lua5.4", "r-base-core", "perl", "scala", "kotlin", "mono-mcs",
	"gdc", "racket", "iverilog", "sqlite3", "python3-pytest",
}

// BasePackages are installed in the "base" recipe, a layer on top of the
// "debian" recipe's: what E2B's base template offers the code that runs in
// it (curl, git, the `python` name) and sudo for its user.
var BasePackages = []string{"sudo", "curl", "git", "python-is-python3"}

// The "base" recipe's user: E2B's base template runs everything as "user"
// (uid and gid 1000, home /home/user) with passwordless sudo.
const (
	BaseUser = "user"
	BaseUID  = 1000
)

// baseVersion and polyglotVersion change whenever the "base" or
// "polyglot" recipe below does, so cached layers are rebuilt.
const (
	baseVersion     = "1"
	polyglotVersion = "2"
)

// BootstrapOptions configure Bootstrap.
type BootstrapOptions struct {
	// CacheDir keeps built root filesystems across stores (default: the
	// store's own cache/ directory).
	CacheDir string
	// Mirror and Suite select the apt repository for "debian" (default: the
	// host's own apt sources and release).
	Mirror, Suite string
	// Packages are extra packages for "debian" and "polyglot", or for
	// "base"'s own layer.
	Packages []string
	// Force rebuilds the recipe's root filesystem even if cached (for
	// "base", its own layer, not the "debian" one under it).
	Force bool
	// DiskMB is the disk size of a VM image (BuildVM; default 4096).
	DiskMB int64
}

// Bootstrap builds a base image from the host's packages without any
// registry: "busybox" from the static busybox binary, "debian" with
// debootstrap from the host's apt mirror, and "base" and "polyglot" as a
// layer on top of "debian"'s (see overlayBuild). Root filesystems and layers
// are cached in opts.CacheDir, so a second store imports them in seconds.
func (s *Store) Bootstrap(ctx context.Context, recipe, as string, opts BootstrapOptions, progress Progress) (*Image, error) {
	if as == "" {
		as = recipe
	}
	if err := ValidName(as); err != nil {
		return nil, err
	}
	if err := s.admit(); err != nil {
		return nil, err
	}
	defer s.fit()
	if opts.CacheDir == "" {
		opts.CacheDir = filepath.Join(s.dir, "cache")
	}
	debianEnv := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"}
	var (
		key   string
		build func(ctx context.Context, dir string, progress Progress) error
		cfg   Config
		// lower, when set, is the cached root filesystem the recipe's
		// own directory is an overlayfs upper directory of: the image's
		// first layer, under the recipe's own.
		lower *cachedBuild
	)
	switch recipe {
	case "busybox":
		bb, err := findBusybox()
		if err != nil {
			return nil, err
		}
		key = "busybox-" + fileDigest(bb)
		build = func(ctx context.Context, dir string, _ Progress) error { return buildBusybox(bb, dir) }
		cfg = Config{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, Cmd: []string{"sh"}}
	case "debian":
		mirror, suite, err := aptSource(opts)
		if err != nil {
			return nil, err
		}
		key, build = debianBuild(mirror, suite, append(append([]string(nil), DebianPackages...), opts.Packages...))
		cfg = Config{Env: debianEnv, Cmd: []string{"bash"}}
	case "base", "polyglot":
		// A layer over the "debian" recipe's root filesystem (built once
		// for every recipe on it): apt installs only the layer's packages.
		mirror, suite, err := aptSource(opts)
		if err != nil {
			return nil, err
		}
		dkey, dbuild := debianBuild(mirror, suite, DebianPackages)
		lower = &cachedBuild{key: dkey, recipe: "debian", build: dbuild}
		// The layer's packages, then (base) what apt does not make.
		own, version, finish := PolyglotPackages, polyglotVersion, func(context.Context, string, Progress) error { return nil }
		cfg = Config{Env: debianEnv, Cmd: []string{"bash"}}
		if recipe == "base" {
			own, version, finish = BasePackages, baseVersion, addBaseUser
			// E2B's template defaults: user "user", working directory its
			// home (where envd starts a process without a cwd, as any user).
			cfg = Config{Env: debianEnv, User: BaseUser, Workdir: "/home/" + BaseUser, Cmd: []string{"bash"}, PrivilegeEscalation: true}
		}
		pkgs := append(append([]string(nil), own...), opts.Packages...)
		sort.Strings(pkgs)
		h := sha256.Sum256([]byte(dkey + "|" + strings.Join(pkgs, ",") + "|" + version))
		key = recipe + "-" + suite + "-" + hex.EncodeToString(h[:6])
		build = func(ctx context.Context, dir string, progress Progress) error {
			return overlayBuild(lower.dir, dir, func(merged string) error {
				if err := aptInstall(ctx, merged, mirror, suite, pkgs, progress); err != nil {
					return err
				}
				return finish(ctx, merged, progress)
			})
		}
	default:
		return nil, errdefs.Invalid("unknown bootstrap recipe %q (have %s)", recipe, strings.Join(Recipes, ", "))
	}
	if lower != nil {
		// The lower root filesystem is built (or found) first, and not
		// rebuilt by Force, which rebuilds only the recipe's own part.
		if err := lower.ensure(ctx, opts.CacheDir, false, progress); err != nil {
			return nil, err
		}
	}
	top := &cachedBuild{key: key, recipe: recipe, build: build}
	if err := top.ensure(ctx, opts.CacheDir, opts.Force, progress); err != nil {
		return nil, err
	}
	progress.report("unpack", "importing "+recipe+" root filesystem", 0, 0)
	img := &Image{Name: as, Owner: tenant.ImageOwner(ctx), Created: time.Now().UTC(), Source: "bootstrap:" + key, Config: cfg}
	if lower != nil {
		diff, size, release, err := s.bootstrapLayer(lower, true, false)
		if err != nil {
			return nil, err
		}
		defer release()
		img.Layers, img.Size = append(img.Layers, diff), img.Size+size
	}
	diff, size, release, err := s.bootstrapLayer(top, !opts.Force, lower != nil)
	if err != nil {
		return nil, err
	}
	defer release()
	img.Layers, img.Size = append(img.Layers, diff), img.Size+size
	d := sha256.New()
	json.NewEncoder(d).Encode(struct {
		L []string
		C Config
	}{img.Layers, img.Config})
	img.Digest = "sha256:" + hex.EncodeToString(d.Sum(nil))
	if err := s.Put(img); err != nil {
		return nil, err
	}
	progress.report("done", as, img.Size, img.Size)
	return img, nil
}

// aptSource is the apt repository of a Debian recipe: the options', else
// the host's.
func aptSource(opts BootstrapOptions) (mirror, suite string, err error) {
	mirror, suite = opts.Mirror, opts.Suite
	if mirror == "" || suite == "" {
		m, su, err := hostAptSource()
		if err != nil {
			return "", "", err
		}
		if mirror == "" {
			mirror = m
		}
		if suite == "" {
			suite = su
		}
	}
	return mirror, suite, nil
}

// debianBuild is the cache key and build of a root filesystem
// debootstrapped with pkgs.
func debianBuild(mirror, suite string, pkgs []string) (string, func(context.Context, string, Progress) error) {
	pkgs = append([]string(nil), pkgs...)
	sort.Strings(pkgs)
	h := sha256.Sum256([]byte(mirror + "|" + suite + "|" + strings.Join(pkgs, ",")))
	key := "debian-" + suite + "-" + hex.EncodeToString(h[:6])
	return key, func(ctx context.Context, dir string, progress Progress) error {
		return buildDebian(ctx, dir, mirror, suite, pkgs, progress)
	}
}

// cachedBuild is a directory a recipe builds once in the cache directory
// (cache/rootfs/<key>) and every store then imports.
type cachedBuild struct {
	key, recipe string
	build       func(ctx context.Context, dir string, progress Progress) error
	// dir is the built directory, once ensure returned.
	dir string
}

// ensure builds b unless the cache has it (or force), and sets b.dir.
// Stores on one host share the cache: one builds, the others wait.
func (b *cachedBuild) ensure(ctx context.Context, cacheDir string, force bool, progress Progress) error {
	rootfs := filepath.Join(cacheDir, "rootfs", b.key)
	if err := os.MkdirAll(filepath.Dir(rootfs), 0o700); err != nil {
		return err
	}
	unlock, err := lockFile(rootfs + ".lock")
	if err != nil {
		return err
	}
	defer unlock()
	if force {
		os.RemoveAll(rootfs)
		os.Remove(rootfs + ".complete")
	}
	if _, err := os.Stat(rootfs + ".complete"); err != nil {
		os.Remove(rootfs + ".layer") // the layer of a build that is no more
		if stale, err := filepath.Glob(rootfs + ".*.erofs.d*"); err == nil {
			for _, f := range stale {
				os.RemoveAll(f) // its EROFS layer files (linklayer.go)
			}
		}
		progress.report("build", "building "+b.recipe+" root filesystem", 0, 0)
		tmp := rootfs + ".building"
		os.RemoveAll(tmp)
		if err := os.MkdirAll(tmp, 0o755); err != nil {
			return err
		}
		if err := b.build(ctx, tmp, progress); err != nil {
			os.RemoveAll(tmp)
			return err
		}
		// dpkg wrote without syncing each file (unsafeIO): one sync of
		// the file system makes the build durable before it is marked
		// complete.
		if err := syncFS(tmp); err != nil {
			return err
		}
		os.RemoveAll(rootfs)
		if err := os.Rename(tmp, rootfs); err != nil {
			return err
		}
		if err := os.WriteFile(rootfs+".complete", []byte(time.Now().UTC().Format(time.RFC3339)), 0o600); err != nil {
			return err
		}
	}
	b.dir = rootfs
	return nil
}

// bootstrapLayer stores the layer of a cached build: its directory as a
// tar (an overlayfs upper directory's, with overlay), unpacked, or its
// files linked when an import by tar recorded the layer (linklayer.go).
// With reuse, a layer this store already imported from the same build
// (another bootstrapped image's, e.g. "debian" under "base") is not read
// again. The layer is held (see Hold) until release is called.
func (s *Store) bootstrapLayer(b *cachedBuild, reuse, overlay bool) (string, int64, func(), error) {
	if diff, size, ok := s.bootstrapped(b.key); ok && reuse {
		if release, err := s.Hold([]string{diff}); err == nil {
			return diff, size, release, nil
		}
	}
	if m, ok := b.memo(overlay); ok && !s.noLinks {
		release, err := s.linkLayer(m.Diff, b.dir, overlay)
		if err == nil {
			return m.Diff, m.Size, release, nil
		}
		s.log.Info("importing a cached build by tar: its files cannot be linked", slog.String("build", b.key), slog.Any("error", err))
	}
	pr, pw := io.Pipe()
	go func() {
		if overlay {
			pw.CloseWithError(TarOverlayUpper(b.dir, pw, IDShift{}))
		} else {
			pw.CloseWithError(tarDir(b.dir, pw))
		}
	}()
	diff, size, release, err := s.AddLayer(pr)
	pr.Close()
	if err != nil {
		return "", 0, nil, fmt.Errorf("import %s root filesystem: %w", b.recipe, err)
	}
	b.remember(diff, size, overlay)
	return diff, size, release, nil
}

// bootstrapped finds the layer an image bootstrapped from the cached build
// key has as its own (its last), if the store still holds it.
func (s *Store) bootstrapped(key string) (string, int64, bool) {
	s.mu.Lock()
	var diff string
	for _, img := range s.images {
		if img.Source == "bootstrap:"+key && len(img.Layers) > 0 {
			diff = img.Layers[len(img.Layers)-1]
			break
		}
	}
	s.mu.Unlock()
	if diff == "" {
		return "", 0, false
	}
	size, ok := s.haveLayer(diff)
	return diff, size, ok
}

// lockFile takes an exclusive flock on path, waiting for it.
func lockFile(path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
}

func findBusybox() (string, error) {
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			if static, _ := isStatic(p); static {
				return p, nil
			}
		}
	}
	return "", errdefs.Unavailable("no static busybox on this host (install Debian's busybox-static)")
}

// isStatic reports whether an ELF file has no program interpreter.
func isStatic(p string) (bool, error) {
	f, err := elf.Open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return false, nil
		}
	}
	return true, nil
}

func fileDigest(p string) string {
	f, err := os.Open(p)
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	h := sha256.New()
	io.Copy(h, f)
	return hex.EncodeToString(h.Sum(nil))[:12]
}

func buildBusybox(bb, dir string) error {
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "home", "proc", "sys", "dev", "var/tmp", "run"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(dir, "tmp"), 0o1777)
	os.Chmod(filepath.Join(dir, "var/tmp"), 0o1777)
	os.Chmod(filepath.Join(dir, "root"), 0o700)
	data, err := os.ReadFile(bb)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "bin/busybox"), data, 0o755); err != nil {
		return err
	}
	out, err := exec.Command(bb, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("list busybox applets: %w", err)
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "bin/busybox" {
			continue
		}
		dst := filepath.Join(dir, applet)
		os.MkdirAll(filepath.Dir(dst), 0o755)
		rel, _ := filepath.Rel(filepath.Dir(dst), filepath.Join(dir, "bin/busybox"))
		os.Remove(dst)
		if err := os.Symlink(rel, dst); err != nil {
			return err
		}
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":    "root:x:0:\nnogroup:x:65534:\n",
		"etc/hostname": "sandbox\n",
		"etc/hosts":    "127.0.0.1 localhost\n::1 localhost\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// buildDebian debootstraps suite from mirror into dir with pkgs.
func buildDebian(ctx context.Context, dir, mirror, suite string, pkgs []string, progress Progress) error {
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return errdefs.Unavailable("debootstrap is not installed (apt-get install debootstrap)")
	}
	// debootstrap runs dpkg in the new root, which reads its
	// configuration from there: put unsafeIO in place first.
	undo, err := unsafeIO(dir)
	if err != nil {
		return err
	}
	defer undo()
	cmd := exec.CommandContext(ctx, "debootstrap", "--variant=minbase", "--include="+strings.Join(pkgs, ","), suite, dir, mirror)
	if err := runLogged(cmd, progress); err != nil {
		return errdefs.Unavailable("debootstrap %s from %s: %v", suite, mirror, err)
	}
	// Leave a clean image: no package caches, no host identity.
	cleanInstall(dir)
	os.WriteFile(filepath.Join(dir, "etc/resolv.conf"), nil, 0o644)
	os.WriteFile(filepath.Join(dir, "etc/hostname"), []byte("sandbox\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "etc/apt/sources.list"), []byte(fmt.Sprintf("deb %s %s main\n", mirror, suite)), 0o644)
	return nil
}

// addBaseUser finishes the "base" recipe's layer in root (the merged tree
// of overlayBuild, its packages installed): the user BaseUser (uid and gid
// BaseUID, home /home/user, bash, in the sudo group) and a sudoers entry
// that lets it run anything as anyone without a password. sudo is setuid
// root: it elevates only in sandboxes of images with
// Config.PrivilegeEscalation, which this recipe's has.
func addBaseUser(ctx context.Context, root string, progress Progress) error {
	uid := fmt.Sprint(BaseUID)
	useradd := exec.CommandContext(ctx, "chroot", root, "useradd", "--create-home", "--uid", uid, "--user-group",
		"--groups", "sudo", "--shell", "/bin/bash", BaseUser)
	if err := runLogged(useradd, progress); err != nil {
		return fmt.Errorf("add the user %s: %w", BaseUser, err)
	}
	sudoers := filepath.Join(root, "etc/sudoers.d", BaseUser)
	if err := os.WriteFile(sudoers, []byte(BaseUser+" ALL=(ALL:ALL) NOPASSWD: ALL\n"), 0o440); err != nil {
		return err
	}
	if err := os.Chmod(sudoers, 0o440); err != nil { // whatever the umask
		return err
	}
	if err := runLogged(exec.CommandContext(ctx, "chroot", root, "visudo", "--check", "--strict"), progress); err != nil {
		return fmt.Errorf("check the sudoers entry: %w", err)
	}
	return nil
}

// overlayBuild builds a layer into upper, an overlayfs upper directory
// over the root filesystem lower: build changes the merged tree (mounted
// for its time), then what an install leaves behind that an image does not
// need is removed (the lower root filesystem has none of it either, so
// nothing becomes a whiteout), as are the host's resolver configuration
// and the sources.list that aptInstall put there (the lower's show
// through).
func overlayBuild(lower, upper string, build func(merged string) error) (err error) {
	work, merged := upper+".work", upper+".merged"
	for _, d := range []string{work, merged} {
		os.RemoveAll(d)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		defer os.RemoveAll(d)
	}
	if err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work); err != nil {
		return fmt.Errorf("mount the root filesystem under the new layer: %w", err)
	}
	mounted := true
	defer func() {
		if mounted {
			unix.Unmount(merged, unix.MNT_DETACH)
		}
	}()
	if err := build(merged); err != nil {
		return err
	}
	cleanInstall(merged)
	if err := unix.Unmount(merged, 0); err != nil {
		return fmt.Errorf("unmount the new layer: %w", err)
	}
	mounted = false
	os.Remove(filepath.Join(upper, "etc/resolv.conf"))
	os.Remove(filepath.Join(upper, "etc/apt/sources.list"))
	return nil
}

// cleanInstall removes from the root filesystem dir what package installs
// leave that an image does not need: downloaded packages, apt's lists,
// logs.
func cleanInstall(dir string) {
	for _, p := range []string{"var/cache/apt/archives", "var/lib/apt/lists", "var/log"} {
		ents, _ := os.ReadDir(filepath.Join(dir, p))
		for _, e := range ents {
			if name := e.Name(); name != "partial" && name != "lock" {
				os.RemoveAll(filepath.Join(dir, p, name))
			}
		}
	}
}

// unsafeIO makes dpkg in the root filesystem dir write files without
// syncing each one (dpkg's force-unsafe-io): a build is thrown away if it
// fails, and the finished one is synced once (syncFS) before it is marked
// complete. undo removes the setting, so images do not keep it.
func unsafeIO(dir string) (undo func(), err error) {
	p := filepath.Join(dir, "etc/dpkg/dpkg.cfg.d/dsec-build-unsafe-io")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(p, []byte("# written by dsec for the time of an image build\nforce-unsafe-io\n"), 0o644); err != nil {
		return nil, err
	}
	return func() { os.Remove(p) }, nil
}

// syncFS flushes the file system that holds dir to its disk.
func syncFS(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// runLogged runs cmd, reporting its output lines as progress; an error
// carries the last 20 lines.
func runLogged(cmd *exec.Cmd, progress Progress) error {
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return err
	}
	var tail []string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		tail = append(tail, line)
		if len(tail) > 20 {
			tail = tail[1:]
		}
		progress.report("build", line, 0, 0)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("%v\n%s", err, strings.Join(tail, "\n"))
	}
	return nil
}

// aptInstall installs pkgs (without recommends) in the root filesystem dir
// from mirror, with apt-get in a chroot: /proc is mounted there and the
// host's resolver configuration copied in for the time of the install
// (the caller runs in a private mount namespace, like every dsec process
// that builds images).
func aptInstall(ctx context.Context, dir, mirror, suite string, pkgs []string, progress Progress) error {
	if err := os.WriteFile(filepath.Join(dir, "etc/apt/sources.list"), []byte(fmt.Sprintf("deb %s %s main\n", mirror, suite)), 0o644); err != nil {
		return err
	}
	// The host's resolver configuration, for the time of the install;
	// then the root filesystem's own again (a file, a link or nothing).
	resolv := filepath.Join(dir, "etc/resolv.conf")
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		restore := func() { os.Remove(resolv) }
		if fi, err := os.Lstat(resolv); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			target, _ := os.Readlink(resolv)
			restore = func() { os.Remove(resolv); os.Symlink(target, resolv) }
		} else if before, err := os.ReadFile(resolv); err == nil {
			restore = func() { os.WriteFile(resolv, before, fi.Mode().Perm()) }
		}
		// Removed first: an absolute link would write through to the host's.
		os.Remove(resolv)
		os.WriteFile(resolv, b, 0o644)
		defer restore()
	}
	undo, err := unsafeIO(dir)
	if err != nil {
		return err
	}
	defer undo()
	proc := filepath.Join(dir, "proc")
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc for apt-get: %w", err)
	}
	defer unix.Unmount(proc, unix.MNT_DETACH)
	// Services must not start in the chroot.
	policy := filepath.Join(dir, "usr/sbin/policy-rc.d")
	os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755)
	defer os.Remove(policy)
	for _, args := range [][]string{
		{"apt-get", "update", "-q"},
		append([]string{"apt-get", "install", "-y", "-q", "--no-install-recommends"}, pkgs...),
		{"apt-get", "clean"},
	} {
		cmd := exec.CommandContext(ctx, "chroot", append([]string{dir}, args...)...)
		if err := runLogged(cmd, progress); err != nil {
			return errdefs.Unavailable("%s in the image: %v", strings.Join(args[:2], " "), err)
		}
	}
	return nil
}

// hostAptSource returns the host's Debian/Ubuntu mirror and release.
func hostAptSource() (mirror, suite string, err error) {
	codename := osRelease("VERSION_CODENAME")
	type src struct{ uri, suite string }
	var srcs []src
	if b, err := os.ReadFile("/etc/apt/sources.list"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(strings.TrimSpace(line))
			if len(f) >= 3 && f[0] == "deb" {
				i := 1
				if strings.HasPrefix(f[1], "[") {
					for i < len(f) && !strings.HasSuffix(f[i], "]") {
						i++
					}
					i++
				}
				if i+1 < len(f) {
					srcs = append(srcs, src{f[i], f[i+1]})
				}
			}
		}
	}
	files, _ := filepath.Glob("/etc/apt/sources.list.d/*.sources")
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		for _, stanza := range strings.Split(string(b), "\n\n") {
			fields := map[string]string{}
			for _, line := range strings.Split(stanza, "\n") {
				if k, v, ok := strings.Cut(line, ":"); ok && !strings.HasPrefix(line, "#") {
					fields[strings.TrimSpace(k)] = strings.TrimSpace(v)
				}
			}
			if !strings.Contains(" "+fields["Types"]+" ", " deb ") {
				continue
			}
			for _, u := range strings.Fields(fields["URIs"]) {
				for _, su := range strings.Fields(fields["Suites"]) {
					srcs = append(srcs, src{u, su})
				}
			}
		}
	}
	for _, s := range srcs {
		if s.suite == codename && (strings.Contains(s.uri, "debian") || strings.Contains(s.uri, "ubuntu")) {
			return s.uri, s.suite, nil
		}
	}
	for _, s := range srcs {
		if s.suite == codename {
			return s.uri, s.suite, nil
		}
	}
	return "", "", errdefs.Unavailable("no apt source for this host's release %q in /etc/apt", codename)
}

func osRelease(key string) string {
	b, _ := os.ReadFile("/etc/os-release")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+"="); ok {
			return strings.Trim(v, `"`)
		}
	}
	return ""
}

// tarDir writes dir as an uncompressed tar stream with owners, modes,
// hard links, devices and file capabilities, in a stable order.
func tarDir(dir string, w io.Writer) error { return writeTar(dir, w, false, IDShift{}) }

// TarOverlayUpper writes an overlayfs upper directory as an OCI layer: a
// whiteout device becomes a ".wh.<name>" entry and an opaque directory gets
// a ".wh..wh..opq" entry. The directory must not change meanwhile (the
// sandbox is frozen).
//
// ids says which host ids the directory's files are owned by: a sandbox
// in a user namespace writes files owned by its range of host ids, and a
// layer keeps them as the sandbox saw them (its root is 0), so any other
// sandbox, whatever its range, can start from it.
func TarOverlayUpper(dir string, w io.Writer, ids IDShift) error { return writeTar(dir, w, true, ids) }

// IDShift maps the host ids From..From+Size-1 to 0..Size-1; other ids
// become 65534 (nobody). The zero value maps every id to itself.
type IDShift struct {
	From, Size uint32
}

func (s IDShift) id(host int) int {
	if s.Size == 0 {
		return host
	}
	if h := uint32(host); h >= s.From && h-s.From < s.Size {
		return int(h - s.From)
	}
	return 65534
}

// capability rewrites a file capability xattr for a shifted layer: a
// version 3 capability names the host id of the root it applies to
// (written from a user namespace), which the layer stores as version 2
// (any root) when it is the range's.
func (s IDShift) capability(v []byte) []byte {
	const v3, v2, v3Size, v2Size = 0x03000000, 0x02000000, 24, 20
	if s.Size == 0 || len(v) != v3Size {
		return v
	}
	le := func(b []byte) uint32 { return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24 }
	if le(v)&0xff000000 != v3 {
		return v
	}
	if root := le(v[20:]); root != s.From {
		return v
	}
	out := append([]byte(nil), v[:v2Size]...)
	magic := le(out)&^0xff000000 | v2
	out[0], out[1], out[2], out[3] = byte(magic), byte(magic>>8), byte(magic>>16), byte(magic>>24)
	return out
}

func writeTar(dir string, w io.Writer, overlay bool, ids IDShift) error {
	tw := tar.NewWriter(w)
	links := map[[2]uint64]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Mode()&fs.ModeSocket != 0 {
			return nil
		}
		if overlay {
			st := info.Sys().(*syscall.Stat_t)
			if info.Mode()&fs.ModeCharDevice != 0 && st.Rdev == 0 {
				return tw.WriteHeader(&tar.Header{
					Name:     filepath.ToSlash(filepath.Join(filepath.Dir(rel), whiteoutPrefix+filepath.Base(rel))),
					Typeflag: tar.TypeReg, Mode: 0o600, Format: tar.FormatPAX,
				})
			}
		}
		target := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			target, _ = os.Readlink(p)
		}
		hdr, err := tar.FileInfoHeader(info, target)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if info.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		hdr.Uid, hdr.Gid = ids.id(hdr.Uid), ids.id(hdr.Gid)
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		hdr.Format = tar.FormatPAX
		st := info.Sys().(*syscall.Stat_t)
		if info.Mode().IsRegular() && st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := links[key]; ok {
				hdr.Typeflag = tar.TypeLink
				hdr.Linkname = first
				hdr.Size = 0
			} else {
				links[key] = hdr.Name
			}
		}
		if info.Mode().IsRegular() {
			if capab, err := getXattr(p, "security.capability"); err == nil && len(capab) > 0 {
				hdr.PAXRecords = map[string]string{"SCHILY.xattr.security.capability": string(ids.capability(capab))}
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if overlay && info.IsDir() {
			if v, err := getXattr(p, "trusted.overlay.opaque"); err == nil && string(v) == "y" {
				if err := tw.WriteHeader(&tar.Header{Name: hdr.Name + whiteoutOpaque, Typeflag: tar.TypeReg, Mode: 0o600, Format: tar.FormatPAX}); err != nil {
					return err
				}
			}
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func getXattr(p, name string) ([]byte, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}
