package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestSetupPreparesAnyDataDirectory: `dsec setup --data-dir D` leaves what
// `dsec serve --data-dir D` needs, with no source tree and no
// DSEC_CACHE_DIR: the microvm kind is available.
func TestSetupPreparesAnyDataDirectory(t *testing.T) {
	dsectest.Need(t)
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64 (apt-get install qemu-system-x86)")
	}
	bin := dsectest.Binaries(t)
	dir := t.TempDir()
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "DSEC_CACHE_DIR=") && !strings.HasPrefix(e, "DSEC_DATA_DIR=") {
			env = append(env, e)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	setup := exec.CommandContext(ctx, bin+"/dsec", "setup", "--data-dir", dir)
	setup.Env = env
	if out, err := setup.CombinedOutput(); err != nil {
		t.Fatalf("dsec setup: %v\n%s", err, out)
	}
	srv := dsectest.Start(t, dsectest.Options{DataDir: dir, Env: env})
	out, errOut, code := srv.CLI(ctx, "", "info", "-o", "json")
	if code != 0 {
		t.Fatalf("dsec info: %s", errOut)
	}
	var info struct {
		Nodes []struct {
			Kinds []struct {
				Kind      string `json:"kind"`
				Available bool   `json:"available"`
				Reason    string `json:"reason"`
			} `json:"kinds"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Nodes) != 1 {
		t.Fatalf("dsec info -o json: %v\n%s", err, out)
	}
	for _, k := range info.Nodes[0].Kinds {
		if k.Kind == "microvm" {
			if !k.Available {
				t.Fatalf("microvm unavailable after dsec setup: %s", k.Reason)
			}
			return
		}
	}
	t.Fatalf("dsec info lists no microvm kind:\n%s", out)
}
