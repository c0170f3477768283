// Package scripts holds the host setup scripts, embedded in the dsec
// binary so `dsec setup` prepares a host (packages, the microvm guest
// kernel) for any data directory exactly as `make setup` does from a
// source tree.
package scripts

import (
	"embed"
	"os"
	"path/filepath"
)

//go:embed setup.sh guest-kernel.sh
var files embed.FS

// Extract writes the scripts into dir and returns the path of setup.sh,
// which finds guest-kernel.sh beside it.
func Extract(dir string) (string, error) {
	for _, name := range []string{"setup.sh", "guest-kernel.sh"} {
		b, err := files.ReadFile(name)
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o755); err != nil {
			return "", err
		}
	}
	return filepath.Join(dir, "setup.sh"), nil
}
