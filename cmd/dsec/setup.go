package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/opendsec/dsec/internal/config"
	"github.com/opendsec/dsec/scripts"
)

// setupCmd prepares a host for `dsec serve` with the setup script embedded
// in the binary: what `make setup` does from a source tree, for any data
// directory.
func setupCmd() *cobra.Command {
	var dataDir, cacheDir string
	cmd := &cobra.Command{
		Use:   "setup",
		Short: "Prepare this host for dsec serve: install missing packages and put the microvm guest kernel into the cache",
		Long: "Installs the Debian packages dsec needs (crun, QEMU, erofs-utils, ...) that are missing, and extracts\n" +
			"the microvm guest kernel into the cache directory the server will use (CACHE_DIR/guest-kernel).\n" +
			"Run it as root with the --data-dir (or --cache-dir) you give dsec serve. Idempotent.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load("")
			if err != nil {
				return err
			}
			if dataDir != "" {
				cfg.DataDir = dataDir
			}
			if cacheDir != "" {
				cfg.CacheDir = cacheDir
			}
			cfg.Defaults()
			cache := cfg.CacheDir
			if cache == "" {
				cache = filepath.Join(cfg.DataDir, "cache")
			}
			if cache, err = filepath.Abs(cache); err != nil {
				return err
			}
			tmp, err := os.MkdirTemp("", "dsec-setup-")
			if err != nil {
				return err
			}
			defer os.RemoveAll(tmp)
			script, err := scripts.Extract(tmp)
			if err != nil {
				return err
			}
			fmt.Fprintf(os.Stderr, "dsec setup: preparing this host; cache %s\n", cache)
			run := exec.CommandContext(cmd.Context(), "bash", script)
			run.Env = append(os.Environ(), "DSEC_CACHE_DIR="+cache, "DSEC_SETUP_GO=0")
			run.Stdout, run.Stderr = os.Stdout, os.Stderr
			if err := run.Run(); err != nil {
				return fmt.Errorf("setup: %w", err)
			}
			fmt.Fprintf(os.Stderr, "dsec setup: done; start the server with --data-dir %s (or --cache-dir %s)\n", cfg.DataDir, cache)
			return nil
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "the data directory dsec serve will use (default ./.dsec, env DSEC_DATA_DIR)")
	cmd.Flags().StringVar(&cacheDir, "cache-dir", "", "the cache directory (default DATA_DIR/cache, env DSEC_CACHE_DIR)")
	return cmd
}
