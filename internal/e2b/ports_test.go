package e2b

import (
	"crypto/tls"
	"crypto/x509"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

func TestUserPortRouting(t *testing.T) {
	f := facade(t, Config{Domain: "sbx.example.com:8443"})
	id := "abcdefghijklmnop-local"
	tests := []struct {
		name, host string
		headers    map[string]string
		want       int // 0: not a user port
	}{
		{name: "a host name of the domain names a port", host: "8000-" + id + ".sbx.example.com", want: 8000},
		{name: "the host's port does not matter", host: "3000-" + id + ".sbx.example.com:8443", want: 3000},
		{name: "envd's port is the facade's own", host: "49983-" + id + ".sbx.example.com"},
		{name: "the code interpreter's port is the facade's own", host: "49999-" + id + ".sbx.example.com"},
		{name: "another domain is not routed", host: "8000-" + id + ".evil.example.com"},
		{name: "a malformed sandbox ID is not routed", host: "8000-not-an-id.sbx.example.com"},
		{name: "the API's own host is not routed", host: "127.0.0.1:7070"},
		{name: "headers name a port", host: "127.0.0.1:7070", headers: map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "5173"}, want: 5173},
		{name: "headers for envd stay envd's", host: "127.0.0.1:7070", headers: map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "49983"}},
		{name: "a sandbox header without a port is envd's", host: "127.0.0.1:7070", headers: map[string]string{"E2b-Sandbox-Id": id}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/x", nil)
			r.Host = tt.host
			for k, v := range tt.headers {
				r.Header.Set(k, v)
			}
			got, ok := f.userPort(r)
			if (tt.want == 0) == ok || (ok && (got.port != tt.want || got.id != id)) {
				t.Fatalf("userPort = %+v, %v; want port %d", got, ok, tt.want)
			}
		})
	}
}

func TestPortLabels(t *testing.T) {
	no, yes := false, true
	mask, bad := "app.test:${PORT}", "app.test/${PORT}"
	for _, tt := range []struct {
		name    string
		nw      *networkJSON
		want    map[string]string
		wantErr bool
	}{
		{name: "no network config is public", nw: nil, want: map[string]string{}},
		{name: "public traffic is the default", nw: &networkJSON{AllowPublicTraffic: &yes}, want: map[string]string{}},
		{name: "no public traffic marks the sandbox private", nw: &networkJSON{AllowPublicTraffic: &no}, want: map[string]string{trafficLabel: "private"}},
		{name: "a masked host is kept with its placeholder", nw: &networkJSON{MaskRequestHost: &mask}, want: map[string]string{maskHostLabel: mask}},
		{name: "a masked host with a path is refused", nw: &networkJSON{MaskRequestHost: &bad}, wantErr: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			labels := map[string]string{}
			err := portLabels(tt.nw, labels)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err %v", err)
			}
			if !tt.wantErr && len(labels) != len(tt.want) {
				t.Fatalf("labels %v, want %v", labels, tt.want)
			}
			for k, v := range tt.want {
				if labels[k] != v {
					t.Fatalf("labels %v, want %v", labels, tt.want)
				}
			}
		})
	}
}

func TestTheDomainCertificateIsIssuedByTheDataDirectorysCA(t *testing.T) {
	dir := t.TempDir()
	cfg, err := TLSConfig("e2b.localhost:7443", "", "", dir)
	if err != nil {
		t.Fatal(err)
	}
	again, err := TLSConfig("e2b.localhost:7443", "", "", dir)
	if err != nil {
		t.Fatal(err)
	}
	pemBytes, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pemBytes) {
		t.Fatal("the CA file holds no certificate")
	}
	for _, c := range []*tls.Config{cfg, again} {
		leaf, err := x509.ParseCertificate(c.Certificates[0].Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"8000-abcdefghijklmnop-local.e2b.localhost", "api.e2b.localhost", "e2b.localhost"} {
			if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: roots}); err != nil {
				t.Errorf("%s: %v", name, err)
			}
		}
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "evil.example.com", Roots: roots}); err == nil {
			t.Error("the certificate covers another domain")
		}
	}
	if info, err := os.Stat(filepath.Join(dir, caKeyFile)); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("the CA key: %v %v", info, err)
	}
	if _, err := TLSConfig("127.0.0.1:7443", "", "", dir); err == nil {
		t.Fatal("an IP address was accepted as the sandbox domain")
	}
}
