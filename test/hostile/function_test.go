package hostile

import (
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

var fnServer *dsectest.Server

// functionSrv is a server with the debian image (function workers need
// python3) and the two projects; its workers start with the first call.
func functionSrv(t *testing.T) *dsectest.Server {
	t.Helper()
	if testing.Short() {
		t.Skip("bootstraps debian")
	}
	if fnServer == nil {
		dsectest.Need(t)
		fnServer = dsectest.Start(shared, dsectest.Options{Images: []string{"debian", "busybox"}, APIKeys: []string{keyA, keyB}})
	}
	return fnServer
}

// fillTmp fills every place a call can write (/tmp, /var/tmp, /dev/shm and
// its own directory) until the disk is full, leaves a secret in /tmp, then
// holds it all until the other call has connected and hung up.
const fillTmp = `
import errno, os, socket, sys
total = 0
chunk = b"\0" * (16 << 20)
for d in ("/tmp", "/var/tmp", "/dev/shm", "."):
    for i in range(1000):
        try:
            with open(os.path.join(d, "fill%d" % i), "wb") as f:
                for _ in range(15):  # below the 256 MiB file size limit
                    f.write(chunk)
                    total += len(chunk)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG):
                raise
            break
open("/tmp/a-secret", "w").write("secret of the first call")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", PORT))
s.listen(1)
s.settimeout(90)
c, _ = s.accept()
c.settimeout(90)
c.recv(1)  # the other call hangs up when done
print("filled", total >> 20, "MiB")
`

// writeFiles waits until the first call is full, then writes a file in
// each place and looks for the first call's secret.
const writeFiles = `
import os, socket, time
deadline = time.time() + 90
while True:
    try:
        c = socket.create_connection(("127.0.0.1", PORT), timeout=1)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.05)
data = b"x" * (8 << 20)
for d in ("/tmp", "/var/tmp", "/dev/shm", "."):
    p = os.path.join(d, "mine.bin")
    with open(p, "wb") as f:
        f.write(data)
    assert os.path.getsize(p) == len(data), p
seen = [n for n in os.listdir("/tmp") if n != "mine.bin"]
time.sleep(3)  # the first call stays full while the neighbour is measured
c.close()
print("ok", seen)
`

func TestAFunctionCallThatFillsTmpDoesNotFailAnothersWrites(t *testing.T) {
	s := functionSrv(t)
	c := dsec.New(s.URL, dsec.WithAPIKey(secret(keyA)))
	// The neighbour is a sandbox of the other project on the same node.
	nb := &neighbour{sb: createOn(t, dsec.New(s.URL, dsec.WithAPIKey(secret(keyB))))}
	nb.p50(t)
	nb.before = nb.p50(t)
	// Warm the pool: both calls then land on the one worker it starts with.
	if r, err := c.RunCode(ctxFor(t, 3*time.Minute), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}); err != nil || r.Status != "success" {
		t.Fatalf("warm-up call: %v %v", r, err)
	}
	port := fmt.Sprint(20000 + mrand.IntN(20000))
	var wg sync.WaitGroup
	var filler, writer *dsecv1.RunCodeResult
	var fillErr, writeErr error
	wg.Add(2)
	go func() {
		defer wg.Done()
		filler, fillErr = c.RunCode(ctxFor(t, 3*time.Minute), &dsecv1.RunCodeRequest{Language: "python", Code: strings.ReplaceAll(fillTmp, "PORT", port), RunTimeoutS: 120, MaxOutputBytes: 4096})
	}()
	go func() {
		defer wg.Done()
		writer, writeErr = c.RunCode(ctxFor(t, 3*time.Minute), &dsecv1.RunCodeRequest{Language: "python", Code: strings.ReplaceAll(writeFiles, "PORT", port), RunTimeoutS: 120, MaxOutputBytes: 4096})
	}()
	time.Sleep(2 * time.Second) // the filler is at work
	nb.check(t)
	wg.Wait()
	if fillErr != nil || writeErr != nil {
		t.Fatalf("calls: %v, %v", fillErr, writeErr)
	}
	t.Logf("filler: %s %s %s", filler.Status, filler.Run.GetStdout(), lastLine(filler.Run.GetStderr()))
	if filler.Infra {
		t.Errorf("the filling call is infra: %v", filler)
	}
	if writer.Status != "success" || !strings.HasPrefix(writer.Run.GetStdout(), "ok []") {
		t.Errorf("the second call: %s infra=%v stdout %q stderr %q; want success, its writes done and nothing of the first call in its /tmp",
			writer.Status, writer.Infra, writer.Run.GetStdout(), lastLine(writer.Run.GetStderr()))
	}
	// And the next call on the worker has all the room again.
	r, err := c.RunCode(ctxFor(t, 3*time.Minute), &dsecv1.RunCodeRequest{Language: "bash", RunTimeoutS: 60,
		Code: `for d in /tmp /var/tmp /dev/shm .; do head -c 40000000 /dev/zero > $d/next.bin || exit 1; done; ls -A /tmp`})
	if err != nil || r.Status != "success" || r.Run.GetStdout() != "next.bin\n" {
		t.Errorf("the next call: %v %v", r, err)
	}
}

// TestFetchedFilesCannotLinkOutOfTheCall: fetch_files are read back by
// the agent after the run; the call's links must not make it read what the
// call could not (the agent's own /proc entries, root-only files of the
// worker).
func TestFetchedFilesCannotLinkOutOfTheCall(t *testing.T) {
	s := functionSrv(t)
	c := dsec.New(s.URL, dsec.WithAPIKey(secret(keyA)))
	nb := &neighbour{sb: createOn(t, dsec.New(s.URL, dsec.WithAPIKey(secret(keyB))))}
	nb.p50(t)
	nb.before = nb.p50(t)
	code := "import os\n" +
		"os.symlink('/proc/1', 'agent')\n" +
		"os.symlink('/etc', 'etc')\n" +
		"os.symlink('/', 'root')\n" +
		"os.mkdir('out')\n" +
		"os.symlink('../../../../../../etc', 'out/up')\n" +
		"open('mine.txt', 'w').write('mine')\n"
	fetch := []string{"agent/environ", "agent/cmdline", "etc/shadow", "root/etc/shadow", "out/up/shadow", "agent/root/etc/shadow", "mine.txt"}
	r, err := c.RunCode(ctxFor(t, 3*time.Minute), &dsecv1.RunCodeRequest{Language: "python", Code: code, FetchFiles: fetch})
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != "success" {
		t.Fatalf("the call: %v", r)
	}
	for name, b := range r.Files {
		if name != "mine.txt" {
			t.Errorf("fetched %s through the call's link: %q", name, clip(string(b)))
		}
	}
	if string(r.Files["mine.txt"]) != "mine" {
		t.Errorf("the call's own file: %q", r.Files["mine.txt"])
	}
	nb.check(t)
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}

// createOn makes a busybox sandbox with c (a client of another server than
// srv's).
func createOn(t *testing.T, c *dsec.Client) *dsec.Sandbox {
	t.Helper()
	sb, err := c.Create(ctxFor(t, 2*time.Minute), dsec.CreateOptions{Image: "busybox", TTL: 10 * time.Minute})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}
