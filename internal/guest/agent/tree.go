package agent

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// killTree kills the process pid, its process group and every process
// descended from it: what a timed-out exec started, where the agent has no
// exec cgroup to kill instead (under gVisor). Each process is stopped
// first, and the walk repeats until it finds none it has not stopped, so
// nothing forks or is orphaned out of the tree while it is walked; then all
// are killed.
//
// A process that left the exec's process group and was orphaned before the
// kill (a daemon: fork, setsid, fork, exit) is the agent's child then, no
// longer the exec's, and outlives it, bounded by the sandbox's limits and
// life. An exec cgroup has no such gap.
//
// It returns the processes it killed.
func killTree(pid int) []int {
	stopped := map[int]bool{}
	stop := func(p int) {
		if !stopped[p] {
			stopped[p] = true
			syscall.Kill(p, syscall.SIGSTOP)
		}
	}
	syscall.Kill(-pid, syscall.SIGSTOP)
	stop(pid)
	for round := 0; round < 1000; round++ {
		waitStopped(stopped)
		before := len(stopped)
		for _, p := range allProcs() {
			if stopped[p.ppid] || p.pgid == pid {
				stop(p.pid)
			}
		}
		if len(stopped) == before {
			break
		}
	}
	killed := make([]int, 0, len(stopped))
	for p := range stopped {
		syscall.Kill(p, syscall.SIGKILL)
		killed = append(killed, p)
	}
	syscall.Kill(-pid, syscall.SIGKILL)
	return killed
}

// killedGrace bounds how long a timed-out exec's result waits for the
// processes its timeout killed to be reaped.
const killedGrace = 10 * time.Second

// awaitGone waits up to d until none of pids is left, reaped (a zombie
// still holds its pid, counted against the process limits).
func awaitGone(pids []int, d time.Duration) {
	deadline := time.Now().Add(d)
	for _, p := range pids {
		for procState(p) != 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// waitStopped waits up to 100 ms for the processes to be stopped (or gone),
// so that none forks after the next walk of the process table.
func waitStopped(procs map[int]bool) {
	deadline := time.Now().Add(100 * time.Millisecond)
	for p := range procs {
		for time.Now().Before(deadline) {
			st := procState(p)
			if st == 0 || st == 'T' || st == 't' || st == 'Z' || st == 'X' {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
}

type procEntry struct{ pid, ppid, pgid int }

// allProcs lists the processes in /proc with their parents and groups.
func allProcs() []procEntry {
	ents, err := os.ReadDir(procPath("."))
	if err != nil {
		return nil
	}
	var out []procEntry
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		f := statFields(pid)
		if len(f) < 3 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		pgid, _ := strconv.Atoi(f[2])
		out = append(out, procEntry{pid, ppid, pgid})
	}
	return out
}

// procState is the state letter of a process (0 if it is gone).
func procState(pid int) byte {
	f := statFields(pid)
	if len(f) == 0 || len(f[0]) == 0 {
		return 0
	}
	return f[0][0]
}

// statFields are the fields of /proc/<pid>/stat after the command name
// (the state first), or nil.
func statFields(pid int) []string {
	b, err := os.ReadFile(procPath(strconv.Itoa(pid) + "/stat"))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}
