package agent

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
)

const (
	// replayBytes is how much recent output a process keeps for attach.
	replayBytes = 64 << 10
	// defaultMaxOutput caps each stream when the caller gives no cap.
	defaultMaxOutput = 1 << 20
	// drainGrace is how long exit waits for the pipes to reach EOF after the
	// process ended while another process (a background child) still holds
	// their write ends: it does not delay the answer longer than this, and
	// its output still goes to the replay buffer. When no process holds them
	// the exit waits for EOF however long the readers take to run (a slow
	// or emulated guest under load).
	drainGrace = 100 * time.Millisecond
	// keepFinished is how many finished processes stay listed for attach.
	keepFinished = 256
	// outputChunk bounds the data of one Output message sent from a spool.
	outputChunk = 64 << 10
)

// procTable tracks the processes the agent started and reaps every child,
// including orphans re-parented to it.
type procTable struct {
	bootID string

	mu      sync.Mutex
	seq     uint64
	procs   map[string]*proc
	byPid   map[int]*proc
	byTag   map[string]*proc
	early   map[int]exitStatus // statuses reaped before their process registered
	onReap  func(pid int)      // told of every pid reaped (see UseSpawner)
	retired []*proc            // finished, oldest first
}

type exitStatus struct {
	ws  unix.WaitStatus
	ru  unix.Rusage
	at  time.Time
	pid int
}

func newProcTable() *procTable {
	var b [4]byte
	rand.Read(b[:])
	t := &procTable{
		bootID: hex.EncodeToString(b[:]),
		procs:  map[string]*proc{},
		byPid:  map[int]*proc{},
		byTag:  map[string]*proc{},
		early:  map[int]exitStatus{},
	}
	return t
}

// reap waits for children forever. It must be the only waiter in the process.
func (t *procTable) reap() {
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	// Every SIGCHLD drains every zombie (WNOHANG until none), so one
	// coalesced with another loses nothing: a child that exits after a
	// drain raises its own. The tick is only a safety net, rare enough
	// that 5,000 idle sandboxes' agents cost no wakeups (it was 1 s: 5,000
	// wakeups a second on a dense node).
	tick := time.NewTicker(time.Minute)
	for {
		select {
		case <-sigs:
		case <-tick.C:
		}
		for {
			var ws unix.WaitStatus
			var ru unix.Rusage
			pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, &ru)
			if err == unix.EINTR {
				continue
			}
			if pid <= 0 || err != nil {
				break
			}
			t.exited(exitStatus{ws: ws, ru: ru, at: time.Now(), pid: pid})
		}
	}
}

func (t *procTable) exited(st exitStatus) {
	t.mu.Lock()
	if t.onReap != nil {
		t.onReap(st.pid)
	}
	p := t.byPid[st.pid]
	if p != nil {
		delete(t.byPid, st.pid)
	} else {
		t.early[st.pid] = st
		for pid, e := range t.early {
			if time.Since(e.at) > 10*time.Second {
				delete(t.early, pid)
			}
		}
	}
	t.mu.Unlock()
	if p != nil {
		p.onExit(st)
	}
}

// register records a started process; if the reaper already saw it exit,
// the exit is delivered now.
func (t *procTable) register(p *proc) {
	t.mu.Lock()
	t.procs[p.id] = p
	if p.tag != "" {
		t.byTag[p.tag] = p
	}
	st, early := t.early[p.pid]
	if early {
		delete(t.early, p.pid)
	} else {
		t.byPid[p.pid] = p
	}
	t.mu.Unlock()
	if early {
		p.onExit(st)
	}
}

func (t *procTable) nextID() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	return t.bootID + "-" + strconv.FormatUint(t.seq, 10)
}

// retire keeps a finished process listed until keepFinished newer ones
// finish.
func (t *procTable) retire(p *proc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.retired = append(t.retired, p)
	for len(t.retired) > keepFinished {
		old := t.retired[0]
		t.retired = t.retired[1:]
		delete(t.procs, old.id)
		if t.byTag[old.tag] == old {
			delete(t.byTag, old.tag)
		}
	}
}

func (t *procTable) find(id, tag string) *proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	if id != "" {
		return t.procs[id]
	}
	return t.byTag[tag]
}

func (t *procTable) list() []*guestv1.Proc {
	t.mu.Lock()
	ps := make([]*proc, 0, len(t.procs))
	for _, p := range t.procs {
		ps = append(ps, p)
	}
	t.mu.Unlock()
	out := make([]*guestv1.Proc, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.info())
	}
	return out
}

// sink receives a process's events. Writes happen in order from the
// process's goroutines; a failing sink is dropped.
type sink interface {
	send(m *guestv1.ServerMsg) error
}

// proc is one process started by the agent.
type proc struct {
	table   *procTable
	id      string
	pid     int
	argv    []string
	tag     string
	cwd     string
	env     []string
	pty     bool
	start   time.Time
	collect bool
	max     int64

	stdin   io.WriteCloser // nil when closed
	ptyFile *os.File

	mu       sync.Mutex
	subs     map[sink]struct{}
	replay   []byte // framed recent output for attach
	sent     [3]int64
	tails    [3]*tailSpool // collect mode: what follows the head
	spool    *os.File      // the directory tails spool in (nil: memory)
	cg       *execCgroup   // the exec's own cgroup, if any
	trunc    bool
	timedOut bool
	// killed is closed once the processes a timeout killed without an
	// exec cgroup are gone (nil: no such kill): the result waits for it.
	killed   chan struct{}
	status   *exitStatus
	openFds  int
	readers  []*os.File    // the output pipes (or the PTY master) being read
	exit     *guestv1.Exit // set once finished
	done     chan struct{}
	stdinMu  sync.Mutex
	timer    *time.Timer
	graceSet bool
}

// start starts x and registers it. s, if set, is subscribed from the first
// byte on; started, if set, runs once the process is registered (so calls
// naming it find it) and before any output is read.
func (a *Agent) start(x *guestv1.Exec, s sink, started func(*proc)) (*proc, error) {
	if len(x.Argv) == 0 || x.Argv[0] == "" {
		return nil, errors.New("empty command")
	}
	id, err := resolveUser(x.User)
	if err != nil {
		return nil, err
	}
	env := withLoginEnv(a.baseEnv(), x.Env, id)
	cwd := x.Cwd
	switch {
	case cwd == "":
		cwd = id.home
		if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
			cwd = "/"
		}
	case cwd == "~" || strings.HasPrefix(cwd, "~/"):
		cwd = filepath.Clean(id.home + cwd[1:])
	case strings.HasPrefix(cwd, "~"):
		return nil, fmt.Errorf("cwd %.80q: only ~ and ~/ expand (to the user's home directory), not ~name", cwd)
	}
	path, err := lookPath(x.Argv[0], env, cwd)
	if err != nil {
		return nil, err
	}
	max := x.MaxOutput
	if max <= 0 {
		max = defaultMaxOutput
	}
	p := &proc{
		table: a.procs, id: a.procs.nextID(), argv: x.Argv, tag: x.Tag, cwd: cwd, env: env, pty: x.Pty,
		start: time.Now(), collect: x.Collect, max: max, spool: a.spoolDir,
		subs: map[sink]struct{}{}, done: make(chan struct{}),
	}
	sys := &syscall.SysProcAttr{}
	if id.uid != 0 || id.gid != 0 || len(id.groups) > 1 {
		sys.Credential = &syscall.Credential{Uid: id.uid, Gid: id.gid, Groups: id.groups}
	}
	var files []uintptr
	var closeAfter []*os.File
	var readers []*os.File
	if x.Pty {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, fmt.Errorf("open pty: %w", err)
		}
		rows, cols := x.Rows, x.Cols
		if rows == 0 || cols == 0 {
			rows, cols = 24, 80
		}
		pty.Setsize(master, &pty.Winsize{Rows: uint16(rows), Cols: uint16(cols)})
		sys.Setsid, sys.Setctty, sys.Ctty = true, true, 0
		files = []uintptr{slave.Fd(), slave.Fd(), slave.Fd()}
		closeAfter = append(closeAfter, slave)
		p.ptyFile = master
		p.stdin = master
		readers = []*os.File{master}
	} else {
		sys.Setpgid = true
		inR, inW, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			inR.Close()
			inW.Close()
			return nil, err
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			inR.Close()
			inW.Close()
			outR.Close()
			outW.Close()
			return nil, err
		}
		files = []uintptr{inR.Fd(), outW.Fd(), errW.Fd()}
		closeAfter = append(closeAfter, inR, outW, errW)
		p.stdin = inW
		readers = []*os.File{outR, errR}
	}
	pid, cg, err := a.spawner.forkExec(path, x.Argv, &syscall.ProcAttr{Dir: cwd, Env: env, Files: files, Sys: sys}, true)
	for _, f := range closeAfter {
		f.Close()
	}
	if err != nil {
		for _, f := range readers {
			f.Close()
		}
		if p.stdin != nil && !x.Pty {
			p.stdin.Close()
		}
		if errors.Is(err, syscall.EAGAIN) {
			return nil, fmt.Errorf("start %s: the sandbox's process limit is reached (%w)", x.Argv[0], err)
		}
		if errors.Is(err, syscall.ENOMEM) {
			return nil, fmt.Errorf("start %s: the sandbox's memory limit is reached (%w)", x.Argv[0], err)
		}
		return nil, fmt.Errorf("start %s: %w", x.Argv[0], err)
	}
	p.pid = pid
	p.cg = cg
	// The agent itself is shielded from the OOM killer; its children are not.
	os.WriteFile(procPath(strconv.Itoa(pid)+"/oom_score_adj"), []byte("0"), 0)
	applyRlimits(pid, x)
	p.openFds = len(readers)
	p.readers = readers
	if s != nil {
		p.subs[s] = struct{}{}
	}
	a.procs.register(p)
	if started != nil {
		// An exit cannot be sent before the readers drain (not started yet)
		// or the drain grace passes, so "started" goes out first.
		started(p)
	}
	if x.Pty {
		go p.read(1, readers[0])
	} else {
		go p.read(1, readers[0])
		go p.read(2, readers[1])
	}
	if !x.StdinOpen {
		data := x.StdinData
		go func() {
			if len(data) > 0 {
				p.writeStdin(data)
			}
			if !p.pty {
				p.closeStdin()
			} else if len(data) > 0 {
				p.writeStdin([]byte{4}) // ^D ends input on a terminal
			}
		}()
	} else if len(x.StdinData) > 0 {
		go p.writeStdin(x.StdinData)
	}
	if x.TimeoutMs > 0 {
		p.mu.Lock()
		p.timer = time.AfterFunc(time.Duration(x.TimeoutMs)*time.Millisecond, p.onTimeout)
		p.mu.Unlock()
	}
	return p, nil
}

func applyRlimits(pid int, x *guestv1.Exec) {
	set := func(res int, v int64) {
		if v > 0 {
			unix.Prlimit(pid, res, &unix.Rlimit{Cur: uint64(v), Max: uint64(v)}, nil)
		}
	}
	set(unix.RLIMIT_FSIZE, x.RlimitFsizeBytes)
	if x.RlimitCpuS > 0 {
		// The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
		unix.Prlimit(pid, unix.RLIMIT_CPU, &unix.Rlimit{Cur: uint64(x.RlimitCpuS), Max: uint64(x.RlimitCpuS + 1)}, nil)
	}
	set(unix.RLIMIT_NOFILE, x.RlimitNofile)
	set(unix.RLIMIT_AS, x.RlimitAsBytes)
}

// withLoginEnv builds a process's environment: the sandbox's (base),
// overridden by the call's entries, plus PATH, HOME and USER when still
// missing.
func withLoginEnv(base, env []string, id identity) []string {
	out := mergeEnv(base, env)
	has := func(k string) bool {
		for _, e := range out {
			if strings.HasPrefix(e, k+"=") {
				return true
			}
		}
		return false
	}
	if !has("PATH") {
		out = append(out, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	if !has("HOME") {
		out = append(out, "HOME="+id.home)
	}
	if !has("USER") && id.name != "" {
		out = append(out, "USER="+id.name)
	}
	return out
}

// mergeEnv returns base with the entries of over replacing same-named ones.
func mergeEnv(base, over []string) []string {
	idx := map[string]int{}
	out := make([]string, 0, len(base)+len(over))
	for _, list := range [][]string{base, over} {
		for _, e := range list {
			k, _, _ := strings.Cut(e, "=")
			if i, ok := idx[k]; ok {
				out[i] = e
				continue
			}
			idx[k] = len(out)
			out = append(out, e)
		}
	}
	return out
}

// lookPath finds argv0 on the PATH of env, the way execvp does.
func lookPath(file string, env []string, cwd string) (string, error) {
	if strings.Contains(file, "/") {
		p := file
		if !filepath.IsAbs(p) {
			p = filepath.Join(cwd, p)
		}
		if err := executable(p); err != nil {
			return "", fmt.Errorf("%s: %w", file, err)
		}
		return p, nil
	}
	path := ""
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, file)
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found", file)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() {
		return syscall.EISDIR
	}
	if st.Mode()&0o111 == 0 {
		return syscall.EACCES
	}
	return nil
}

func (p *proc) writeStdin(b []byte) error {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return errors.New("stdin is closed")
	}
	_, err := p.stdin.Write(b)
	return err
}

func (p *proc) closeStdin() {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.pty {
		if p.stdin != nil {
			p.stdin.Write([]byte{4})
		}
		return
	}
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
}

func (p *proc) signal(sig syscall.Signal) error {
	// The group first; then the leader, in case it left its group.
	err := syscall.Kill(-p.pid, sig)
	if err2 := syscall.Kill(p.pid, sig); err != nil && err2 != nil {
		return err2
	}
	return nil
}

func (p *proc) resize(rows, cols uint32) error {
	if p.ptyFile == nil {
		return errors.New("process has no pty")
	}
	return pty.Setsize(p.ptyFile, &pty.Winsize{Rows: uint16(rows), Cols: uint16(cols)})
}

func (p *proc) onTimeout() {
	p.mu.Lock()
	if p.exit != nil || p.status != nil {
		p.mu.Unlock()
		return
	}
	p.timedOut = true
	var killed chan struct{}
	if p.cg == nil {
		killed = make(chan struct{})
		p.killed = killed
	}
	p.mu.Unlock()
	if p.cg == nil {
		// No exec cgroup (gVisor, a machine's guest): every process below
		// the exec's, and its group. The result waits until they are gone
		// (reaped), within killedGrace: a fork bomb's thousands of
		// processes take a while to die under TCG, and until they have,
		// the next command's fork fails at the guest's process limit.
		awaitGone(killTree(p.pid), killedGrace)
		close(killed)
		return
	}
	p.signal(syscall.SIGKILL)
	// Every process the exec started, in its process group or not.
	p.cg.kill()
}

// read forwards one output stream until EOF.
func (p *proc) read(fd int32, f *os.File) {
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.output(fd, buf[:n])
		}
		if err != nil {
			break
		}
	}
	f.Close()
	p.mu.Lock()
	p.openFds--
	ready := p.openFds == 0 && p.status != nil && p.exit == nil
	p.mu.Unlock()
	if ready {
		p.finish()
	}
}

func (p *proc) output(fd int32, b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exit != nil {
		// Output after the answer (a background child): replay buffer only.
		p.appendReplayLocked(fd, b)
		return
	}
	if p.collect {
		p.collectLocked(fd, b)
		return
	}
	p.appendReplayLocked(fd, b)
	room := p.max - p.sent[fd]
	if room <= 0 {
		p.trunc = true
		return
	}
	if int64(len(b)) > room {
		b = b[:room]
		p.trunc = true
	}
	p.sent[fd] += int64(len(b))
	p.sendLocked(fd, b)
}

func (p *proc) sendLocked(fd int32, b []byte) {
	m := &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Output{Output: &guestv1.Output{Fd: fd, Data: b}}}
	for s := range p.subs {
		if err := s.send(m); err != nil {
			delete(p.subs, s)
		}
	}
}

// collectLocked sends the first max/2 bytes of each stream as they come
// and keeps the last max/2 (spooled, see tailSpool) for the end: the
// agent never holds a stream's cap in memory.
func (p *proc) collectLocked(fd int32, b []byte) {
	half := p.max / 2
	if room := half - p.sent[fd]; room > 0 {
		take := min(int64(len(b)), room)
		p.sent[fd] += take
		p.sendLocked(fd, b[:take])
		b = b[take:]
	}
	if len(b) > 0 {
		if p.tails[fd] == nil {
			p.tails[fd] = newTailSpool(p.spool, p.max-half)
		}
		if p.tails[fd].add(b) {
			p.trunc = true
		}
	}
}

// replay frames: 1 byte fd, 4 bytes length, data.
func (p *proc) appendReplayLocked(fd int32, b []byte) {
	if len(b) > replayBytes {
		b = b[len(b)-replayBytes:]
	}
	p.replay = append(p.replay, byte(fd), byte(len(b)>>24), byte(len(b)>>16), byte(len(b)>>8), byte(len(b)))
	p.replay = append(p.replay, b...)
	for len(p.replay) > replayBytes {
		n := int(p.replay[1])<<24 | int(p.replay[2])<<16 | int(p.replay[3])<<8 | int(p.replay[4])
		p.replay = p.replay[5+n:]
	}
}

func (p *proc) onExit(st exitStatus) {
	if p.cg != nil && st.ws.Signaled() && st.ws.Signal() == syscall.SIGKILL {
		// Killed outright (the OOM killer, a timeout, a caller's KILL), the
		// process could not stop what it started: what it leaves in the
		// exec's cgroup goes with it, so a fork or memory bomb whose first
		// process the OOM killer took does not keep the sandbox full.
		go p.cg.kill()
	}
	p.mu.Lock()
	p.status = &st
	if p.timer != nil {
		p.timer.Stop()
	}
	ready := p.openFds == 0 && p.exit == nil
	readers := p.readers
	p.mu.Unlock()
	if ready {
		p.finish()
		return
	}
	// Another process may hold the pipes for a moment (one the agent is
	// starting, between its fork and exec) or for good (a background
	// child): wait up to drainGrace for them to let go; once none does, the
	// readers reach EOF and finish.
	go func() {
		deadline := time.Now().Add(drainGrace)
		for !writersGone(readers) {
			if time.Now().After(deadline) {
				p.finish()
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
}

// writersGone reports whether no process holds the write end of any of
// the output streams still being read (poll reports a hang-up), so their
// readers reach EOF without waiting on anyone. A stream already closed
// is done.
func writersGone(files []*os.File) bool {
	for _, f := range files {
		rc, err := f.SyscallConn()
		if err != nil {
			continue
		}
		hup := true
		// Control keeps the descriptor valid while it runs, even if the
		// reader closes the file meanwhile.
		if err := rc.Control(func(fd uintptr) {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			if n, err := unix.Poll(pfd, 0); err != nil || n == 0 || pfd[0].Revents&unix.POLLHUP == 0 {
				hup = false
			}
		}); err != nil {
			continue
		}
		if !hup {
			return false
		}
	}
	return true
}

// finish builds the exit answer once, sends it to every subscriber and
// retires the process.
func (p *proc) finish() {
	p.mu.Lock()
	if p.exit != nil || p.status == nil {
		p.mu.Unlock()
		return
	}
	if k := p.killed; k != nil {
		select {
		case <-k:
		default:
			// Not here: finish runs on the reaper's goroutine, which
			// reaps what the kill waits for.
			p.mu.Unlock()
			go func() { <-k; p.finish() }()
			return
		}
	}
	st := p.status
	x := &guestv1.Exit{
		DurationUs: st.at.Sub(p.start).Microseconds(),
		TimedOut:   p.timedOut,
		Truncated:  p.trunc,
		CpuUs:      tvUs(st.ru.Utime) + tvUs(st.ru.Stime),
		MaxRssKb:   st.ru.Maxrss,
	}
	if p.cg != nil {
		x.PidsLimited = p.cg.limitHits() > 0
	}
	switch {
	case st.ws.Exited():
		x.ExitCode = int32(st.ws.ExitStatus())
	case st.ws.Signaled():
		x.Signal = int32(st.ws.Signal())
		x.ExitCode = 128 + int32(st.ws.Signal())
	}
	if p.collect && len(p.subs) > 0 {
		// The tails follow the heads the client has already received.
		for fd := int32(1); fd <= 2; fd++ {
			if t := p.tails[fd]; t != nil {
				t.each(outputChunk, func(b []byte) { p.sendLocked(fd, b) })
			}
		}
	}
	for _, t := range p.tails {
		if t != nil {
			t.close()
		}
	}
	p.tails = [3]*tailSpool{}
	p.exit = x
	m := &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Exit{Exit: x}}
	for s := range p.subs {
		s.send(m)
		delete(p.subs, s)
	}
	close(p.done)
	p.mu.Unlock()
	if p.cg != nil {
		p.cg.remove()
	}
	if !p.pty {
		p.closeStdin()
	}
	p.table.retire(p)
}

func tvUs(tv unix.Timeval) int64 { return tv.Sec*1e6 + tv.Usec }

// subscribe sends first to s, then (with replay) the buffered output, and
// adds s for live events, all under the process's lock: nothing the process
// writes falls between them. If the process already finished, s gets the
// exit and is not kept.
func (p *proc) subscribe(s sink, replay bool, first *guestv1.ServerMsg) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := s.send(first); err != nil {
		return err
	}
	if replay {
		r := p.replay
		for len(r) >= 5 {
			fd := int32(r[0])
			n := int(r[1])<<24 | int(r[2])<<16 | int(r[3])<<8 | int(r[4])
			s.send(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Output{Output: &guestv1.Output{Fd: fd, Data: r[5 : 5+n]}}})
			r = r[5+n:]
		}
	}
	if p.exit != nil {
		s.send(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Exit{Exit: p.exit}})
		return nil
	}
	p.subs[s] = struct{}{}
	return nil
}

func (p *proc) unsubscribe(s sink) {
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
}

func (p *proc) info() *guestv1.Proc {
	p.mu.Lock()
	defer p.mu.Unlock()
	i := &guestv1.Proc{Id: p.id, Pid: int32(p.pid), Argv: p.argv, Tag: p.tag, Running: p.exit == nil, Pty: p.pty, Cwd: p.cwd, Env: p.env}
	if p.exit != nil {
		i.ExitCode = p.exit.ExitCode
	}
	return i
}

// tailBuf keeps the last max bytes written to it.
type tailBuf struct {
	max  int
	buf  []byte
	full bool
}

// add appends b and reports whether bytes were dropped.
func (t *tailBuf) add(b []byte) bool {
	dropped := false
	t.buf = append(t.buf, b...)
	if len(t.buf) > t.max {
		dropped = true
		t.full = true
		n := copy(t.buf, t.buf[len(t.buf)-t.max:])
		t.buf = t.buf[:n]
	}
	return dropped || t.full
}

func (t *tailBuf) bytes() []byte { return t.buf }
