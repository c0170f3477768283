package agent

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
)

// Function calls. A runner (a warm interpreter the node provides) forks
// call processes on request; the agent gives each call storage and a uid
// of its own, feeds and drains the process's stdio, enforces the wall
// timeout, and afterwards kills every process of the uid and removes
// everything it wrote. A uid cannot be shed without privileges (which call
// processes do not have), so "every process of the uid" is every process
// of the call, however it forked or daemonized.
//
// A call's storage and its /tmp, /var/tmp and /dev/shm are its uid's slot
// (callslot.go): a tmpfs of its own, seen through a mount namespace of its
// own, emptied after every call.

// writableDirs are the only places outside its directory where a process of
// the worker can write (the worker's root filesystem is read-only). Calls
// see their own storage there instead; cleanup still checks them.
var writableDirs = []string{"/tmp", "/var/tmp", "/dev/shm"}

type runner struct {
	pid  int
	conn *net.UnixConn
	wmu  sync.Mutex

	mu      sync.Mutex
	next    int
	pending map[int]chan runnerReply
	dead    error
}

type runnerReply struct {
	ID     int     `json:"id"`
	Pid    int     `json:"pid"`
	Error  string  `json:"error"`
	Status *int    `json:"status"`
	Utime  float64 `json:"utime"`
	Stime  float64 `json:"stime"`
	MaxRSS int64   `json:"maxrss"`
}

func (a *Agent) startRunner(m *guestv1.StartRunner) error {
	if len(m.Argv) == 0 {
		return invalid("runner argv is empty")
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	mine := os.NewFile(uintptr(fds[0]), "runner")
	theirs := os.NewFile(uintptr(fds[1]), "runner-child")
	defer theirs.Close()
	path, err := lookPath(m.Argv[0], m.Env, "/")
	if err != nil {
		mine.Close()
		return err
	}
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	pid, _, err := a.spawner.forkExec(path, m.Argv, &syscall.ProcAttr{
		Dir: "/", Env: m.Env,
		Files: []uintptr{devnull.Fd(), os.Stderr.Fd(), os.Stderr.Fd(), theirs.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	}, false)
	if err != nil {
		mine.Close()
		return fmt.Errorf("start runner: %w", err)
	}
	c, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		syscall.Kill(pid, syscall.SIGKILL)
		return err
	}
	r := &runner{pid: pid, conn: c.(*net.UnixConn), pending: map[int]chan runnerReply{}}
	a.mu.Lock()
	old := a.runner
	a.runner = r
	a.mu.Unlock()
	if old != nil {
		old.close(errors.New("runner replaced"))
		syscall.Kill(old.pid, syscall.SIGKILL)
	}
	go r.read()
	return nil
}

func (r *runner) read() {
	sc := bufio.NewScanner(r.conn)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var rep runnerReply
		if json.Unmarshal(sc.Bytes(), &rep) != nil {
			continue
		}
		r.mu.Lock()
		ch := r.pending[rep.ID]
		r.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
	r.close(errors.New("the runner exited"))
}

func (r *runner) close(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead != nil {
		return
	}
	r.dead = err
	r.conn.Close()
	for id, ch := range r.pending {
		close(ch)
		delete(r.pending, id)
	}
}

// spawn asks the runner to start a process with fds as its stdin, stdout
// and stderr; the channel gets the pid, then the exit.
func (r *runner) spawn(req map[string]any, fds []int) (int, chan runnerReply, error) {
	r.mu.Lock()
	if r.dead != nil {
		r.mu.Unlock()
		return 0, nil, r.dead
	}
	r.next++
	id := r.next
	ch := make(chan runnerReply, 2)
	r.pending[id] = ch
	r.mu.Unlock()
	req["id"] = id
	req["nfds"] = len(fds)
	b, _ := json.Marshal(req)
	b = append(b, '\n')
	r.wmu.Lock()
	_, _, err := r.conn.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	r.wmu.Unlock()
	if err != nil {
		r.close(err)
		return 0, nil, err
	}
	return id, ch, nil
}

func (r *runner) forget(id int) {
	r.mu.Lock()
	delete(r.pending, id)
	r.mu.Unlock()
}

// runCall serves a Call.
func (a *Agent) runCall(c *guestv1.Call) *guestv1.CallResult {
	res := &guestv1.CallResult{}
	a.mu.Lock()
	r := a.runner
	a.mu.Unlock()
	dirty := func(reason string) *guestv1.CallResult {
		res.Dirty, res.DirtyReason = true, reason
		return res
	}
	if r == nil {
		return dirty("no runner started")
	}
	if c.Uid < 1000 {
		return dirty("call uid must be an unprivileged uid")
	}
	dir := filepath.Clean(c.Dir)
	if !filepath.IsAbs(dir) || dir == "/" {
		return dirty("bad call directory")
	}
	uid := int(c.Uid)
	slot, err := a.calls.get(dir, uid, c.DiskBytes)
	if err != nil {
		return dirty("call storage: " + err.Error())
	}
	defer func() {
		if reason := a.cleanupCall(slot); reason != "" {
			res.Dirty, res.DirtyReason = true, reason
		}
	}()
	work := slot.work()
	for _, f := range c.Files {
		p, err := inside(work, f.Path)
		if err != nil {
			res.Steps = append(res.Steps, &guestv1.Exit{ExitCode: 2, Error: err.Error()})
			return res
		}
		if err := writeOwned(work, p, f.Content, f.Mode, uid); err != nil {
			res.Steps = append(res.Steps, &guestv1.Exit{ExitCode: 2, Error: "write " + f.Path + ": " + err.Error()})
			return res
		}
	}
	for _, st := range c.Steps {
		x := a.runStep(r, st, slot, c.Env)
		res.Steps = append(res.Steps, x)
		if x.Error != "" && strings.HasPrefix(x.Error, "runner:") {
			return dirty(x.Error)
		}
		if st.StopOnFailure && (x.ExitCode != 0 || x.TimedOut || x.Error != "") {
			break
		}
	}
	for _, name := range c.Fetch {
		res.Fetched = append(res.Fetched, fetch(work, uid, name, c.MaxFetch))
	}
	return res
}

// inside resolves a relative path in dir, refusing escapes.
func inside(dir, rel string) (string, error) {
	if rel == "" || strings.IndexByte(rel, 0) >= 0 || len(rel) > maxPath {
		return "", fmt.Errorf("bad file name %q", rel)
	}
	p := filepath.Join(dir, rel)
	if p != dir && !strings.HasPrefix(p, dir+"/") {
		return "", fmt.Errorf("file %q is outside the call directory", rel)
	}
	return p, nil
}

func writeOwned(dir, p string, content []byte, mode uint32, uid int) error {
	for d := filepath.Dir(p); d != dir && strings.HasPrefix(d, dir); d = filepath.Dir(d) {
		defer func(d string) { os.Chown(d, uid, uid) }(d)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	if mode == 0 {
		mode = 0o600
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW, os.FileMode(mode&0o777))
	if err != nil {
		return err
	}
	_, err = f.Write(content)
	f.Chown(uid, uid)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// fetch reads the file name of the call's working directory work. The
// call made what is there, links too: the file is opened as the call's uid
// and resolved inside work (as if it were the root: ".." and absolute links
// stay in it, /proc's links are refused), so a link cannot have the agent
// read, as root, what the call could not (another call's files, the
// agent's own).
func fetch(work string, uid int, name string, max int64) *guestv1.CallFile {
	out := &guestv1.CallFile{Path: name, Missing: true}
	if _, err := inside(work, name); err != nil {
		return out
	}
	var f *os.File
	var mode uint32
	id := identity{name: strconv.Itoa(uid), uid: uint32(uid), gid: uint32(uid), groups: []uint32{uint32(uid)}}
	err := asUser(id, func() error {
		dir, err := unix.Open(work, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(dir)
		fd, err := openAt(dir, name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || ownProc(fd) {
			unix.Close(fd)
			return unix.EINVAL
		}
		f, mode = os.NewFile(uintptr(fd), name), st.Mode&0o777
		return nil
	})
	if err != nil {
		return out
	}
	defer f.Close()
	if max <= 0 {
		max = 16 << 20
	}
	b, _ := io.ReadAll(io.LimitReader(f, max+1))
	if int64(len(b)) > max {
		b, out.Truncated = b[:max], true
	}
	out.Content, out.Mode, out.Missing = b, mode, false
	return out
}

func (a *Agent) runStep(r *runner, st *guestv1.CallStep, slot *callSlot, env []string) *guestv1.Exit {
	uid := slot.uid
	start := time.Now()
	if len(st.Argv) == 0 {
		return &guestv1.Exit{ExitCode: 2, Error: "empty command"}
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return &guestv1.Exit{ExitCode: 2, Error: "runner: " + err.Error()}
	}
	outR, outW, _ := os.Pipe()
	errR, errW, _ := os.Pipe()
	rl := map[string][2]int64{"CORE": {0, 0}}
	add := func(name string, v int64) {
		if v > 0 {
			rl[name] = [2]int64{v, v}
		}
	}
	if st.RlimitCpuS > 0 {
		rl["CPU"] = [2]int64{st.RlimitCpuS, st.RlimitCpuS + 1}
	}
	add("AS", st.RlimitAsBytes)
	add("FSIZE", st.RlimitFsizeBytes)
	add("NPROC", st.RlimitNproc)
	add("NOFILE", st.RlimitNofile)
	work := slot.work()
	// The fourth descriptor is the slot's mount namespace, which the call
	// process enters before anything else.
	req := map[string]any{"argv": st.Argv, "python": st.Python, "cwd": work, "uid": uid, "env": withCallEnv(env, work), "rlimits": rl, "mntns": true}
	id, ch, err := r.spawn(req, []int{int(inR.Fd()), int(outW.Fd()), int(errW.Fd()), slot.nsfd})
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		errR.Close()
		return &guestv1.Exit{ExitCode: 2, Error: "runner: " + err.Error()}
	}
	defer r.forget(id)
	go func() {
		if len(st.Stdin) > 0 {
			inW.Write(st.Stdin)
		}
		inW.Close()
	}()
	max := st.MaxOutput
	if max <= 0 {
		max = defaultMaxOutput
	}
	var wg sync.WaitGroup
	var out, errOut capture
	out.max, errOut.max = max, max
	wg.Add(2)
	go func() { defer wg.Done(); out.drain(outR) }()
	go func() { defer wg.Done(); errOut.drain(errR) }()
	rep, ok := <-ch
	if !ok {
		outR.Close()
		errR.Close()
		return &guestv1.Exit{ExitCode: 2, Error: "runner: the runner died"}
	}
	if rep.Error != "" {
		outR.Close()
		errR.Close()
		return &guestv1.Exit{ExitCode: 127, Error: rep.Error, Stderr: []byte(rep.Error + "\n")}
	}
	pid := rep.Pid
	var timedOut atomic.Bool
	var timer *time.Timer
	if st.TimeoutMs > 0 {
		timer = time.AfterFunc(time.Duration(st.TimeoutMs)*time.Millisecond, func() {
			timedOut.Store(true)
			syscall.Kill(-pid, syscall.SIGKILL)
			killUID(uid, 3)
		})
	}
	rep, ok = <-ch
	if timer != nil {
		timer.Stop()
	}
	// The pipes may be held by leftovers; they are killed at cleanup, so
	// wait only briefly for the rest of the output.
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(drainGrace):
		killUID(uid, 3)
		select {
		case <-done:
		case <-time.After(drainGrace):
		}
	}
	outR.Close()
	errR.Close()
	x := &guestv1.Exit{TimedOut: timedOut.Load(), DurationUs: time.Since(start).Microseconds(), Truncated: out.cut || errOut.cut}
	x.Stdout, x.Stderr = out.bytes(), errOut.bytes()
	if !ok || rep.Status == nil {
		x.ExitCode, x.Error = 2, "runner: the runner died"
		return x
	}
	ws := syscall.WaitStatus(*rep.Status)
	switch {
	case ws.Exited():
		x.ExitCode = int32(ws.ExitStatus())
	case ws.Signaled():
		x.Signal = int32(ws.Signal())
		x.ExitCode = 128 + x.Signal
	}
	x.CpuUs = int64((rep.Utime + rep.Stime) * 1e6)
	x.MaxRssKb = rep.MaxRSS
	return x
}

func withCallEnv(env []string, dir string) []string {
	base := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=" + dir, "TMPDIR=/tmp", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1"}
	return mergeEnv(base, env)
}

// capture keeps the head and tail of a stream.
type capture struct {
	max  int64
	head []byte
	tail tailBuf
	cut  bool
	n    int64
}

func (c *capture) drain(r io.Reader) {
	half := c.max / 2
	c.tail.max = int(c.max - half)
	buf := make([]byte, 32<<10)
	for {
		k, err := r.Read(buf)
		if k > 0 {
			b := buf[:k]
			c.n += int64(k)
			if room := half - int64(len(c.head)); room > 0 {
				t := min(int64(len(b)), room)
				c.head = append(c.head, b[:t]...)
				b = b[t:]
			}
			if len(b) > 0 && c.tail.add(b) {
				c.cut = true
			}
		}
		if err != nil {
			return
		}
	}
}

func (c *capture) bytes() []byte { return append(append([]byte(nil), c.head...), c.tail.bytes()...) }

// killUID kills every process of uid until none is left, and reports
// whether that happened within rounds rounds.
func killUID(uid, rounds int) bool {
	for i := 0; i < rounds; i++ {
		pids := pidsOf(uid)
		if len(pids) == 0 {
			return true
		}
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(time.Duration(i) * time.Millisecond)
	}
	return len(pidsOf(uid)) == 0
}

// pidsOf lists live (not zombie) processes whose real, effective or saved
// uid is uid.
func pidsOf(uid int) []int {
	ents, err := os.ReadDir(procPath("."))
	if err != nil {
		return nil
	}
	want := strconv.Itoa(uid)
	buf := make([]byte, 1024) // State and Uid are in the first lines
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := readHead(procPath(e.Name()+"/status"), buf)
		if err != nil {
			continue
		}
		var state string
		match := false
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "State:"); ok {
				state = strings.TrimSpace(v)
			}
			if v, ok := strings.CutPrefix(line, "Uid:"); ok {
				f := strings.Fields(v)
				for _, u := range f[:min(3, len(f))] {
					if u == want {
						match = true
					}
				}
				break
			}
		}
		if match && !strings.HasPrefix(state, "Z") {
			out = append(out, pid)
		}
	}
	return out
}

func readHead(path string, buf []byte) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	n, err := f.Read(buf)
	f.Close()
	return buf[:n], err
}

// cleanupCall kills the call's processes and removes what it wrote. It
// returns why the worker cannot be trusted any more, or "".
func (a *Agent) cleanupCall(slot *callSlot) string {
	uid := slot.uid
	if !killUID(uid, 50) {
		return fmt.Sprintf("processes of uid %d survive SIGKILL", uid)
	}
	if err := slot.empty(); err != nil {
		return "empty call storage: " + err.Error()
	}
	for _, d := range writableDirs {
		ents, err := os.ReadDir(d)
		if err != nil {
			continue
		}
		for _, e := range ents {
			p := filepath.Join(d, e.Name())
			var st unix.Stat_t
			if unix.Lstat(p, &st) == nil && int(st.Uid) == uid {
				if err := os.RemoveAll(p); err != nil {
					return "remove " + p + ": " + err.Error()
				}
			}
		}
	}
	// Anything of uid left in a writable place (inside another owner's
	// directory, which sticky dirs prevent) would leak to the next call.
	for _, d := range writableDirs {
		if owned(d, uid, 3) {
			return "files of uid " + strconv.Itoa(uid) + " remain in " + d
		}
	}
	return ""
}

func owned(dir string, uid, depth int) bool {
	if depth == 0 {
		return false
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		var st unix.Stat_t
		if unix.Lstat(p, &st) != nil {
			continue
		}
		if int(st.Uid) == uid {
			return true
		}
		if e.IsDir() && owned(p, uid, depth-1) {
			return true
		}
	}
	return false
}
