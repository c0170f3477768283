package dsectest

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// RegistryBinary is the distribution's OCI registry (Debian package
// docker-registry).
const RegistryBinary = "/usr/bin/docker-registry"

// Registry is a real OCI registry (docker-registry) on a free loopback
// port, serving plain HTTP, for one test.
type Registry struct {
	// Host is host:port, for references ("127.0.0.1:5000/team/img:1").
	Host string
	// User and Password are the one account when the registry
	// authenticates ("": it does not).
	User, Password string
	log            *os.File
}

// StartRegistry starts a registry over a fresh storage directory; with a
// user, it requires that user's password (htpasswd, basic auth). It skips
// t when the registry is not installed.
func StartRegistry(t TB, user, password string) *Registry {
	t.Helper()
	if _, err := os.Stat(RegistryBinary); err != nil {
		t.Skipf("needs the registry at %s (apt-get install docker-registry)", RegistryBinary)
	}
	dir := t.TempDir()
	r := &Registry{Host: freePorts(t, 1)[0], User: user, Password: password}
	auth := ""
	if user != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "htpasswd"), []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		auth = fmt.Sprintf("auth:\n  htpasswd:\n    realm: dsectest\n    path: %s\n", filepath.Join(dir, "htpasswd"))
	}
	config := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n%s",
		filepath.Join(dir, "data"), r.Host, auth)
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	r.log = f
	cmd := exec.Command(RegistryBinary, "serve", filepath.Join(dir, "config.yml"))
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = procAttr()
	if err := start(cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("registry log:\n%s", r.Log())
		}
		f.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		// /v2/ answers 200, or 401 when it authenticates: either way it serves.
		resp, err := http.Get("http://" + r.Host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return r
			}
		}
		select {
		case <-done:
			t.Fatalf("the registry exited during start:\n%s", r.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the registry did not start:\n%s", r.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Log is what the registry printed.
func (r *Registry) Log() string {
	b, _ := os.ReadFile(r.log.Name())
	return string(b)
}
