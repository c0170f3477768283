// Command leftovers checks that a test run left nothing behind on the
// host: it records what is there before the run (`save`) and, after it,
// fails naming everything that appeared since and is still there
// (`check`): nftables tables, network links, sandbox cgroups, loop
// devices, mounts, the project's processes (servers, agents, runtimes,
// QEMU, etcd, workers) and its temporary files.
//
//	go run ./scripts/leftovers save FILE
//	... the tests ...
//	go run ./scripts/leftovers check FILE
//
// What the run's processes were ending when it finished gets a grace
// period to go.
package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"
)

// grace is how long check waits for leftovers still going away.
const grace = 15 * time.Second

func main() {
	if len(os.Args) != 3 || (os.Args[1] != "save" && os.Args[1] != "check") {
		fmt.Fprintln(os.Stderr, "usage: leftovers save|check FILE")
		os.Exit(2)
	}
	file := os.Args[2]
	if os.Args[1] == "save" {
		if err := os.WriteFile(file, []byte(strings.Join(snapshot(), "\n")+"\n"), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "leftovers:", err)
			os.Exit(2)
		}
		return
	}
	b, err := os.ReadFile(file)
	if err != nil {
		fmt.Fprintln(os.Stderr, "leftovers:", err)
		os.Exit(2)
	}
	before := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		before[l] = true
	}
	deadline := time.Now().Add(grace)
	for {
		var left []string
		for _, l := range snapshot() {
			if !before[l] {
				left = append(left, l)
			}
		}
		if len(left) == 0 {
			fmt.Println("leftovers: the tests left nothing behind")
			return
		}
		if time.Now().After(deadline) {
			fmt.Printf("leftovers: the tests left %d things behind on the host:\n", len(left))
			for _, l := range left {
				fmt.Println("  " + l)
			}
			os.Exit(1)
		}
		time.Sleep(time.Second)
	}
}

// snapshot lists what is on the host, one sorted line per thing.
func snapshot() []string {
	var out []string
	out = append(out, nftTables()...)
	out = append(out, links()...)
	out = append(out, cgroups()...)
	out = append(out, loops()...)
	out = append(out, mounts()...)
	out = append(out, procs()...)
	out = append(out, tempFiles()...)
	sort.Strings(out)
	return out
}

func nftTables() []string {
	b, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, "nftables "+l)
		}
	}
	return out
}

// moduleLinks are the links a kernel module makes when it loads (ifb's
// for the bandwidth limits, the tunnel modules' fallback devices): they
// belong to the module, which stays loaded.
var moduleLinks = regexp.MustCompile(`^(ifb\d+|sit0|tunl0|ip6tnl0|ip_vti0|ip6_vti0|gre0|gretap0|erspan0|ip6gre0|dummy0|teql0)$`)

func links() []string {
	ents, _ := os.ReadDir("/sys/class/net")
	var out []string
	for _, e := range ents {
		if !moduleLinks.MatchString(e.Name()) {
			out = append(out, "link "+e.Name())
		}
	}
	return out
}

// cgroups lists the cgroups under the sandboxes' parent (/dsec, the
// default every server and test uses) in every hierarchy; the parent
// itself is shared and stays.
func cgroups() []string {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/dsec")
	if st, err := os.Stat("/sys/fs/cgroup/dsec"); err == nil && st.IsDir() {
		roots = append(roots, "/sys/fs/cgroup/dsec")
	}
	var out []string
	for _, root := range roots {
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() || p == root {
				return nil
			}
			out = append(out, "cgroup "+p)
			return nil
		})
	}
	return out
}

func loops() []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, _ := os.ReadFile(f)
		out = append(out, fmt.Sprintf("loop %s -> %s", strings.Split(f, "/")[3], strings.TrimSpace(string(b))))
	}
	return out
}

// mounts lists the host's mounts that belong to dsec (by path or source).
func mounts() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		if strings.Contains(sc.Text(), "dsec") {
			out = append(out, "mount "+fields[4])
		}
	}
	return out
}

// ours are the commands of the project's processes and those it starts.
var ours = []string{"dsec", "dsec-guest", "crun", "runc", "runsc", "qemu-system", "etcd", "bwrap", "virtiofsd", "docker-registry"}

// procs lists the project's processes: by command, or by living in a
// sandbox's cgroup.
func procs() []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		pid := e.Name()
		if pid[0] < '0' || pid[0] > '9' {
			continue
		}
		comm, err := os.ReadFile("/proc/" + pid + "/comm")
		if err != nil {
			continue
		}
		c := strings.TrimSpace(string(comm))
		mine := false
		for _, o := range ours {
			if c == o || strings.HasPrefix(c, o+"-") || (o == "qemu-system" && strings.HasPrefix(c, o)) {
				mine = true
			}
		}
		if cg, err := os.ReadFile("/proc/" + pid + "/cgroup"); err == nil && strings.Contains(string(cg), ":/dsec/") {
			mine = true
		}
		if mine {
			cmdline, _ := os.ReadFile("/proc/" + pid + "/cmdline")
			out = append(out, fmt.Sprintf("process %s %s (%s)", pid, c, strings.TrimSpace(strings.ReplaceAll(string(cmdline), "\x00", " "))))
		}
	}
	return out
}

// tempFiles lists the project's temporary files and directories, and those
// of the programs the tests drive (the dashboard test's Chromium makes its
// singleton socket's directory under TMPDIR unless told otherwise).
func tempFiles() []string {
	var out []string
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "dsec") || strings.HasPrefix(e.Name(), "org.chromium.") {
				out = append(out, "file "+filepath.Join(dir, e.Name()))
			}
		}
	}
	return out
}
