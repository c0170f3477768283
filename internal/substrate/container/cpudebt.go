package container

import (
	"github.com/opendsec/dsec/internal/cgroup"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// CPU debt. On this host's kernel (6.18, task-based CFS throttling) the
// bandwidth controller throttles a task only when it returns to user mode: time a sandbox spends in the
// kernel (a fork or memory bomb thrashing in reclaim at its memory limit)
// is charged against its quota but never stopped, and the sandbox owes
// it back afterwards at one quota per period. A bomb's 15 s at its memory
// limit left one sandbox throttled in every period, with no CPU at all,
// for minutes: its processes, killed, could not run to exit, so the
// timed-out exec did not answer and a delete waited on them.
//
// The node forgives such a debt: a sandbox throttled in nearly every
// period of a watch interval while running under a tenth of its quota is
// repaying, not running, and writing its quota again resets what it owes
// (the kernel's tg_set_cfs_bandwidth). The limit still caps the rate a
// sandbox runs at; the kernel time it took beyond it is not taken out of
// its later life. A delete lifts the limit first, so killed processes
// exit at once.

const debtInterval = time.Second

// cpuSample is one reading of a sandbox's CPU accounting: its usage is
// read only while it is being throttled (hasUsage).
type cpuSample struct {
	periods, throttled int64
	usage              time.Duration
	hasUsage           bool
}

// cpuLimit is a cgroup's CFS bandwidth: its quota per period (quota < 0:
// no limit).
type cpuLimit struct {
	quota, period time.Duration
}

// repaying reports whether the cgroup spent the interval from a to b
// paying back CPU debt: throttled in all but one of at least four
// periods, using under a tenth of the quota those periods granted.
func repaying(a, b cpuSample, l cpuLimit) bool {
	periods := b.periods - a.periods
	if l.quota <= 0 || l.period <= 0 || periods < 4 || b.throttled-a.throttled < periods-1 {
		return false
	}
	granted := time.Duration(periods) * l.quota
	return (b.usage-a.usage)*10 < granted
}

// cpuSample reads a cgroup's CFS periods and throttled periods.
func (c cgroups) cpuSample(path string) cpuSample {
	stat := filepath.Join(c.Dir(path, "cpu"), "cpu.stat")
	return cpuSample{periods: cgroup.Keyed(stat, "nr_periods"), throttled: cgroup.Keyed(stat, "nr_throttled")}
}

// cpuLimit reads a cgroup's CFS quota and period.
func (c cgroups) cpuLimit(path string) (cpuLimit, string) {
	if c.Mode == cgroup.V2 {
		b, err := os.ReadFile(filepath.Join(c.Dir(path, ""), "cpu.max"))
		if err != nil {
			return cpuLimit{quota: -1}, ""
		}
		raw := strings.TrimSpace(string(b))
		q, p, _ := strings.Cut(raw, " ")
		period, _ := strconv.ParseInt(p, 10, 64)
		quota, err := strconv.ParseInt(q, 10, 64)
		if err != nil {
			quota = -1 // "max"
		}
		return cpuLimit{quota: time.Duration(quota) * time.Microsecond, period: time.Duration(period) * time.Microsecond}, raw
	}
	dir := c.Dir(path, "cpu")
	quota := cgroup.ReadInt(filepath.Join(dir, "cpu.cfs_quota_us"))
	period := cgroup.ReadInt(filepath.Join(dir, "cpu.cfs_period_us"))
	if quota == 0 {
		quota = -1 // unreadable
	}
	return cpuLimit{quota: time.Duration(quota) * time.Microsecond, period: time.Duration(period) * time.Microsecond}, strconv.FormatInt(quota, 10)
}

// setCPUQuota writes a cgroup's quota (v1: microseconds or -1; v2: cpu.max's
// "quota period" or "max").
func (c cgroups) setCPUQuota(path, v string) error {
	if c.Mode == cgroup.V2 {
		return os.WriteFile(filepath.Join(c.Dir(path, ""), "cpu.max"), []byte(v), 0)
	}
	return os.WriteFile(filepath.Join(c.Dir(path, "cpu"), "cpu.cfs_quota_us"), []byte(v), 0)
}

// liftCPULimit removes a cgroup's CPU limit (before its processes are
// killed: they may owe CPU debt and must run to exit).
func (c cgroups) liftCPULimit(path string) {
	v := "-1"
	if c.Mode == cgroup.V2 {
		v = "max"
	}
	c.setCPUQuota(path, v)
}

// forgiveCPUDebt writes the cgroup's quota again, which resets the debt
// each of its CPUs holds and unthrottles them.
func (c cgroups) forgiveCPUDebt(path string) error {
	l, raw := c.cpuLimit(path)
	if l.quota <= 0 {
		return nil
	}
	return c.setCPUQuota(path, raw)
}

// debtWatch samples the CPU accounting of the node's running sandboxes
// and forgives the debt of those repaying it.
type debtWatch struct {
	cgroups cgroups
	log     *slog.Logger
	stop    chan struct{}

	mu    sync.Mutex
	insts map[*instance]*cpuSample // nil: not sampled yet
}

func newDebtWatch(c cgroups, log *slog.Logger) *debtWatch {
	w := &debtWatch{cgroups: c, log: log, stop: make(chan struct{}), insts: map[*instance]*cpuSample{}}
	go w.run()
	return w
}

func (w *debtWatch) add(i *instance) {
	w.mu.Lock()
	w.insts[i] = nil
	w.mu.Unlock()
}

func (w *debtWatch) remove(i *instance) {
	w.mu.Lock()
	delete(w.insts, i)
	w.mu.Unlock()
}

func (w *debtWatch) close() { close(w.stop) }

func (w *debtWatch) run() {
	t := time.NewTicker(debtInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			w.check()
		}
	}
}

func (w *debtWatch) check() {
	w.mu.Lock()
	insts := make([]*instance, 0, len(w.insts))
	for i := range w.insts {
		insts = append(insts, i)
	}
	w.mu.Unlock()
	for _, i := range insts {
		select {
		case <-i.done:
			w.remove(i)
			continue
		default:
		}
		// One file per sandbox per interval; its usage too only while it
		// is throttled (a node holds thousands of idle sandboxes).
		s := w.cgroups.cpuSample(i.st.Cgroup)
		w.mu.Lock()
		prev, ok := w.insts[i]
		w.mu.Unlock()
		if !ok {
			continue
		}
		if prev != nil && s.throttled != prev.throttled {
			s.usage, s.hasUsage = w.cgroups.CPU(i.st.Cgroup), true
		}
		w.mu.Lock()
		if _, ok := w.insts[i]; ok {
			w.insts[i] = &s
		}
		w.mu.Unlock()
		if prev == nil || !prev.hasUsage || !s.hasUsage {
			continue
		}
		l, _ := w.cgroups.cpuLimit(i.st.Cgroup)
		if !repaying(*prev, s, l) {
			continue
		}
		if err := w.cgroups.forgiveCPUDebt(i.st.Cgroup); err != nil {
			w.log.Warn("cannot forgive a sandbox's CPU debt", slog.String("sandbox_id", i.id), slog.Any("error", err))
			continue
		}
		w.log.Info("forgave a sandbox's CPU debt (kernel time beyond its quota, repaid by stalling it)",
			slog.String("sandbox_id", i.id), slog.Int64("throttled_periods", s.throttled-prev.throttled),
			slog.Duration("cpu_used", s.usage-prev.usage))
	}
}
