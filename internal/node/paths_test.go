package node

import (
	"reflect"
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// TestRelativePaths: a relative path of a file call or a cwd resolves where
// a command without cwd starts: the sandbox's working directory, else the
// user's home ("~" names it in any case). The fake runs every call as root,
// whose home in busybox is /root.
func TestRelativePaths(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	plain := tn.create(bg, nil).Id
	withWorkdir := tn.create(bg, &dsecv1.SandboxSpec{Workdir: "/tmp"}).Id
	write := func(t *testing.T, id, p string) string {
		t.Helper()
		info, err := tn.WriteFile(bg, &dsecv1.WriteFileHeader{SandboxId: id, Path: p}, strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		return info.Path
	}
	tests := []struct {
		name, id, path, want string
	}{
		{"without a working directory a relative path is in the user's home", plain, "notes/a.txt", "/root/notes/a.txt"},
		{"with one it is in the working directory", withWorkdir, "notes/a.txt", "/tmp/notes/a.txt"},
		{"~ is the user's home whatever the working directory", withWorkdir, "~/b.txt", "/root/b.txt"},
		{"an absolute path stays", withWorkdir, "/var/c.txt", "/var/c.txt"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := write(t, tt.id, tt.path); got != tt.want {
				t.Fatalf("wrote %s, want %s", got, tt.want)
			}
		})
	}
	t.Run("a command without cwd finds a file written by relative path", func(t *testing.T) {
		if got := tn.sh(bg, plain, "cat notes/a.txt"); got != "x" {
			t.Fatalf("cat: %q", got)
		}
	})
	t.Run("a relative cwd resolves the same way", func(t *testing.T) {
		for id, want := range map[string]string{plain: "/root/notes\n", withWorkdir: "/tmp/notes\n"} {
			r, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"pwd"}, Cwd: "notes"})
			if err != nil || string(r.Stdout) != want {
				t.Fatalf("pwd: %v %v, want %q", r, err, want)
			}
		}
	})
	t.Run("stat, list, rename and remove take relative paths too", func(t *testing.T) {
		if info, err := tn.Stat(bg, &dsecv1.StatRequest{SandboxId: plain, Path: "notes"}); err != nil || info.Path != "/root/notes" {
			t.Fatalf("stat: %v %v", info, err)
		}
		if info, err := tn.Rename(bg, &dsecv1.RenameRequest{SandboxId: plain, From: "notes/a.txt", To: "~/notes/b.txt"}); err != nil || info.Path != "/root/notes/b.txt" {
			t.Fatalf("rename: %v %v", info, err)
		}
		if l, err := tn.ListDir(bg, &dsecv1.ListDirRequest{SandboxId: plain, Path: "notes"}); err != nil || len(l.Entries) != 1 || l.Entries[0].Path != "/root/notes/b.txt" {
			t.Fatalf("list: %v %v", l, err)
		}
		if err := tn.Remove(bg, &dsecv1.RemoveRequest{SandboxId: plain, Path: "notes", Recursive: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := tn.Stat(bg, &dsecv1.StatRequest{SandboxId: plain, Path: "/root/notes"}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("after the removal: %v", err)
		}
	})
}

// TestWriteMetadata: a write's metadata reaches the file, is logged with
// the write and replayed with it.
func TestWriteMetadata(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	id := tn.create(bg, nil).Id
	md := map[string]string{"author": "ada"}
	info, err := tn.WriteFile(bg, &dsecv1.WriteFileHeader{SandboxId: id, Path: "/tmp/m.txt", Metadata: md}, strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(info.Metadata, md) {
		t.Fatalf("the write answered metadata %v, want %v", info.Metadata, md)
	}
	t.Run("bad metadata is invalid", func(t *testing.T) {
		_, err := tn.WriteFile(bg, &dsecv1.WriteFileHeader{SandboxId: id, Path: "/tmp/bad.txt", Metadata: map[string]string{"k": "a\nb"}}, strings.NewReader("x"))
		if !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("got %v, want invalid", err)
		}
	})
	t.Run("the log keeps it and a replay restores it", func(t *testing.T) {
		log, err := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
		if err != nil {
			t.Fatal(err)
		}
		if e := log.Entries[len(log.Entries)-1]; e.Op != "write_file" || !reflect.DeepEqual(e.Metadata, md) {
			t.Fatalf("logged %v", e)
		}
		r, err := tn.Replay(bg, &dsecv1.ReplayRequest{SandboxId: id, Keep: true})
		if err != nil || r.Diverged != 0 {
			t.Fatalf("replay: %v %v", r, err)
		}
		got, err := tn.Stat(bg, &dsecv1.StatRequest{SandboxId: r.SandboxId, Path: "/tmp/m.txt"})
		if err != nil || !reflect.DeepEqual(got.Metadata, md) {
			t.Fatalf("replayed file: %v %v", got, err)
		}
	})
}
