package container

import (
	"errors"
	"fmt"
	"github.com/opendsec/dsec/internal/cgroup"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

const (
	// agentSuffix names a sandbox's agent cgroup, beside the sandbox's
	// own: <CgroupParent>/<id>.agent.
	agentSuffix = ".agent"
	// agentsShared names the memory and cpu cgroups every agent of the
	// node shares, beside the sandboxes': <CgroupParent>/agents-<hash of
	// the driver's run directory>, the node's own (nodes sharing a host
	// and a parent never remove one another's when they stop). A memory
	// cgroup per agent would cost the kernel memory in proportion to the
	// node's sandboxes for each one (for every memory cgroup, a slot per
	// file system's shrinker: 1.3 MiB per sandbox at 3,890 sandboxes,
	// measured); agents bound their own memory (the spool budget, 128 MiB
	// of tails across an agent's execs). Out of the sandbox's cpu cgroup,
	// an agent is not throttled by its sandbox's CPU limit nor starved by
	// its workload: a fork bomb of a thousand runnable processes in one
	// CPU's quota left the agent's timer 1/1000 of it, and a 15 s timeout
	// took 44 s to 5 min to kill the bomb (test/hostile).
	agentsShared = "agents"
	// agentsCPUShares weighs the agents' cpu cgroup against each
	// sandbox's (1024, cgroup v1's default): idle agents use none of it;
	// an agent with work (a timeout's kill, a call's answer) gets the CPU
	// before the workloads do.
	agentsCPUShares = 4096
	// agentPidsLimit bounds the agent's threads.
	agentPidsLimit = 512
)

// agentFiles are the descriptors a sandbox's agent inherits besides its
// listening socket, and the flags that tell it which is which.
type agentFiles struct {
	files []*os.File
	args  []string
}

func (a *agentFiles) close() {
	for _, f := range a.files {
		f.Close()
	}
}

// add appends f and returns the descriptor number the agent will see it
// as (the listening socket is 3).
func (a *agentFiles) add(f *os.File) int {
	a.files = append(a.files, f)
	return 3 + len(a.files)
}

// agentCgroup is a sandbox's agent cgroup path in controller c's
// hierarchy: its own pids cgroup, the agents' shared memory and cpu
// cgroups.
func (d *Driver) agentCgroup(id, c string) string {
	if c == "memory" || c == "cpu" {
		return d.agentsCgroup()
	}
	return d.cgroupPath(id) + agentSuffix
}

// agentsCgroup is the memory and cpu cgroup every agent of this driver
// shares.
func (d *Driver) agentsCgroup() string {
	return filepath.Join(d.cfg.CgroupParent, agentsShared+"-"+shortHash(d.cfg.RunDir))
}

// shieldedControllers are the controllers whose cgroups an agent has of
// its own, pids last (the agent takes the last of -home-fds as the pids
// one, where it makes per-exec cgroups).
var shieldedControllers = []string{"memory", "cpu", "pids"}

// shieldable reports whether agents can be shielded on this host: cgroup v1
// controllers (membership per thread) for memory and pids. On cgroup v2 a
// process's threads share one cgroup and children would have to be cloned
// into the sandbox's with clone3, which the sandbox's seccomp profile
// refuses; there the agent stays in the sandbox's cgroup.
func (d *Driver) shieldable() bool {
	return d.cgroups.Mode == cgroup.V1 || d.cgroups.Mode == cgroup.Hybrid
}

// prepareAgentsCgroups makes the cgroups every agent shares (memory, cpu)
// and gives the cpu one its weight, once, when the driver starts.
func (d *Driver) prepareAgentsCgroups() error {
	for _, c := range []string{"memory", "cpu"} {
		if err := os.MkdirAll(d.cgroups.Dir(d.agentsCgroup(), c), 0o755); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(d.cgroups.Dir(d.agentsCgroup(), "cpu"), "cpu.shares"), []byte(strconv.Itoa(agentsCPUShares)), 0)
}

// prepareAgent makes what a sandbox's agent inherits: a spool directory
// for collected output (dir/spool), and, where shieldable, the agent's own
// cgroups and the sandbox's (which the runtime then joins), opened here
// because cgroup v1 checks the opener's credentials (see agent.Shield).
// With a user namespace (host, the host id of root inside, not 0) the
// agent is an unprivileged user on the host: the spool directory and the
// sandbox's pids cgroup directory (where it makes per-exec cgroups) are
// that user's. On error nothing is left behind; undo removes what it made.
func (d *Driver) prepareAgent(id, dir string, host uint32) (_ *agentFiles, undo func(), err error) {
	a := &agentFiles{}
	var made []string // cgroup directories, in creation order
	remove := func() {
		a.close()
		for i := len(made) - 1; i >= 0; i-- {
			os.Remove(made[i])
		}
	}
	undo = remove
	defer func() {
		// Not undo: an error return has set it to nil.
		if err != nil {
			remove()
		}
	}()
	spool := filepath.Join(dir, "spool")
	if err := os.MkdirAll(spool, 0o700); err != nil {
		return nil, nil, err
	}
	if host != 0 {
		if err := os.Chown(spool, int(host), int(host)); err != nil {
			return nil, nil, err
		}
	}
	sf, err := os.Open(spool)
	if err != nil {
		return nil, nil, err
	}
	a.args = append(a.args, "-spool-fd", strconv.Itoa(a.add(sf)))
	if !d.shieldable() {
		return a, undo, nil
	}
	var join, home []string
	var pidsDir int
	for _, c := range shieldedControllers {
		sandbox := d.cgroups.Dir(d.cgroupPath(id), c)
		agent := d.cgroups.Dir(d.agentCgroup(id, c), c)
		if err := os.MkdirAll(sandbox, 0o755); err != nil {
			return nil, nil, fmt.Errorf("create cgroup %s: %w", sandbox, err)
		}
		made = append(made, sandbox)
		if err := os.MkdirAll(agent, 0o755); err != nil {
			return nil, nil, fmt.Errorf("create cgroup %s: %w", agent, err)
		}
		// The shared ones are not this sandbox's to undo (Close removes
		// them once empty; probe made and weighed them).
		if c == "pids" {
			made = append(made, agent)
			if err := os.WriteFile(filepath.Join(agent, "pids.max"), []byte(strconv.Itoa(agentPidsLimit)), 0); err != nil {
				return nil, nil, fmt.Errorf("limit the agent's cgroup: %w", err)
			}
		}
		procs, err := os.OpenFile(filepath.Join(agent, "cgroup.procs"), os.O_WRONLY, 0)
		if err != nil {
			return nil, nil, err
		}
		join = append(join, strconv.Itoa(a.add(procs)))
		tasks, err := os.OpenFile(filepath.Join(sandbox, "tasks"), os.O_WRONLY, 0)
		if err != nil {
			return nil, nil, err
		}
		home = append(home, strconv.Itoa(a.add(tasks)))
		if c == "pids" {
			if host != 0 {
				if err := os.Chown(sandbox, int(host), int(host)); err != nil {
					return nil, nil, err
				}
			}
			df, err := os.Open(sandbox)
			if err != nil {
				return nil, nil, err
			}
			pidsDir = a.add(df)
		}
	}
	// The pids tasks file is the last of -home-fds: the agent's per-exec
	// cgroups are in the pids hierarchy.
	a.args = append(a.args, "-join-fds", strings.Join(join, ","), "-home-fds", strings.Join(home, ","), "-pids-dir-fd", strconv.Itoa(pidsDir))
	return a, undo, nil
}

// removeAgentCgroups removes a sandbox's agent cgroups once its agent has
// exited. A missing one is fine.
func (d *Driver) removeAgentCgroups(id string) error {
	if !d.shieldable() {
		return nil
	}
	var errs []error
	// (A memory cgroup of its own: an agent started by an earlier node.)
	for _, c := range []string{"memory", "pids"} {
		if err := os.Remove(d.cgroups.Dir(d.cgroupPath(id)+agentSuffix, c)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeSandboxCgroups removes what is left of a sandbox's own cgroups
// once its runtime is done: the runtime removes them, but gives up when an
// exec's cgroup below is still emptying (a fork bomb's thousands of
// processes take a moment to die), and leaves those the node made (the
// memory and pids cgroups, for shielded agents and for gVisor). It retries
// for a few seconds.
func (d *Driver) removeSandboxCgroups(id string) {
	d.cgroups.Remove(d.cgroupPath(id), 5*time.Second)
}

// sweepAgentCgroups removes empty agent cgroups of sandboxes keep is false
// for. Nodes on one host share the cgroup parent: another node's sandbox
// is not kept here either, but its agent cgroup is not empty (it cannot be
// removed), or was made less than a minute ago (it may be starting).
func (d *Driver) sweepAgentCgroups(keep func(id string) bool) {
	if !d.shieldable() {
		return
	}
	ents, err := os.ReadDir(d.cgroups.Dir(d.cfg.CgroupParent, "pids"))
	if err != nil {
		return
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), agentSuffix)
		if !ok || !e.IsDir() || keep(id) {
			continue
		}
		if info, err := e.Info(); err != nil || time.Since(info.ModTime()) < time.Minute {
			continue
		}
		d.removeAgentCgroups(id)
	}
}

// pidsLimitHits counts forks the sandbox's pids limit refused.
func (c cgroups) pidsLimitHits(path string) int64 {
	return cgroup.Keyed(filepath.Join(c.Dir(path, "pids"), "pids.events"), "max")
}
