package dsectest

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Diagnose describes the host and the server's machines at the moment a
// test gives up on a call: the load, the processes that carry sandboxes
// (their state and CPU time), and the last lines of each QEMU's own log
// and guest console under the data directory. A timeout says only that
// nothing answered; this says whether the guests were starved, stuck or
// gone.
func (s *Server) Diagnose() string {
	var b strings.Builder
	if l, err := os.ReadFile("/proc/loadavg"); err == nil {
		fmt.Fprintf(&b, "loadavg: %s", l)
	}
	if out, err := exec.Command("ps", "-eo", "pid,ppid,stat,etime,time,rss,comm").Output(); err == nil {
		lines := strings.Split(string(out), "\n")
		b.WriteString(lines[0] + "\n")
		for _, l := range lines[1:] {
			if f := strings.Fields(l); len(f) == 7 && carriesSandboxes(f[6]) {
				b.WriteString(l + "\n")
			}
		}
	}
	filepath.WalkDir(s.DataDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || (d.Name() != "qemu.log" && d.Name() != "console.log") {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		fmt.Fprintf(&b, "--- %s (%d bytes), last lines:\n%s\n", path, len(data), tail(data, 15))
		return nil
	})
	return b.String()
}

func carriesSandboxes(comm string) bool {
	for _, p := range []string{"qemu", "crun", "runc", "runsc", "dsec", "python"} {
		if strings.HasPrefix(comm, p) {
			return true
		}
	}
	return false
}

// tail is the last n lines of data.
func tail(data []byte, n int) []byte {
	data = bytes.TrimRight(data, "\n")
	for i := len(data) - 1; i >= 0; i-- {
		if data[i] == '\n' {
			if n--; n == 0 {
				return data[i+1:]
			}
		}
	}
	return data
}
