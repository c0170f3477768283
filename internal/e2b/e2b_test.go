package e2b

import (
	"crypto/sha256"
	"encoding/base64"
	"io"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/e2b/filesystem"
	"github.com/opendsec/dsec/internal/apiserver"
)

func facade(t *testing.T, cfg Config) *Facade {
	t.Helper()
	cfg.TokenSecret = []byte("0123456789abcdef0123456789abcdef")
	f, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), apiserver.Single{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestTemplates(t *testing.T) {
	f := facade(t, Config{Templates: map[string]Template{
		"base":  {Image: "debian"},
		"big":   {Image: "debian", CPU: 2, MemoryMB: 4096},
		"ubuvm": {Image: "ubuntu", Kind: "vm"},
	}})
	tests := []struct {
		name, template   string
		kind, image      string
		cpu              float64
		memoryMB, ttlS   int64
		timeout          *int64
		internetAccess   *bool
		network, wantErr string
	}{
		{name: "no template is base", template: "", kind: "container", image: "debian", ttlS: 300, network: "none"},
		{name: "a configured template maps to its image and resources", template: "big", kind: "container", image: "debian", cpu: 2, memoryMB: 4096, ttlS: 300, network: "none"},
		{name: "a configured template may set the kind", template: "ubuvm", kind: "vm", image: "ubuntu", ttlS: 300, network: "none"},
		{name: "a kind prefix selects the kind of a configured template", template: "microvm/base", kind: "microvm", image: "debian", ttlS: 300, network: "none"},
		{name: "a kind prefix overrides the template's kind", template: "container/ubuvm", kind: "container", image: "ubuntu", ttlS: 300, network: "none"},
		{name: "an unlisted template names an image", template: "python-3.12", kind: "container", image: "python-3.12", ttlS: 300, network: "none"},
		{name: "an unknown prefix is part of the image name", template: "ghcr.io/org/img", kind: "container", image: "ghcr.io/org/img", ttlS: 300, network: "none"},
		{name: "timeout is the TTL", template: "base", kind: "container", image: "debian", ttlS: 42, timeout: ptr[int64](42), network: "none"},
		{name: "internet access is egress", template: "base", kind: "container", image: "debian", ttlS: 300, internetAccess: ptr(true), network: "egress"},
		{name: "a zero timeout is refused", template: "base", timeout: ptr[int64](0), wantErr: "timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec, err := f.spec(&newSandbox{TemplateID: tt.template, Timeout: tt.timeout, AllowInternetAccess: tt.internetAccess}, defaultTimeoutV2)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %v, want an error about %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if spec.Kind != tt.kind || spec.Image != tt.image || spec.Resources.Cpu != tt.cpu || spec.Resources.MemoryMb != tt.memoryMB || spec.TtlS != tt.ttlS || spec.Network.Mode != tt.network {
				t.Fatalf("got kind %q image %q cpu %g mem %d ttl %d net %q", spec.Kind, spec.Image, spec.Resources.Cpu, spec.Resources.MemoryMb, spec.TtlS, spec.Network.Mode)
			}
			if tpl := spec.Labels[templateLabel]; tpl != tt.template && !(tt.template == "" && tpl == "base") {
				t.Fatalf("template label %q, want %q", tpl, tt.template)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

func TestMetadataSurvivesLabels(t *testing.T) {
	f := facade(t, Config{})
	md := map[string]string{"job": "a", "team/name": "b", "free form key": "x=1, y", "Ümlaut": "ü"}
	spec, err := f.spec(&newSandbox{Metadata: md}, defaultTimeoutV2)
	if err != nil {
		t.Fatal(err)
	}
	if spec.Labels["job"] != "a" || spec.Labels["team/name"] != "b" {
		t.Fatalf("label-shaped metadata must be labels: %v", spec.Labels)
	}
	got := metadata(spec.Labels)
	if len(got) != len(md) {
		t.Fatalf("metadata round trip: got %v, want %v", got, md)
	}
	for k, v := range md {
		if got[k] != v {
			t.Fatalf("metadata round trip: got %v, want %v", got, md)
		}
	}
	if _, err := f.spec(&newSandbox{Metadata: map[string]string{"odd key": strings.Repeat("v", 2000)}}, defaultTimeoutV2); err == nil {
		t.Fatal("metadata that does not fit a label was accepted")
	}
}

func TestParseHost(t *testing.T) {
	tests := []struct {
		name, domain, host string
		port               int
		id                 string
		ok                 bool
	}{
		{"port and ID from the first label", "", "49983-abcdefghijklmnop-local.sandbox.example", 49983, "abcdefghijklmnop-local", true},
		{"a host port is ignored", "e2b.test", "49999-abc-n1.e2b.test:4443", 49999, "abc-n1", true},
		{"another domain is not a sandbox", "e2b.test", "49983-abc-n1.other.test", 0, "", false},
		{"the API host is not a sandbox", "", "127.0.0.1:7070", 0, "", false},
		{"a label without a port is not a sandbox", "", "api.example", 0, "", false},
		{"a port out of range is not a sandbox", "", "99999-abc.example", 0, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := facade(t, Config{Domain: tt.domain})
			port, id, ok := f.parseHost(tt.host)
			if port != tt.port || id != tt.id || ok != tt.ok {
				t.Fatalf("parseHost(%q) = %d %q %v, want %d %q %v", tt.host, port, id, ok, tt.port, tt.id, tt.ok)
			}
		})
	}
}

func TestResolvePrefersTheHeader(t *testing.T) {
	f := facade(t, Config{})
	r := httptest.NewRequest("GET", "http://49999-other.example/health", nil)
	r.Header.Set("E2b-Sandbox-Id", "abc-local")
	tg, err := f.resolve(r, EnvdPort)
	if err != nil || tg.id != "abc-local" || tg.port != EnvdPort {
		t.Fatalf("got %+v %v", tg, err)
	}
	r.Header.Set("E2b-Sandbox-Port", "nope")
	if _, err := f.resolve(r, EnvdPort); err == nil {
		t.Fatal("a malformed port was accepted")
	}
}

func TestTokens(t *testing.T) {
	f := facade(t, Config{})
	g := facade(t, Config{})
	if f.AccessToken("a-local") != g.AccessToken("a-local") {
		t.Fatal("tokens must not depend on the replica")
	}
	if f.AccessToken("a-local") == f.AccessToken("b-local") || f.AccessToken("a-local") == f.TrafficToken("a-local") {
		t.Fatal("tokens must differ per sandbox and purpose")
	}
	if _, err := New(Config{TokenSecret: []byte("short")}, slog.Default(), apiserver.Single{}, nil); err == nil {
		t.Fatal("a short secret was accepted")
	}
}

// TestSignature checks signed URLs against the SDK's construction:
// "v1_" + base64(sha256("<path>:<op>:<user>:<token>[:<exp>]")) without '='.
func TestSignature(t *testing.T) {
	sum := sha256.Sum256([]byte("/tmp/a.txt:read::tok:1700000000"))
	want := "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
	if got := signature("/tmp/a.txt", "read", "", "tok", "1700000000"); got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
	if signature("/tmp/a.txt", "write", "", "tok", "") == signature("/tmp/a.txt", "read", "", "tok", "") {
		t.Fatal("read and write signatures must differ")
	}
}

func TestListQuery(t *testing.T) {
	// What the JS SDK sends for metadata {"k 1": "a=b&c"} (encodeURIComponent
	// of key and value, then URLSearchParams, then the query serializer).
	inner := url.Values{}
	inner.Set(url.QueryEscape("k 1"), url.QueryEscape("a=b&c"))
	q := url.Values{}
	q.Set("metadata", inner.Encode())
	q.Set("state", "running,paused")
	q.Set("limit", "5")
	q.Set("order", "desc")
	lq, err := parseListQuery(q)
	if err != nil {
		t.Fatal(err)
	}
	if lq.metadata["k 1"] != "a=b&c" || !lq.states["paused"] || lq.limit != 5 || !lq.desc {
		t.Fatalf("parsed %+v", lq)
	}
	sb := func(state string, labels map[string]string, created time.Time) *dsecv1.Sandbox {
		return &dsecv1.Sandbox{State: state, Spec: &dsecv1.SandboxSpec{Labels: labels}, CreatedAt: timestamppb.New(created)}
	}
	now := time.Now()
	match := []struct {
		name string
		sb   *dsecv1.Sandbox
		want bool
	}{
		{"metadata kept in the JSON label matches", sb("running", map[string]string{metadataLabel: `{"k 1":"a=b&c"}`}, now), true},
		{"a different value does not match", sb("running", map[string]string{metadataLabel: `{"k 1":"a=b"}`}, now), false},
		{"a deleted sandbox never matches", sb("deleted", map[string]string{metadataLabel: `{"k 1":"a=b&c"}`}, now), false},
	}
	for _, tt := range match {
		t.Run(tt.name, func(t *testing.T) {
			if got := lq.matches(tt.sb); got != tt.want {
				t.Fatalf("matches = %v, want %v", got, tt.want)
			}
		})
	}
	for _, bad := range []url.Values{{"state": {"sleeping"}}, {"limit": {"0"}}, {"order": {"up"}}, {"nextToken": {"!!"}}, {"startedAfter": {"yesterday"}}} {
		if _, err := parseListQuery(bad); err == nil {
			t.Fatalf("accepted %v", bad)
		}
	}
}

func TestEntry(t *testing.T) {
	tests := []struct {
		name  string
		info  *dsecv1.FileInfo
		typ   filesystem.FileType
		perms string
	}{
		{"a file", &dsecv1.FileInfo{Type: "file", Mode: 0o644}, filesystem.FileType_FILE_TYPE_FILE, "-rw-r--r--"},
		{"a directory", &dsecv1.FileInfo{Type: "dir", Mode: 0o755}, filesystem.FileType_FILE_TYPE_DIRECTORY, "drwxr-xr-x"},
		// envd reports a symlink as what it resolves to (envd_test.go).
		{"a symlink", &dsecv1.FileInfo{Type: "symlink", Mode: 0o777, SymlinkTarget: "/x", Target: &dsecv1.FileInfo{Type: "file", Path: "/x"}}, filesystem.FileType_FILE_TYPE_FILE, "Lrwxrwxrwx"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := entry(tt.info)
			if e.Type != tt.typ || e.Permissions != tt.perms || e.ModifiedTime == nil {
				t.Fatalf("got %v %q", e.Type, e.Permissions)
			}
		})
	}
}
