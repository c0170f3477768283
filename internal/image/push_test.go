package image

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestPushAndPullThroughARegistry: an image pushed to the distribution's
// registry (a real one, on loopback) pulls back into another store with
// the same files, whiteouts and configuration; a registry that
// authenticates refuses a push without the right password; what cannot be
// pushed says why.
func TestPushAndPullThroughARegistry(t *testing.T) {
	needRoot(t)
	ctx := tenant.System(context.Background())
	img := testImage(t)
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.Config.User = "1000:1000"
	cf.Config.Entrypoint = []string{"/bin/sh", "-c"}
	cf.Config.Cmd = []string{"echo hi"}
	cf.Config.Labels = map[string]string{"org.example.task": "push"}
	cf.Config.ExposedPorts = map[string]struct{}{"8080/tcp": {}}
	img, err := mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	src, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	rec, err := src.Import(ctx, "app", "test", img, nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := dsectest.StartRegistry(t, "", "")
	ref := reg.Host + "/team/app:1"

	var pushed string
	t.Run("an image pushed pulls back with its files, whiteouts and configuration", func(t *testing.T) {
		var phases []string
		pushed, err = src.Push(ctx, rec, ref, Auth{}, true, func(phase, msg string, done, total int64) { phases = append(phases, phase) })
		if err != nil {
			t.Fatal(err)
		}
		if len(phases) == 0 || phases[len(phases)-1] != "pushed" {
			t.Errorf("progress phases %q, want uploads then pushed", phases)
		}
		dst, err := Open(t.TempDir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		got, err := dst.Pull(ctx, ref, "app", Auth{}, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got.Digest != pushed {
			t.Errorf("pulled digest %s, pushed %s", got.Digest, pushed)
		}
		if !reflect.DeepEqual(got.Config, rec.Config) {
			t.Errorf("config after the round trip %+v, before %+v", got.Config, rec.Config)
		}
		if len(got.Layers) != 2 {
			t.Fatalf("layers %v", got.Layers)
		}
		for _, f := range []struct {
			layer      int
			name, body string
		}{{0, "a.txt", "one"}, {0, "gone.txt", "bye"}, {1, "b.txt", "two"}} {
			if b, err := os.ReadFile(filepath.Join(dst.LayerDir(got.Layers[f.layer]), f.name)); err != nil || string(b) != f.body {
				t.Errorf("layer %d %s: %q %v", f.layer, f.name, b, err)
			}
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(dst.LayerDir(got.Layers[1]), "gone.txt"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
			t.Errorf("the whiteout did not survive: %v %o", err, st.Mode)
		}
	})

	t.Run("a second push of the same image is the same manifest", func(t *testing.T) {
		again, err := src.Push(ctx, rec, reg.Host+"/team/app:2", Auth{}, true, nil)
		if err != nil || again != pushed {
			t.Fatalf("second push %s %v, first %s", again, err, pushed)
		}
	})

	t.Run("a registry that authenticates takes only its password", func(t *testing.T) {
		locked := dsectest.StartRegistry(t, "trainer", "s3cret-pass")
		ref := locked.Host + "/team/app:1"
		for _, a := range []Auth{{}, {Username: "trainer", Password: "wrong"}} {
			if _, err := src.Push(ctx, rec, ref, a, true, nil); !errdefs.Is(err, errdefs.KindPermissionDenied) {
				t.Fatalf("push as %q: %v, want permission denied", a.Username, err)
			}
		}
		auth := Auth{Username: "trainer", Password: "s3cret-pass"}
		if _, err := src.Push(ctx, rec, ref, auth, true, nil); err != nil {
			t.Fatal(err)
		}
		dst, _ := Open(t.TempDir(), slog.Default())
		if _, err := dst.Pull(ctx, ref, "app", Auth{}, true, nil); !errdefs.Is(err, errdefs.KindPermissionDenied) {
			t.Fatalf("an anonymous pull: %v, want permission denied", err)
		}
		if _, err := dst.Pull(ctx, ref, "app", auth, true, nil); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("what cannot be pushed says why", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gone := l.Addr().String()
		l.Close() // nothing listens there now
		for _, tc := range []struct {
			name string
			img  *Image
			ref  string
			kind errdefs.Kind
		}{
			{"a VM disk", &Image{Name: "disk", VM: &VMImage{}}, ref, errdefs.KindInvalid},
			{"a bad reference", rec, "Not A//Reference", errdefs.KindInvalid},
			{"a registry that is not there", rec, gone + "/team/app:1", errdefs.KindUnavailable},
		} {
			_, err := src.Push(ctx, tc.img, tc.ref, Auth{}, true, nil)
			if !errdefs.Is(err, tc.kind) {
				t.Errorf("%s: %v, want %s", tc.name, err, tc.kind)
			}
		}
	})
}

// TestARegistrysAnswerIsClassifiedByItsStatusNotItsText: the registry's
// address is in every error's text, and a port such as 40473 reads "404"
// (a connection refused there was reported as an image not found).
func TestARegistrysAnswerIsClassifiedByItsStatusNotItsText(t *testing.T) {
	refused := errors.New(`Get "https://127.0.0.1:40473/v2/": dial tcp 127.0.0.1:40473: connect: connection refused; Get "http://127.0.0.1:40123/v2/": dial tcp 127.0.0.1:40123: connect: connection refused`)
	for _, tc := range []struct {
		name string
		err  error
		kind errdefs.Kind
	}{
		{"connection refused at a port that reads 404 and 401", refused, errdefs.KindUnavailable},
		{"404", &transport.Error{StatusCode: http.StatusNotFound}, errdefs.KindNotFound},
		{"MANIFEST_UNKNOWN", fmt.Errorf("wrapped: %w", &transport.Error{StatusCode: http.StatusBadRequest, Errors: []transport.Diagnostic{{Code: transport.ManifestUnknownErrorCode}}}), errdefs.KindNotFound},
		{"401", &transport.Error{StatusCode: http.StatusUnauthorized}, errdefs.KindPermissionDenied},
		{"DENIED", &transport.Error{StatusCode: http.StatusBadRequest, Errors: []transport.Diagnostic{{Code: transport.DeniedErrorCode}}}, errdefs.KindPermissionDenied},
		{"500", &transport.Error{StatusCode: http.StatusInternalServerError}, errdefs.KindUnavailable},
	} {
		if err := classifyRemote("127.0.0.1:40473/team/app:1", tc.err); !errdefs.Is(err, tc.kind) {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.kind)
		}
	}
}
