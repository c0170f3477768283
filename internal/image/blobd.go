package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/image/blobfs"
)

// The blob server (dsec blobd).
//
// The data of layers loaded on demand is served by a process of its own,
// not the node's, as nydusd serves a snapshotter's blobs: a node agent
// that restarts (an upgrade, a crash, kill -9) leaves the blob server, and
// the sandboxes reading through it, running, and the new node agent
// connects to the same server. The store starts it on first need, in a
// session and a mount namespace of its own (its FUSE file system is
// mounted there), and reaches it on a unix socket in the store's
// directory; the node opens the blob files through /proc/<its pid>/root,
// from whatever mount namespace the node runs in. It exits by itself once
// no node is connected and no blob file is open (no mount reads through
// it) for blobdIdle, when its file system is detached (its directory
// removed), and on SIGTERM.
//
// Its API, HTTP on <store>/blobd.sock:
//
//	GET    /hello           {pid, mount, started}
//	GET    /session         held open by a node for as long as it runs
//	PUT    /blobs/{id}      {desc, source} → {path}: serve a layer's blob
//	DELETE /blobs/{id}      stop serving it and drop its chunks
//	GET    /blobs           {id: stats} of the blobs served
//	GET    /cache           the chunk cache's stats
//	POST   /shrink?limit=N  drop unpinned chunks down to N bytes (-1: to the budget)
//	PUT    /pinned          [id]: the blobs running sandboxes use
//	PUT    /peers           the header reads from other nodes carry
//
// Pinned blobs' chunks are never evicted: a blob is pinned from the Add
// that serves it to the node's next PUT /pinned, which the node sends
// when the set changes (checked every second) and before a prune.

// blobdEnv marks a process started as the blob server: a program that
// links this package (dsec, a test binary) serves blobs when started with
// it and the argument "blobd" (see init).
const blobdEnv = "DSEC_BLOBD"

// blobdIdle is how long the blob server runs with no node connected and
// no blob file open before it exits.
const blobdIdle = 5 * time.Second

// blobdRunning is the blob server's exit status when another one serves
// the store already.
const blobdRunning = 75

func init() {
	if os.Getenv(blobdEnv) == "1" && len(os.Args) > 1 && os.Args[1] == "blobd" {
		os.Exit(RunBlobd(os.Args[2:]))
	}
}

// RunBlobd runs the blob server with command-line arguments args (dsec
// blobd) and returns its exit status.
func RunBlobd(args []string) int {
	fl := flag.NewFlagSet("blobd", flag.ContinueOnError)
	dir := fl.String("dir", "", "the image store's directory (<data-dir>/images)")
	budget := fl.Int64("budget", 0, "the chunk cache's byte budget (0: a quarter of the file system)")
	ready := fl.Int("ready-fd", 0, "a descriptor to write \"ready\" to once serving")
	detach := fl.String("detach", "", "comma-separated directories whose mounts to detach: the process runs in a mount namespace of its own, a copy of the node's")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil)).With(slog.String("component", "blobd"))
	var dirs []string
	if *detach != "" {
		dirs = strings.Split(*detach, ",")
	}
	err := serveBlobs(*dir, *budget, *ready, dirs, log)
	switch {
	case errors.Is(err, errBlobdRunning):
		return blobdRunning
	case err != nil:
		log.Error("blob server", slog.Any("error", err))
		return 1
	}
	return 0
}

var errBlobdRunning = errors.New("another blob server serves this store")

// blobdHello is the blob server's answer to GET /hello.
type blobdHello struct {
	PID     int       `json:"pid"`
	Mount   string    `json:"mount"`
	Started time.Time `json:"started"`
	// Sessions are the nodes connected, Open the blob files open.
	Sessions int   `json:"sessions"`
	Open     int64 `json:"open"`
}

// blobdAdd is PUT /blobs/{id}'s body.
type blobdAdd struct {
	Desc   blobfs.Blob `json:"desc"`
	Source lazySource  `json:"source"`
}

type blobServer struct {
	fs      *blobfs.FS
	mnt     string
	started time.Time
	log     *slog.Logger

	mu        sync.Mutex
	sessions  int
	idleSince time.Time
	closing   bool // idle: no session may start
	pins      map[string]bool
	peers     Peers
}

func serveBlobs(dir string, budget int64, readyFd int, detach []string, log *slog.Logger) error {
	if dir == "" {
		return errors.New("--dir is required")
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	os.Chdir("/") // hold no directory of the data directory
	lock, err := os.OpenFile(filepath.Join(dir, "blobd.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return errBlobdRunning
	}
	// The namespace is a copy of the node's, which may hold sandboxes'
	// mounts (root file systems, disks, network namespaces): holding
	// them would keep them, their loop devices and their layers (so
	// this server's own files) after the node removed them.
	for _, d := range detach {
		detachUnder(d, dir)
	}
	mnt := filepath.Join(dir, "blobs")
	detachStale(mnt)
	if budget <= 0 {
		budget = defaultChunkBudget(dir)
	}
	s := &blobServer{mnt: mnt, started: time.Now(), log: log, idleSince: time.Now(), pins: map[string]bool{}}
	if s.fs, err = blobfs.Mount(mnt, filepath.Join(dir, "chunks"), blobfs.Options{Budget: budget, Pinned: s.pinned}, log); err != nil {
		return err
	}
	defer func() {
		if err := s.fs.Close(); err != nil {
			detachStale(mnt)
		}
	}()
	sock := filepath.Join(dir, "blobd.sock")
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	os.Chmod(sock, 0o600)
	hs := &http.Server{Handler: s.handler(), ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(l)
	defer func() {
		hs.Close()
		os.Remove(sock)
	}()
	if readyFd > 0 {
		f := os.NewFile(uintptr(readyFd), "ready")
		f.Write([]byte("ready\n"))
		f.Close()
	}
	log.Info("blob server serving", slog.String("dir", dir), slog.Int64("chunk_budget", budget), slog.Int("pid", os.Getpid()))
	unmounted := make(chan struct{})
	go func() {
		s.fs.Wait()
		close(unmounted)
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case sig := <-sigs:
			log.Info("blob server stopping", slog.String("signal", sig.String()), slog.Int64("open_files", s.fs.Open()))
			return nil
		case <-unmounted:
			// Its mountpoint was removed (the data directory with it):
			// nothing reads through it any more.
			log.Info("blob server stopping: its file system was detached")
			return nil
		case <-tick.C:
			if s.idle() {
				log.Info("blob server idle: no node connected, no blob open")
				return nil
			}
		}
	}
}

// idle says whether no node has been connected and no blob file open for
// blobdIdle.
func (s *blobServer) idle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sessions > 0 || s.fs.Open() > 0 {
		s.idleSince = time.Now()
		return false
	}
	s.closing = time.Since(s.idleSince) >= blobdIdle
	return s.closing
}

func (s *blobServer) pinned(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pins[id]
}

func (s *blobServer) peerAccess() Peers {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peers.withClient()
}

func (s *blobServer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		sessions := s.sessions
		s.mu.Unlock()
		writeJSON(w, blobdHello{PID: os.Getpid(), Mount: s.mnt, Started: s.started, Sessions: sessions, Open: s.fs.Open()})
	})
	mux.HandleFunc("GET /session", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		if s.closing {
			s.mu.Unlock()
			http.Error(w, "the blob server is exiting", http.StatusServiceUnavailable)
			return
		}
		s.sessions++
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			s.sessions--
			s.idleSince = time.Now()
			s.mu.Unlock()
		}()
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	mux.HandleFunc("PUT /blobs/{id}", func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		if !validDiff("sha256:" + id) {
			http.Error(w, "not a blob name", http.StatusBadRequest)
			return
		}
		var req blobdAdd
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		src, err := req.Source.source(s.peerAccess)
		if err != nil {
			http.Error(w, "the layer's source: "+err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.pins[id] = true
		s.mu.Unlock()
		path, err := s.fs.Add(id, req.Desc, src)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(w, map[string]string{"path": path})
	})
	mux.HandleFunc("DELETE /blobs/{id}", func(w http.ResponseWriter, r *http.Request) {
		if id := r.PathValue("id"); validDiff("sha256:" + id) {
			s.fs.Remove(id)
		}
	})
	mux.HandleFunc("GET /blobs", func(w http.ResponseWriter, r *http.Request) {
		out := map[string]blobfs.Stats{}
		for _, id := range s.fs.Names() {
			if st, ok := s.fs.Stats(id); ok {
				out[id] = st
			}
		}
		writeJSON(w, out)
	})
	mux.HandleFunc("GET /cache", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, s.fs.Cache())
	})
	mux.HandleFunc("POST /shrink", func(w http.ResponseWriter, r *http.Request) {
		limit, err := strconv.ParseInt(r.URL.Query().Get("limit"), 10, 64)
		if err != nil {
			http.Error(w, "limit: "+err.Error(), http.StatusBadRequest)
			return
		}
		var dropped int64
		if limit < 0 {
			s.fs.Trim()
		} else {
			dropped = s.fs.Shrink(limit)
		}
		writeJSON(w, dropped)
	})
	mux.HandleFunc("PUT /pinned", func(w http.ResponseWriter, r *http.Request) {
		var ids []string
		if err := json.NewDecoder(r.Body).Decode(&ids); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		pins := map[string]bool{}
		for _, id := range ids {
			pins[id] = true
		}
		s.mu.Lock()
		s.pins = pins
		s.mu.Unlock()
	})
	mux.HandleFunc("PUT /peers", func(w http.ResponseWriter, r *http.Request) {
		var h http.Header
		if err := json.NewDecoder(r.Body).Decode(&h); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.peers.Header = h
		s.mu.Unlock()
	})
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

// detachUnder detaches every mount strictly under dir but keep and its
// parents, deepest first.
func detachUnder(dir, keep string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		p := unescapeMount(f[4])
		if strings.HasPrefix(p, dir+"/") && p != keep && !strings.HasPrefix(keep, p+"/") {
			points = append(points, p)
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	for _, p := range points {
		unix.Unmount(p, unix.MNT_DETACH)
	}
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// blobClient is a node's connection to its store's blob server.
type blobClient struct {
	hello blobdHello
	hc    *http.Client
	// end ends the session; done is closed once it ended (by end, or
	// because the server went away).
	end  context.CancelFunc
	done chan struct{}
}

// connectBlobd connects to the blob server of the store in dir, starting
// one (with chunk cache budget budget, detaching the mounts under detach
// in its namespace) if none answers.
func connectBlobd(dir string, budget int64, detach []string, log *slog.Logger) (*blobClient, error) {
	tr := blobdTransport(dir)
	c := &blobClient{hc: &http.Client{Transport: tr, Timeout: time.Minute}}
	var err error
	for try := 1; try <= 10; try++ {
		if err = c.call(context.Background(), http.MethodGet, "/hello", nil, &c.hello); err != nil {
			// None answers: start one. If another one runs (starting
			// beside this one, or on its way out), it refuses to run
			// beside it: try again.
			if err = startBlobd(dir, budget, detach, log); errors.Is(err, errBlobdRunning) {
				time.Sleep(time.Duration(try) * 100 * time.Millisecond)
			} else if err != nil {
				return nil, err
			}
			continue
		}
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://blobd/session", nil)
		resp, serr := (&http.Client{Transport: tr}).Do(req)
		if serr == nil && resp.StatusCode != http.StatusOK {
			// It is on its way out (idle): the next one will serve.
			resp.Body.Close()
			serr = fmt.Errorf("session refused: %s", resp.Status)
		}
		if serr != nil {
			cancel()
			err = serr
			time.Sleep(time.Duration(try) * 100 * time.Millisecond)
			continue
		}
		c.end, c.done = cancel, make(chan struct{})
		go func() {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			close(c.done)
		}()
		return c, nil
	}
	return nil, fmt.Errorf("the blob server: %w", err)
}

// blobdTransport reaches the blob server of the store in dir.
func blobdTransport(dir string) *http.Transport {
	sock := filepath.Join(dir, "blobd.sock")
	return &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
		MaxIdleConnsPerHost: 16,
	}
}

// startBlobd starts the blob server of the store in dir and returns once
// it serves (errBlobdRunning: another one does).
func startBlobd(dir string, budget int64, detach []string, log *slog.Logger) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(dir, "blobd.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	cmd := exec.Command(exe, "blobd", "--dir", dir, "--budget", strconv.FormatInt(budget, 10), "--ready-fd", "3", "--detach", strings.Join(detach, ","))
	cmd.Env = append(os.Environ(), blobdEnv+"=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{w}
	// A session of its own, so that signals to the node's process group
	// do not reach it, and a mount namespace of its own (see above).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Unshareflags: syscall.CLONE_NEWNS}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("start the blob server: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }() // reaped whenever it exits
	line := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(r, 64))
		line <- string(b)
	}()
	select {
	case l := <-line:
		if strings.TrimSpace(l) == "ready" {
			log.Info("blob server started", slog.Int("pid", cmd.Process.Pid))
			return nil
		}
		err := <-exited
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == blobdRunning {
			return errBlobdRunning
		}
		return fmt.Errorf("the blob server exited before serving (%v): see %s", err, filepath.Join(dir, "blobd.log"))
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		return fmt.Errorf("the blob server did not start within a minute: see %s", filepath.Join(dir, "blobd.log"))
	}
}

// call sends a request with in as its JSON body and decodes the answer
// into out (either may be nil).
func (c *blobClient) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://blobd"+path, body)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("blob server: %s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// add serves blob id and returns its path as this process opens it.
func (c *blobClient) add(id string, desc blobfs.Blob, ls lazySource) (string, error) {
	var out struct {
		Path string `json:"path"`
	}
	if err := c.call(context.Background(), http.MethodPut, "/blobs/"+id, blobdAdd{Desc: desc, Source: ls}, &out); err != nil {
		return "", err
	}
	return filepath.Join("/proc", strconv.Itoa(c.hello.PID), "root", out.Path), nil
}

func (c *blobClient) remove(id string) error {
	return c.call(context.Background(), http.MethodDelete, "/blobs/"+id, nil, nil)
}

func (c *blobClient) stats() (map[string]blobfs.Stats, error) {
	out := map[string]blobfs.Stats{}
	return out, c.call(context.Background(), http.MethodGet, "/blobs", nil, &out)
}

func (c *blobClient) cache() (blobfs.CacheStats, error) {
	var out blobfs.CacheStats
	return out, c.call(context.Background(), http.MethodGet, "/cache", nil, &out)
}

// shrink drops unpinned chunks down to limit bytes (< 0: to the budget,
// as the cache does by itself) and returns the bytes dropped.
func (c *blobClient) shrink(limit int64) (int64, error) {
	var out int64
	return out, c.call(context.Background(), http.MethodPost, "/shrink?limit="+strconv.FormatInt(limit, 10), nil, &out)
}

func (c *blobClient) setPinned(ids []string) error {
	return c.call(context.Background(), http.MethodPut, "/pinned", ids, nil)
}

func (c *blobClient) setPeers(h http.Header) error {
	return c.call(context.Background(), http.MethodPut, "/peers", h, nil)
}

// gone says whether the session ended: the server went away (or close).
func (c *blobClient) gone() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// close ends the session (the server stays while mounts read through it).
func (c *blobClient) close() {
	c.end()
	<-c.done
	c.hc.CloseIdleConnections()
}
