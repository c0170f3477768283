package guest_test

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// TestHomePaths: "~" and "~/..." name the call user's home directory, from
// the passwd file of the agent's root (the host's here: root's is /root).
func TestHomePaths(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t.Run("a file call's ~ is the user's home directory", func(t *testing.T) {
		info, err := c.Stat(ctx, &guestv1.Path{Path: "~"})
		if err != nil || info.Path != "/root" || info.Type != "dir" {
			t.Fatalf("stat ~: %+v %v, want /root", info, err)
		}
		info, err = c.Stat(ctx, &guestv1.Path{Path: "~/../root/."})
		if err != nil || info.Path != "/root" {
			t.Fatalf("stat ~/../root/.: %+v %v, want /root", info, err)
		}
	})
	t.Run("a command's cwd ~ is the user's home directory", func(t *testing.T) {
		x := run(t, c, &guestv1.Exec{Argv: []string{"pwd"}, Cwd: "~", Collect: true})
		if string(x.Stdout) != "/root\n" {
			t.Fatalf("pwd in ~: %q", x.Stdout)
		}
	})
	t.Run("~name is refused, not taken for a file name", func(t *testing.T) {
		if _, err := c.Stat(ctx, &guestv1.Path{Path: "~root/x"}); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("stat ~root/x: %v, want invalid", err)
		}
		x, err := c.Run(ctx, &guestv1.Exec{Argv: []string{"true"}, Cwd: "~root", Collect: true})
		if err == nil && (x.ExitCode == 0 || !strings.Contains(x.Error+string(x.Stderr), "~name")) {
			t.Fatalf("a command started in ~root: %+v", x)
		}
	})
	t.Run("other relative paths are still refused", func(t *testing.T) {
		if _, err := c.Stat(ctx, &guestv1.Path{Path: "root"}); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("stat root: %v, want invalid", err)
		}
	})
}

// TestListingOrder: a listing is sorted by name, each directory followed by
// what it holds, as E2B's envd walks a tree.
func TestListingOrder(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	for _, d := range []string{"m/y", "m/b", "c"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	for _, f := range []string{"z.txt", "a.txt", "m/a.txt"} {
		os.WriteFile(filepath.Join(dir, f), nil, 0o644)
	}
	ents, err := c.ListDir(ctx, &guestv1.ListDir{Path: dir, Depth: 2})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, strings.TrimPrefix(e.Path, dir+"/"))
	}
	want := []string{"a.txt", "c", "m", "m/a.txt", "m/b", "m/y", "z.txt"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("listing %q, want %q", got, want)
	}
}

// TestSymlinkInfo: a symlink's info carries its own target as written and
// what it resolves to, followed to the end inside the root.
func TestSymlinkInfo(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "file.txt"), []byte("12345"), 0o640)
	os.Mkdir(filepath.Join(dir, "sub"), 0o750)
	os.Symlink("file.txt", filepath.Join(dir, "to-file"))
	os.Symlink("sub", filepath.Join(dir, "hop"))
	os.Symlink(filepath.Join(dir, "hop"), filepath.Join(dir, "to-dir"))
	os.Symlink("nowhere", filepath.Join(dir, "dangling"))
	os.Symlink("loop", filepath.Join(dir, "loop"))
	os.Symlink("/proc/self/cwd", filepath.Join(dir, "magic"))
	tests := []struct {
		name, link, raw string
		target          *guestv1.FileInfo // Path, Type, Mode, Size (files)
	}{
		{"a relative link to a file resolves to the file's absolute path", "to-file", "file.txt",
			&guestv1.FileInfo{Path: filepath.Join(dir, "file.txt"), Type: "file", Mode: 0o640, Size: 5}},
		{"a chain of links to a directory resolves to the directory", "to-dir", filepath.Join(dir, "hop"),
			&guestv1.FileInfo{Path: filepath.Join(dir, "sub"), Type: "dir", Mode: 0o750}},
		{"a dangling link resolves to nothing", "dangling", "nowhere", nil},
		{"a loop resolves to nothing", "loop", "loop", nil},
		{"a link through /proc's magic links (the agent's own files) resolves to nothing", "magic", "/proc/self/cwd", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			info, err := c.Stat(ctx, &guestv1.Path{Path: filepath.Join(dir, tt.link)})
			if err != nil {
				t.Fatal(err)
			}
			if info.Type != "symlink" || info.SymlinkTarget != tt.raw || info.Path != filepath.Join(dir, tt.link) {
				t.Fatalf("info %+v, want a symlink to %q", info, tt.raw)
			}
			got := info.Target
			switch {
			case tt.target == nil && got != nil:
				t.Fatalf("target %+v, want none", got)
			case tt.target == nil:
			case got == nil:
				t.Fatalf("no target, want %+v", tt.target)
			case got.Path != tt.target.Path || got.Type != tt.target.Type || got.Mode != tt.target.Mode || (got.Type == "file" && got.Size != tt.target.Size):
				t.Fatalf("target %+v, want %+v", got, tt.target)
			}
		})
	}
	t.Run("a listing resolves its links the same way", func(t *testing.T) {
		ents, err := c.ListDir(ctx, &guestv1.ListDir{Path: dir})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.Name == "to-dir" && (e.Target == nil || e.Target.Type != "dir") {
				t.Fatalf("listed %+v, want its target, a directory", e)
			}
		}
	})
}

// TestFileMetadata: metadata is the file's user.e2b.* extended attributes,
// written once the data is, read back by every call that describes the
// file, and replaced as a whole by the next write.
func TestFileMetadata(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	p := filepath.Join(dir, "doc.txt")
	write := func(t *testing.T, w *guestv1.WriteFile, data string) *guestv1.FileInfo {
		t.Helper()
		info, err := c.WriteFile(ctx, w, strings.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		return info
	}
	stat := func(t *testing.T) map[string]string {
		t.Helper()
		info, err := c.Stat(ctx, &guestv1.Path{Path: p})
		if err != nil {
			t.Fatal(err)
		}
		return info.Metadata
	}
	md := map[string]string{"author": "ada", "purpose": "test upload"}
	t.Run("a write stores the metadata and its info reports it", func(t *testing.T) {
		if got := write(t, &guestv1.WriteFile{Path: p, Metadata: md}, "one").Metadata; !reflect.DeepEqual(got, md) {
			t.Fatalf("write answered %v, want %v", got, md)
		}
		if got := stat(t); !reflect.DeepEqual(got, md) {
			t.Fatalf("stat %v, want %v", got, md)
		}
		if v, err := getxattr(p, "user.e2b.author"); err != nil || v != "ada" {
			t.Fatalf("the xattr user.e2b.author is %q (%v)", v, err)
		}
	})
	t.Run("a listing and a rename report it", func(t *testing.T) {
		ents, err := c.ListDir(ctx, &guestv1.ListDir{Path: dir})
		if err != nil || len(ents) != 1 || !reflect.DeepEqual(ents[0].Metadata, md) {
			t.Fatalf("listed %v %v", ents, err)
		}
		q := filepath.Join(dir, "moved.txt")
		info, err := c.Rename(ctx, &guestv1.Rename{From: p, To: q})
		if err != nil || !reflect.DeepEqual(info.Metadata, md) {
			t.Fatalf("renamed %+v %v", info, err)
		}
		c.Rename(ctx, &guestv1.Rename{From: q, To: p})
	})
	t.Run("an append without metadata keeps it", func(t *testing.T) {
		write(t, &guestv1.WriteFile{Path: p, Append: true}, " more")
		if got := stat(t); !reflect.DeepEqual(got, md) {
			t.Fatalf("after an append: %v, want %v", got, md)
		}
	})
	t.Run("an overwrite replaces it, keys not given are removed", func(t *testing.T) {
		next := map[string]string{"author": "grace"}
		write(t, &guestv1.WriteFile{Path: p, Metadata: next}, "two")
		if got := stat(t); !reflect.DeepEqual(got, next) {
			t.Fatalf("after the overwrite: %v, want %v", got, next)
		}
		if got := write(t, &guestv1.WriteFile{Path: p}, "three").Metadata; got != nil {
			t.Fatalf("an overwrite without metadata left %v", got)
		}
	})
	t.Run("attributes set inside the sandbox count, other user attributes do not", func(t *testing.T) {
		unix.Setxattr(p, "user.e2b.source", []byte("setfattr"), 0)
		unix.Setxattr(p, "user.other", []byte("x"), 0)
		if got := stat(t); !reflect.DeepEqual(got, map[string]string{"source": "setfattr"}) {
			t.Fatalf("stat %v, want source=setfattr only", got)
		}
	})
	t.Run("a directory has metadata too", func(t *testing.T) {
		unix.Setxattr(dir, "user.e2b.kind", []byte("folder"), 0)
		info, err := c.Stat(ctx, &guestv1.Path{Path: dir})
		if err != nil || info.Metadata["kind"] != "folder" {
			t.Fatalf("stat of the directory %+v %v", info, err)
		}
	})
	t.Run("bad metadata is refused before the file is made", func(t *testing.T) {
		for _, bad := range []map[string]string{{"": "v"}, {"k": "line\nbreak"}, {"k\x7f": "v"}, {"k": strings.Repeat("v", 5000)}} {
			q := filepath.Join(dir, "refused.txt")
			if _, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: q, Metadata: bad}, strings.NewReader("x")); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Fatalf("metadata %q: %v, want invalid", bad, err)
			}
			if _, err := os.Lstat(q); err == nil {
				t.Fatalf("metadata %q: the file was made", bad)
			}
		}
	})
}

func getxattr(p, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Getxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// TestWatchInfo: with include_info, events on entries that are there carry
// their info; a removal carries none.
func TestWatchInfo(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	w, err := c.Watch(ctx, &guestv1.Watch{Path: dir, IncludeInfo: true})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	p := filepath.Join(dir, "f.txt")
	os.WriteFile(p, []byte("abc"), 0o644)
	// The write's event first: the file is removed only once it was seen,
	// so the agent's stat of it cannot race the removal.
	next := func(op string) *guestv1.FsEvent {
		for {
			e, err := w.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if e.Op == op {
				return e
			}
		}
	}
	if e := next("write"); e.Info == nil || e.Info.Path != p || e.Info.Type != "file" {
		t.Fatalf("a write event carries %+v, want the file's info", e.Info)
	}
	os.Remove(p)
	if e := next("remove"); e.Info != nil {
		t.Fatalf("a removal carries %+v", e.Info)
	}
}

// TestMadeDirectoriesAreTheUsers: every directory a call makes, parents
// included, is its user's.
func TestMadeDirectoriesAreTheUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (acts as nobody)")
	}
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	os.Chmod(dir, 0o777)
	for d := filepath.Dir(dir); d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	deep := filepath.Join(dir, "a", "b", "c")
	if _, err := c.MakeDir(ctx, &guestv1.MakeDir{Path: deep, User: "nobody"}); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"a", "a/b", "a/b/c"} {
		info, err := c.Stat(ctx, &guestv1.Path{Path: filepath.Join(dir, d)})
		if err != nil || info.Owner != "nobody" || info.Mode != 0o755 {
			t.Fatalf("%s: %+v %v, want nobody's, mode 0755", d, info, err)
		}
	}
}
