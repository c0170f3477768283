package e2b

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

func TestVolumeMountsAtCreateAreReadWriteMounts(t *testing.T) {
	f := facade(t, Config{})
	spec, err := f.spec(&newSandbox{VolumeMounts: json.RawMessage(`[{"name":"data","path":"/mnt/data"},{"name":"vol-x","path":"/x"}]`)}, defaultTimeoutV2)
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Volumes) != 2 || spec.Volumes[0].Name != "data" || spec.Volumes[0].Path != "/mnt/data" || spec.Volumes[0].ReadOnly || spec.Volumes[1].Name != "vol-x" {
		t.Fatalf("volumes: %v", spec.Volumes)
	}
	if got := f.detailJSON(&dsecv1.Sandbox{Spec: spec, CreatedAt: timestamppb.Now(), ExpiresAt: timestamppb.Now()}, false).VolumeMounts; len(got) != 2 || got[0] != (volumeMountJSON{Name: "data", Path: "/mnt/data"}) {
		t.Fatalf("detail volumeMounts: %v", got)
	}
	if _, err := f.spec(&newSandbox{VolumeMounts: json.RawMessage(`{"name":"data"}`)}, defaultTimeoutV2); err == nil {
		t.Fatal("a volumeMounts that is not a list was accepted")
	}
}

func TestTheContentAPIWantsTheVolumesOwnToken(t *testing.T) {
	f := facade(t, Config{})
	mux := http.NewServeMux()
	f.Mount(mux.Handle)
	a, b := "vol-aaaaaaaaaaaaaaaa-local", "vol-bbbbbbbbbbbbbbbb-local"
	if f.VolumeToken(a) == f.VolumeToken(b) {
		t.Fatal("two volumes have one token")
	}
	for _, tc := range []struct{ name, volume, auth string }{
		{"no token", a, ""},
		{"another volume's token", a, "Bearer " + f.VolumeToken(b)},
		{"an envd access token", a, "Bearer " + f.AccessToken(a)},
		{"the token of a name, not an ID", "data", "Bearer " + f.VolumeToken("data")},
	} {
		t.Run(tc.name+" is unauthenticated", func(t *testing.T) {
			for _, op := range []string{"GET /file", "PUT /file", "GET /dir", "POST /dir", "GET /path", "PATCH /path", "DELETE /path"} {
				method, p, _ := strings.Cut(op, " ")
				req := httptest.NewRequest(method, "/volumecontent/"+tc.volume+p+"?path=/x", nil)
				if tc.auth != "" {
					req.Header.Set("Authorization", tc.auth)
				}
				rec := httptest.NewRecorder()
				mux.ServeHTTP(rec, req)
				if rec.Code != http.StatusUnauthorized {
					t.Errorf("%s: %d %s, want 401", op, rec.Code, rec.Body)
				}
			}
		})
	}
}

func TestVolumeEntriesHaveE2BsTypesAndPermissionBits(t *testing.T) {
	at := timestamppb.New(time.Unix(1700000000, 5))
	for typ, want := range map[string]string{"file": "file", "dir": "directory", "symlink": "symlink", "other": "unknown"} {
		e := volumeEntry(&dsecv1.VolumeFileInfo{Path: "/a", Name: "a", Type: typ, Mode: 0o644, Atime: at, Mtime: at, Ctime: at})
		if e.Type != want || e.Mode != 0o644 || e.Mtime != "2023-11-14T22:13:20.000000005Z" {
			t.Errorf("%s: %+v", typ, e)
		}
	}
}
