package e2b_test

import (
	"net"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/e2b"
)

// testDomain is the shared server's E2B domain; its TLS listener serves it
// on domainPort (on 127.0.0.1), with a certificate from the CA the server
// keeps in its data directory. The scenarios resolve the domain's names to
// 127.0.0.1 themselves (resolve.mjs): there is no wildcard DNS here.
const testDomain = "e2b.localhost"

var domainPort int

// domainArgs are the shared server's flags for its E2B domain and TLS
// listener, on a port free when the server starts.
func domainArgs() []string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil
	}
	domainPort = l.Addr().(*net.TCPAddr).Port
	l.Close()
	p := strconv.Itoa(domainPort)
	return []string{"--e2b-domain", testDomain + ":" + p, "--e2b-tls-listen", "127.0.0.1:" + p}
}

// domainEnv is the environment scenarios need to reach the server's
// domain: its names resolved to the TLS listener, its CA trusted.
func domainEnv(s *dsectest.Server) []string {
	return []string{
		"DSEC_TEST_RESOLVE=" + testDomain + "=127.0.0.1",
		"NODE_EXTRA_CA_CERTS=" + filepath.Join(s.DataDir, e2b.CACertFile),
	}
}

func TestSDKPortsAndSignedURLs(t *testing.T) {
	needNode(t)
	s := server(t)
	if domainPort == 0 {
		t.Fatal("no port for the E2B domain's TLS listener")
	}
	// vm: as in TestSDK (a full VM's ports are on its own network path;
	// tokens, signatures and MCP are the facade's).
	tests := []struct {
		scenario, name string
		vm             bool
	}{
		{"user-ports", "a server in the sandbox answers by host name, header and path, streams, upgrades to WebSocket, and a closed port or a gone sandbox get E2B's 502", true},
		{"traffic-token", "allowPublicTraffic false makes ports need the traffic token and maskRequestHost sets the Host the server sees", false},
		{"signed-urls-by-signature", "signed URLs on E2B_SANDBOX_URL find their sandbox by signature, expire and open no other sandbox", false},
		{"mcp-failure", "an MCP config on a template without mcp-gateway fails as on E2B and kills the sandbox", false},
	}
	for kind := range kinds(t, s) {
		t.Run(kind, func(t *testing.T) {
			t.Parallel() // kinds side by side: a machine kind waits on its guests
			if ok, why := dsectest.VMReady(); kind == "vm" && !ok {
				t.Skipf("the server has no VM image to start: %s", why)
			}
			for _, tt := range tests {
				if kind == "vm" && !tt.vm {
					continue
				}
				t.Run(tt.name, func(t *testing.T) {
					scenario(t, s, tt.scenario, append(templates(kind), domainEnv(s)...)...)
				})
			}
		})
	}
}
