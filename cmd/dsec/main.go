// Command dsec is dsec's one binary: the server (`dsec serve`, the
// all-in-one; `dsec api` and `dsec node` in a cluster), cluster
// administration (`dsec cluster`) and the command-line client for
// everything else.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// globals are the client flags every user verb shares.
type globals struct {
	url    string
	apiKey string
	output string
}

func (g *globals) client() *dsec.Client {
	return dsec.New(g.url, dsec.WithAPIKey(g.key()))
}

// key is --api-key, else $DSEC_API_KEY. The environment is read here, not
// as the flag's default, so --help never prints a secret.
func (g *globals) key() string {
	if g.apiKey != "" {
		return g.apiKey
	}
	return os.Getenv("DSEC_API_KEY")
}

func (g *globals) json() bool { return g.output == "json" }

func main() {
	g := &globals{}
	root := &cobra.Command{
		Use:           "dsec",
		Short:         "Sandboxes for training and evaluating AI agents",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.url, "url", envOr("DSEC_URL", dsec.DefaultURL), "server URL (env DSEC_URL)")
	root.PersistentFlags().StringVar(&g.apiKey, "api-key", "", "API key (default $DSEC_API_KEY)")
	root.PersistentFlags().StringVarP(&g.output, "output", "o", "text", "output format: text or json")

	root.AddCommand(serveCmd(), apiCmd(), nodeCmd(), clusterCmd(g), setupCmd(), blobdCmd())
	root.AddCommand(createCmd(g), execCmd(g), cpCmd(g), lsCmd(g), getCmd(g), rmCmd(g), keepaliveCmd(g), psCmd(g), logsCmd(g))
	root.AddCommand(imageCmd(g), commitCmd(g), infoCmd(g), screenshotCmd(g), inputCmd(g), vncCmd(g))
	root.AddCommand(lifecycleCmds(g)...)
	root.AddCommand(runCodeCmd(g))
	root.AddCommand(networkCmd(g))
	root.AddCommand(volumeCmd(g))
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Run:   func(*cobra.Command, []string) { fmt.Println(version) },
	})

	if err := root.Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(int(ee))
		}
		fmt.Fprintln(os.Stderr, "dsec:", err)
		var de *dsec.Error
		if errors.As(err, &de) && de.Infra {
			os.Exit(3) // an infrastructure failure, not the command's
		}
		os.Exit(1)
	}
}

// exitError makes the process exit with a code, without a message (the
// exit code of a command run in a sandbox).
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit %d", int(e)) }

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
