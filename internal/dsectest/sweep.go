package dsectest

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// procAttr starts a server, node, replica or etcd of the harness in a
// process group of its own, and ends it when the test process dies (a test
// binary killed by its timeout runs no cleanups): it gets SIGTERM and
// stops as it does on any stop. Start such a command with start.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}

var (
	spawnOnce sync.Once
	spawns    chan func()
)

// start starts cmd from one OS thread that lives as long as the process.
// The kernel sends a child's parent-death signal when the *thread* that
// forked it exits, and Go ends threads (a goroutine that exits while
// locked to its thread, as network tests entering namespaces do): a
// server forked from such a thread was killed mid-test.
func start(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawns = make(chan func())
		go func() {
			runtime.LockOSThread() // never unlocked: this thread stays
			for f := range spawns {
				f()
			}
		}()
	})
	errc := make(chan error, 1)
	spawns <- func() { errc <- cmd.Start() }
	return <-errc
}

func haveBinaries(dir string) bool {
	for _, b := range []string{"dsec", "dsec-guest"} {
		if st, err := os.Stat(filepath.Join(dir, b)); err != nil || !st.Mode().IsRegular() {
			return false
		}
	}
	return true
}

// Names of what the harness leaves on the host while a test process runs,
// each carrying that process's pid.
var (
	leftoverFile   = regexp.MustCompile(`^dsec-(?:bin|serve|etcd|cluster)-(\d+)-`)
	leftoverTable  = regexp.MustCompile(`^table (inet|bridge) (dsectest_(\d+)_\d+)$`)
	leftoverBridge = regexp.MustCompile(`^\d+: (ds[tc](\d+)-\d+)[:@]`)
)

// sweep removes what test processes that are no longer alive left behind:
// their binaries, logs and etcd directories, their nftables tables and
// their bridges. (Their servers died with them: procAttr.)
func sweep() {
	dead := func(pid string) bool {
		n, err := strconv.Atoi(pid)
		if err != nil || n == os.Getpid() {
			return false
		}
		_, err = os.Stat("/proc/" + pid)
		return os.IsNotExist(err)
	}
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if m := leftoverFile.FindStringSubmatch(e.Name()); m != nil && dead(m[1]) {
				os.RemoveAll(filepath.Join(dir, e.Name()))
			}
		}
	}
	if out, err := exec.Command("nft", "list", "tables").Output(); err == nil {
		for _, l := range strings.Split(string(out), "\n") {
			if m := leftoverTable.FindStringSubmatch(strings.TrimSpace(l)); m != nil && dead(m[3]) {
				exec.Command("nft", "delete", "table", m[1], m[2]).Run()
			}
		}
	}
	if out, err := exec.Command("ip", "-o", "link", "show", "type", "bridge").Output(); err == nil {
		for _, l := range strings.Split(string(out), "\n") {
			if m := leftoverBridge.FindStringSubmatch(l); m != nil && dead(m[2]) {
				exec.Command("ip", "link", "del", m[1]).Run()
			}
		}
	}
}
