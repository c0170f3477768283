package container

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// seccompCache holds the default profile and, for crun, the BPF program
// crun compiled from it. crun keeps the program it loaded in the
// container's state directory; the driver takes it from the first sandbox
// and passes it to every later one, so the profile is compiled once per
// (profile, runtime, kernel) instead of once per sandbox.
type seccompCache struct {
	profile *specs.LinuxSeccomp
	file    string // where the program is kept across node restarts

	mu   sync.Mutex
	data string // base64 BPF, "" until learned
}

func newSeccompCache(stateDir, runtimeVersion string, profile func() (*specs.LinuxSeccomp, error)) (*seccompCache, error) {
	p, err := profile()
	if err != nil {
		return nil, err
	}
	b, _ := json.Marshal(p)
	var u unix.Utsname
	unix.Uname(&u)
	h := sha256.Sum256(append(append(b, runtimeVersion...), u.Release[:]...))
	c := &seccompCache{profile: p, file: filepath.Join(stateDir, "seccomp-"+hex.EncodeToString(h[:8])+".bpf")}
	if raw, err := os.ReadFile(c.file); err == nil && len(raw) > 0 && len(raw)%8 == 0 {
		c.data = base64.StdEncoding.EncodeToString(raw)
	}
	return c, nil
}

func (c *seccompCache) bpf() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.data
}

// learn takes the compiled program from a running crun container's state.
func (c *seccompCache) learn(stateDir string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.data != "" {
		return
	}
	raw, err := os.ReadFile(filepath.Join(stateDir, "seccomp.bpf"))
	// A BPF program is an array of 8-byte instructions.
	if err != nil || len(raw) == 0 || len(raw)%8 != 0 {
		return
	}
	c.data = base64.StdEncoding.EncodeToString(raw)
	os.WriteFile(c.file+".tmp", raw, 0o600)
	os.Rename(c.file+".tmp", c.file)
}
