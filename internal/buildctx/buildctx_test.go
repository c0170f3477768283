package buildctx

import (
	"archive/tar"
	"bytes"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// writeTree creates files under root; a name ending in "/" is a directory,
// anything else a file whose content is its name.
func writeTree(t *testing.T, root string, names ...string) {
	t.Helper()
	for _, n := range names {
		p := filepath.Join(root, filepath.FromSlash(n))
		if strings.HasSuffix(n, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// tarEntry is a tar header with the content of a regular file.
type tarEntry struct {
	hdr  *tar.Header
	body string
}

// tarDir runs Tar on dir and returns its entries in archive order.
func tarDir(t *testing.T, dir string) ([]tarEntry, Stats) {
	t.Helper()
	var buf bytes.Buffer
	st, err := Tar(dir, &buf)
	if err != nil {
		t.Fatalf("Tar: %v", err)
	}
	var out []tarEntry
	tr := tar.NewReader(&buf)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out, st
		}
		if err != nil {
			t.Fatalf("read archive: %v", err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("read %s: %v", hdr.Name, err)
		}
		out = append(out, tarEntry{hdr, string(body)})
	}
}

func names(es []tarEntry) []string {
	var n []string
	for _, e := range es {
		n = append(n, e.hdr.Name)
	}
	return n
}

func TestTarWritesSortedEntriesWithHeaders(t *testing.T) {
	dir := t.TempDir()
	writeTree(t, dir, "b.txt", "a.txt", "a/z", "a/y/x", "c/")
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 987654321, time.UTC)
	if err := os.Chtimes(filepath.Join(dir, "b.txt"), mtime, mtime); err != nil {
		t.Fatal(err)
	}

	es, st := tarDir(t, dir)

	want := []string{"a/", "a/y/", "a/y/x", "a/z", "a.txt", "b.txt", "c/"}
	if got := names(es); !slices.Equal(got, want) {
		t.Fatalf("entries = %q, want %q", got, want)
	}
	wantStats := Stats{Files: 4, Dirs: 3, Bytes: int64(len("a/y/x") + len("a/z") + len("a.txt") + len("b.txt"))}
	if st != wantStats {
		t.Errorf("stats = %+v, want %+v", st, wantStats)
	}
	for _, e := range es {
		h := e.hdr
		if h.Uname != "" || h.Gname != "" || h.Uid != os.Getuid() || h.Gid != os.Getgid() {
			t.Errorf("%s: owner %d:%d %q:%q, want %d:%d with no names", h.Name, h.Uid, h.Gid, h.Uname, h.Gname, os.Getuid(), os.Getgid())
		}
		if !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() {
			t.Errorf("%s: atime %v ctime %v, want neither", h.Name, h.AccessTime, h.ChangeTime)
		}
		if h.Typeflag == tar.TypeReg && e.body != h.Name {
			t.Errorf("%s: content %q, want %q", h.Name, e.body, h.Name)
		}
	}
	if got := es[5].hdr.ModTime; !got.Equal(mtime.Truncate(time.Second)) {
		t.Errorf("b.txt mtime = %v, want %v", got, mtime.Truncate(time.Second))
	}
}

func TestTarKeepsSymlinksAsLinks(t *testing.T) {
	outside := t.TempDir()
	writeTree(t, outside, "secret")
	dir := t.TempDir()
	writeTree(t, dir, "sub/f")
	links := map[string]string{
		"abs": outside,        // a directory outside the context
		"rel": "../../secret", // a relative path out of the context
		"in":  "sub",          // a directory inside the context
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}

	es, st := tarDir(t, dir)

	want := []string{"abs", "in", "rel", "sub/", "sub/f"}
	if got := names(es); !slices.Equal(got, want) {
		t.Fatalf("entries = %q, want %q", got, want)
	}
	for _, e := range es[:3] {
		if e.hdr.Typeflag != tar.TypeSymlink || e.hdr.Linkname != links[e.hdr.Name] || e.hdr.Size != 0 {
			t.Errorf("%s: type %c link %q size %d, want a symlink to %q", e.hdr.Name, e.hdr.Typeflag, e.hdr.Linkname, e.hdr.Size, links[e.hdr.Name])
		}
	}
	if want := (Stats{Files: 1, Dirs: 1, Symlinks: 3, Bytes: int64(len("sub/f"))}); st != want {
		t.Errorf("stats = %+v, want %+v", st, want)
	}
}

func TestTarKeepsModeBits(t *testing.T) {
	dir := t.TempDir()
	modes := map[string]os.FileMode{
		"private":  0o600,
		"setuid":   0o755 | os.ModeSetuid,
		"setgid":   0o750 | os.ModeSetgid,
		"sticky/":  0o777 | os.ModeSticky | os.ModeDir,
		"readonly": 0o444,
	}
	want := map[string]int64{"private": 0o600, "setuid": 0o4755, "setgid": 0o2750, "sticky/": 0o1777, "readonly": 0o444}
	for name, mode := range modes {
		writeTree(t, dir, name)
		if err := os.Chmod(filepath.Join(dir, name), mode); err != nil {
			t.Fatal(err)
		}
	}

	es, _ := tarDir(t, dir)

	if len(es) != len(want) {
		t.Fatalf("entries = %q, want %d", names(es), len(want))
	}
	for _, e := range es {
		if got := e.hdr.Mode & 0o7777; got != want[e.hdr.Name] {
			t.Errorf("%s: mode %#o, want %#o", e.hdr.Name, got, want[e.hdr.Name])
		}
	}
}

func TestTarSkipsSocketsAndFifos(t *testing.T) {
	dir := t.TempDir()
	writeTree(t, dir, "f")
	l, err := net.Listen("unix", filepath.Join(dir, "sock"))
	if err != nil {
		t.Fatalf("listen on a unix socket: %v", err)
	}
	defer l.Close()
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}

	es, st := tarDir(t, dir)

	if got := names(es); !slices.Equal(got, []string{"f"}) {
		t.Errorf("entries = %q, want only f", got)
	}
	if want := (Stats{Files: 1, Skipped: 2, Bytes: 1}); st != want {
		t.Errorf("stats = %+v, want %+v", st, want)
	}
}

// context is the tree the .dockerignore cases run against, and every entry
// Tar sends for it when nothing is excluded.
var context = []string{
	".dockerignore",
	"CHANGES.md",
	"Dockerfile",
	"README.md",
	"build/", "build/out",
	"docs/", "docs/guide.md", "docs/img/", "docs/img/logo.png", "docs/keep.txt",
	"foo/", "foo/bar/", "foo/bar/baz",
	"node_modules/", "node_modules/x.js",
	"src/", "src/build/", "src/build/gen.go", "src/main.go",
	"web/", "web/app.js", "web/node_modules/", "web/node_modules/y.js",
}

// contextWithout returns context less the given entries, each of which must
// be in it.
func contextWithout(t *testing.T, drop ...string) []string {
	t.Helper()
	for _, d := range drop {
		if !slices.Contains(context, d) {
			t.Fatalf("%q is not in the test context", d)
		}
	}
	return slices.DeleteFunc(slices.Clone(context), func(n string) bool { return slices.Contains(drop, n) })
}

func TestTarHonoursDockerignore(t *testing.T) {
	docs := []string{"docs/", "docs/guide.md", "docs/img/", "docs/img/logo.png", "docs/keep.txt"}
	withoutDocs := func(t *testing.T, keep ...string) []string {
		var drop []string
		for _, d := range docs {
			if !slices.Contains(keep, d) {
				drop = append(drop, d)
			}
		}
		return contextWithout(t, drop...)
	}
	for _, tc := range []struct {
		name   string
		ignore string
		want   func(t *testing.T) []string
	}{
		{"comments and blank lines exclude nothing", "# docs\n\n   \n\t\n#build\n", func(t *testing.T) []string {
			return context
		}},
		{"a pattern of . is ignored", ".\n./\n", func(t *testing.T) []string {
			return context
		}},
		{"an exception re-includes a file a glob excluded", "*.md\n!README.md\n", func(t *testing.T) []string {
			return contextWithout(t, "CHANGES.md") // * does not cross "/": docs/guide.md stays
		}},
		{"**/node_modules excludes it at every depth", "**/node_modules\n", func(t *testing.T) []string {
			return contextWithout(t, "node_modules/", "node_modules/x.js", "web/node_modules/", "web/node_modules/y.js")
		}},
		{"/build names only the top-level build", "/build\n", func(t *testing.T) []string {
			return contextWithout(t, "build/", "build/out")
		}},
		{"build without a slash is also relative to the root", "  build  \n", func(t *testing.T) []string {
			return contextWithout(t, "build/", "build/out")
		}},
		{"**/build names build at every depth", "**/build\n", func(t *testing.T) []string {
			return contextWithout(t, "build/", "build/out", "src/build/", "src/build/gen.go")
		}},
		{"an exception inside an excluded directory sends the file and its parent", "docs\n!docs/keep.txt\n", func(t *testing.T) []string {
			return withoutDocs(t, "docs/", "docs/keep.txt")
		}},
		{"a wildcard exception inside an excluded directory sends every parent", "docs\n!**/logo.png\n", func(t *testing.T) []string {
			return withoutDocs(t, "docs/", "docs/img/", "docs/img/logo.png")
		}},
		{"an exception matching nothing sends no parent", "docs\n!docs/missing\n", func(t *testing.T) []string {
			return withoutDocs(t)
		}},
		{"the last matching pattern wins", "!docs/keep.txt\ndocs\n", func(t *testing.T) []string {
			return withoutDocs(t)
		}},
		{"a later exclusion overrides an exception", "*.md\n!README.md\nREADME.md\n", func(t *testing.T) []string {
			return contextWithout(t, "CHANGES.md", "README.md")
		}},
		{"a directory pattern excludes everything beneath it", "foo\n", func(t *testing.T) []string {
			return contextWithout(t, "foo/", "foo/bar/", "foo/bar/baz")
		}},
		{"a trailing ** keeps the directory itself", "docs/**\n", func(t *testing.T) []string {
			return withoutDocs(t, "docs/")
		}},
		{".dockerignore and Dockerfile can be excluded", ".dockerignore\n/Dockerfile\n", func(t *testing.T) []string {
			return contextWithout(t, ".dockerignore", "Dockerfile")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			writeTree(t, dir, context...)
			if err := os.WriteFile(filepath.Join(dir, ".dockerignore"), []byte(tc.ignore), 0o644); err != nil {
				t.Fatal(err)
			}
			es, _ := tarDir(t, dir)
			if got, want := names(es), tc.want(t); !slices.Equal(got, want) {
				t.Errorf("entries = %q\nwant      %q", got, want)
			}
		})
	}
}

func TestExcluded(t *testing.T) {
	for _, tc := range []struct {
		ignore string
		path   string
		want   bool
	}{
		{"foo", "foo/bar/baz", true},
		{"/foo", "foo/bar/baz", true},
		{"foo/", "foo", true},
		{"foo", "xfoo", false},
		{"foo/bar", "foo", false},
		{"*.go", "main.go", true},
		{"*.go", "cmd/main.go", false},
		{"*/*.go", "cmd/main.go", true},
		{"**/*.go", "main.go", true},
		{"**/*.go", "a/b/main.go", true},
		{"a/**/b", "a/b", true},
		{"a/**/b", "a/x/y/b", true},
		{"a/**/b", "a/x/y/c", false},
		{"a/**", "a", false},
		{"a/**", "a/x", true},
		{"**", "anything/at/all", true},
		{"fo?", "foo", true},
		{"[a-c]at", "bat", true},
		{"[a-c]at", "rat", false},
		{`\*`, "*", true},
		{`\*`, "x", false},
		{"../foo", "foo", false},
		{"a\n!a/b", "a/b/c", false},
		{"a\n!a/b", "a/c", true},
		{"!a/b\na", "a/b", true},
		{"#a", "#a", false},
		{" #a", "#a", true},
	} {
		t.Run(strings.ReplaceAll(tc.ignore, "\n", " then ")+" against "+tc.path, func(t *testing.T) {
			ig, err := ParseIgnore(strings.NewReader(tc.ignore))
			if err != nil {
				t.Fatal(err)
			}
			if got := ig.Excluded(tc.path, false); got != tc.want {
				t.Errorf("Excluded(%q) = %v, want %v", tc.path, got, tc.want)
			}
		})
	}
	t.Run("a nil Ignore excludes nothing", func(t *testing.T) {
		var ig *Ignore
		if ig.Excluded("foo", true) {
			t.Error("nil Ignore excluded foo")
		}
	})
}

func TestMayIncludeBelow(t *testing.T) {
	for _, tc := range []struct {
		ignore string
		dir    string
		want   bool
	}{
		{"docs", "docs", false},
		{"docs\n!docs/keep.txt", "docs", true},
		{"docs\n!docs/keep.txt", "other", false},
		{"docs\n!docs/*/x", "docs/img", true},
		{"docs\n!docs/img/x", "docs/other", false},
		{"docs\n!**/x", "docs/a/b", true},
		{"docs\n!d*/x", "docs", true},
		{"!docs\ndocs", "docs", false},
	} {
		t.Run(strings.ReplaceAll(tc.ignore, "\n", " then ")+" below "+tc.dir, func(t *testing.T) {
			ig, err := ParseIgnore(strings.NewReader(tc.ignore))
			if err != nil {
				t.Fatal(err)
			}
			if got := ig.mayIncludeBelow(tc.dir); got != tc.want {
				t.Errorf("mayIncludeBelow(%q) = %v, want %v", tc.dir, got, tc.want)
			}
		})
	}
}

func TestBadPatternsAreInvalid(t *testing.T) {
	for _, ignore := range []string{"[", "ok\nsrc/[a-", "!", "!  \n"} {
		t.Run(strings.TrimSpace(ignore), func(t *testing.T) {
			if _, err := ParseIgnore(strings.NewReader(ignore)); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Errorf("ParseIgnore(%q) = %v, want an invalid error", ignore, err)
			}
		})
	}
	t.Run("Tar refuses a context whose .dockerignore is bad", func(t *testing.T) {
		dir := t.TempDir()
		writeTree(t, dir, "f")
		if err := os.WriteFile(filepath.Join(dir, ".dockerignore"), []byte("[\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := Tar(dir, io.Discard); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("Tar = %v, want an invalid error", err)
		}
	})
}

func TestTarErrors(t *testing.T) {
	t.Run("a context that is a file is invalid", func(t *testing.T) {
		dir := t.TempDir()
		writeTree(t, dir, "f")
		if _, err := Tar(filepath.Join(dir, "f"), io.Discard); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("Tar = %v, want an invalid error", err)
		}
	})
	t.Run("an unreadable file fails naming its path", func(t *testing.T) {
		dir := t.TempDir()
		writeTree(t, dir, "sub/secret")
		if err := os.Chmod(filepath.Join(dir, "sub", "secret"), 0); err != nil {
			t.Fatal(err)
		}
		var err error
		withModesEnforced(t, func() { _, err = Tar(dir, io.Discard) })
		if err == nil || !strings.Contains(err.Error(), "sub/secret") {
			t.Errorf("Tar = %v, want an error naming sub/secret", err)
		}
	})
	t.Run("an excluded directory without exceptions is not read", func(t *testing.T) {
		dir := t.TempDir()
		writeTree(t, dir, "cache/locked/f", "keep")
		locked := filepath.Join(dir, "cache", "locked")
		if err := os.Chmod(locked, 0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod(locked, 0o755) })
		if err := os.WriteFile(filepath.Join(dir, ".dockerignore"), []byte("cache\n!keep\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		var err error
		withModesEnforced(t, func() { _, err = Tar(dir, &buf) })
		if err != nil {
			t.Fatalf("Tar read the excluded directory: %v", err)
		}
		var got []string
		for tr := tar.NewReader(&buf); ; {
			hdr, err := tr.Next()
			if err != nil {
				break
			}
			got = append(got, hdr.Name)
		}
		if want := []string{".dockerignore", "keep"}; !slices.Equal(got, want) {
			t.Errorf("entries = %q, want %q", got, want)
		}
	})
}

// withModesEnforced runs f on a thread of its own on which file modes bind
// even root: a root caller's thread gives up CAP_DAC_OVERRIDE and
// CAP_DAC_READ_SEARCH (capabilities are per thread), so a file of mode 0
// refuses it as it refuses anyone. The thread ends with f.
func withModesEnforced(t *testing.T, f func()) {
	t.Helper()
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
		if os.Geteuid() == 0 {
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var data [2]unix.CapUserData
			if err = unix.Capget(&hdr, &data[0]); err != nil {
				return
			}
			for _, c := range []uint{unix.CAP_DAC_OVERRIDE, unix.CAP_DAC_READ_SEARCH} {
				data[c/32].Effective &^= 1 << (c % 32)
			}
			if err = unix.Capset(&hdr, &data[0]); err != nil {
				return
			}
		}
		f()
	}()
	<-done
	if err != nil {
		t.Fatalf("drop the thread's override of file modes: %v", err)
	}
}
