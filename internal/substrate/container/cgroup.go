package container

import "github.com/opendsec/dsec/internal/cgroup"

// cgroups reads a sandbox's cgroup files. The runtime creates and removes
// the cgroups; the driver reads them, writes memory.reclaim, and rewrites
// or lifts the CPU quota (cpudebt.go).
type cgroups struct{ cgroup.Hierarchy }

func probeCgroups() cgroups { return cgroups{cgroup.Probe()} }
