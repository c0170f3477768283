package node

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
)

// TestABuildContextPastItsLimitIsRefused: the reader a context upload is
// read through ends the extraction with errContextTooLarge past its limit
// and passes a context within it whole.
func TestABuildContextPastItsLimitIsRefused(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	body := strings.Repeat("x", 64<<10)
	for _, name := range []string{"a", "b", "c"} {
		// The caller's own ids: extraction sets owners, which only root
		// may set to another's.
		tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body)), Uid: os.Getuid(), Gid: os.Getgid()})
		tw.Write([]byte(body))
	}
	tw.Close()
	for _, tc := range []struct {
		name  string
		limit int64
		over  bool
	}{
		{"a context within the limit extracts whole", int64(buf.Len()), false},
		{"a context one file over the limit is refused", int64(2*len(body) + 2048), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := image.ExtractTar(&limitedReader{bytes.NewReader(buf.Bytes()), tc.limit}, t.TempDir())
			if tc.over {
				if !errors.Is(err, errContextTooLarge) || !errdefs.Is(errContextTooLarge, errdefs.KindInvalid) {
					t.Fatalf("got %v, want the context-too-large error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
