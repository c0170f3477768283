package e2b

import (
	"net/http"
	"reflect"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/e2b/filesystem"
)

func TestEnvdPath(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"a relative path is relative to the user's home", "a/b.txt", "~/a/b.txt"},
		{"a dot path too", "./a", "~/./a"},
		{"an absolute path stays", "/tmp/x", "/tmp/x"},
		{"a home path stays", "~/x", "~/x"},
		{"an empty path is the working directory, else the home", "", "."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := envdPath(tt.in); got != tt.want {
				t.Fatalf("envdPath(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

// TestSymlinkEntry: envd describes a symlink by what it resolves to (type,
// mode, metadata, and its absolute path as the target) and keeps only the
// link's own permission string; a dangling link has no type and itself as
// its target.
func TestSymlinkEntry(t *testing.T) {
	md := map[string]string{"k": "v"}
	tests := []struct {
		name   string
		info   *dsecv1.FileInfo
		typ    filesystem.FileType
		mode   uint32
		target string
		md     map[string]string
	}{
		{"a link to a file", &dsecv1.FileInfo{Type: "symlink", Path: "/home/u/l", Mode: 0o777, SymlinkTarget: "f",
			Target: &dsecv1.FileInfo{Type: "file", Path: "/home/u/f", Mode: 0o640, Metadata: md}},
			filesystem.FileType_FILE_TYPE_FILE, 0o640, "/home/u/f", md},
		{"a link to a directory", &dsecv1.FileInfo{Type: "symlink", Path: "/l", Mode: 0o777, SymlinkTarget: "/a/../d",
			Target: &dsecv1.FileInfo{Type: "dir", Path: "/d", Mode: 0o755}},
			filesystem.FileType_FILE_TYPE_DIRECTORY, 0o755, "/d", nil},
		{"a dangling link", &dsecv1.FileInfo{Type: "symlink", Path: "/l", Mode: 0o777, SymlinkTarget: "nowhere"},
			filesystem.FileType_FILE_TYPE_UNSPECIFIED, 0, "/l", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := entry(tt.info)
			if e.Type != tt.typ || e.Mode != tt.mode || e.GetSymlinkTarget() != tt.target || e.Permissions != "Lrwxrwxrwx" || !reflect.DeepEqual(e.Metadata, tt.md) || e.Path != tt.info.Path {
				t.Fatalf("entry %v", e)
			}
		})
	}
}

func TestUploadMetadata(t *testing.T) {
	h := http.Header{}
	h.Set("X-Metadata-Author", "ada")
	h["x-metadata-PURPOSE"] = []string{"test", "ignored"}
	h.Set("X-Other", "no")
	got := uploadMetadata(h)
	want := map[string]string{"author": "ada", "purpose": "test"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("metadata %v, want %v (keys lowercased, as envd)", got, want)
	}
	if uploadMetadata(http.Header{"X-Other": {"x"}}) != nil {
		t.Fatal("an upload without metadata headers has metadata")
	}
}
