package agent

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// nobody is the identity the tests act as.
var nobody = identity{name: "nobody", uid: 65534, gid: 65534, groups: []uint32{65534}}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (switches file-system credentials)")
	}
}

// openTree makes a directory tree that nobody can enter, with a root-only
// file and a few links, and returns its path.
func openTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for d := dir; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(dir, "secret"), []byte("root only"), 0o600))
	must(os.WriteFile(filepath.Join(dir, "public"), []byte("anyone"), 0o644))
	must(os.Mkdir(filepath.Join(dir, "open"), 0o777))
	must(os.Chmod(filepath.Join(dir, "open"), 0o777)) // past the umask
	must(os.Symlink(filepath.Join(dir, "secret"), filepath.Join(dir, "open", "to-secret")))
	must(os.Symlink("../public", filepath.Join(dir, "open", "up")))
	must(os.Symlink("/proc/self/fd/2", filepath.Join(dir, "open", "stderr")))
	must(os.Symlink("/proc/self/root", filepath.Join(dir, "open", "selfroot")))
	must(os.Symlink("loop", filepath.Join(dir, "open", "loop")))
	return dir
}

func TestActingAsAUserChangesOnlyItsOwnThread(t *testing.T) {
	needRoot(t)
	dir := openTree(t)
	secret := filepath.Join(dir, "secret")
	before, _ := unix.Getgroups()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var rootErr error
	var mu sync.Mutex
	// Root goroutines keep reading the secret while calls act as nobody.
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := os.ReadFile(secret); err != nil {
					mu.Lock()
					rootErr = err
					mu.Unlock()
				}
				runtime.Gosched()
			}
		}()
	}
	for i := 0; i < 200; i++ {
		err := asUser(nobody, func() error {
			_, err := os.ReadFile(secret)
			return err
		})
		if !errors.Is(err, os.ErrPermission) {
			close(stop)
			t.Fatalf("reading a root-only file as nobody: %v, want permission denied", err)
		}
	}
	close(stop)
	wg.Wait()
	if rootErr != nil {
		t.Fatalf("a root goroutine lost its credentials while others acted as nobody: %v", rootErr)
	}
	if after, _ := unix.Getgroups(); len(after) != len(before) {
		t.Fatalf("supplementary groups %v, were %v", after, before)
	}
	if uid, _ := unix.SetfsuidRetUid(-1); uid != agentCreds().fsuid {
		t.Fatalf("this thread's fsuid is %d", uid)
	}
}

func TestWhatAUserCreatesIsTheUsers(t *testing.T) {
	needRoot(t)
	dir := openTree(t)
	p := filepath.Join(dir, "open", "made")
	err := asUser(nobody, func() error {
		fd, err := openIn(p, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, 0o600)
		if err == nil {
			unix.Close(fd)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	unix.Stat(p, &st)
	if st.Uid != nobody.uid || st.Gid != nobody.gid {
		t.Fatalf("created file owned by %d:%d, want %d:%d", st.Uid, st.Gid, nobody.uid, nobody.gid)
	}
}

// TestResolutionStaysInsideTheRoot runs the same paths through openat2 and
// through the user-space walk kernels without openat2 get.
func TestResolutionStaysInsideTheRoot(t *testing.T) {
	needRoot(t)
	dir := openTree(t)
	cases := []struct {
		name string
		path string
		want error // nil: opens
	}{
		{"a readable file opens", dir + "/public", nil},
		{"a relative link with .. opens its target", dir + "/open/up", nil},
		{"a link to a root-only file is the user's to open: denied", dir + "/open/to-secret", unix.EACCES},
		{"a link through /proc/self/fd is refused", dir + "/open/stderr", unix.ELOOP},
		{"a link through /proc/self/root is refused", dir + "/open/selfroot/etc/passwd", unix.ELOOP},
		{"/proc/self/fd itself is refused", "/proc/self/fd/2", unix.ELOOP},
		{"a symlink loop ends", dir + "/open/loop", unix.ELOOP},
		{".. above the root stays at the root", "/../../.." + dir + "/public", nil},
		{"a missing file is not found", dir + "/open/missing", unix.ENOENT},
	}
	for _, slow := range []bool{false, true} {
		name := "openat2"
		if slow {
			name = "user-space walk"
		}
		t.Run(name, func(t *testing.T) {
			if !slow && !haveOpenat2() {
				t.Skip("the kernel has no openat2")
			}
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					err := asUser(nobody, func() error {
						var fd int
						var err error
						if slow {
							root, _ := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
							fd, err = openSlow(root, tc.path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
							unix.Close(root)
						} else {
							fd, err = openIn(tc.path, unix.O_RDONLY, 0)
						}
						if err == nil {
							unix.Close(fd)
						}
						return err
					})
					if !errors.Is(err, tc.want) && !(tc.want == nil && err == nil) {
						t.Fatalf("open %s: %v, want %v", tc.path, err, tc.want)
					}
				})
			}
		})
	}
}

func TestTheAgentsOwnProcEntriesAreRecognized(t *testing.T) {
	var tid int
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		tid = unix.Gettid()
		<-done
		runtime.UnlockOSThread()
	}()
	for tid == 0 {
		runtime.Gosched()
	}
	defer close(done)
	for _, tc := range []struct {
		path string
		own  bool
	}{
		{"/proc/self/environ", true},
		{"/proc/" + strconv.Itoa(os.Getpid()) + "/status", true},
		{"/proc/" + strconv.Itoa(tid) + "/environ", true}, // a thread's own entry
		{"/proc/self/task/" + strconv.Itoa(tid) + "/status", true},
		{"/proc/1/status", os.Getpid() == 1},
		{"/proc/meminfo", false},
		{"/etc/passwd", false},
	} {
		fd, err := unix.Open(tc.path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatalf("open %s: %v", tc.path, err)
		}
		if got := ownProc(fd); got != tc.own {
			t.Errorf("ownProc(%s) = %v, want %v", tc.path, got, tc.own)
		}
		unix.Close(fd)
	}
}
