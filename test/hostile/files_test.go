package hostile

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// The files API (finding 4) acts for the trainer inside a sandbox whose
// user is nobody. Everything the sandbox's user prepares (symlinks to
// root-only files, to /proc links of the agent, .. and absolute links)
// must leave root-only files, the agent and the host as they were.

// nobodySandbox is a busybox sandbox whose default user is nobody, with a
// root-only /etc/shadow (busybox has none) and a root-only /root/secret.
func nobodySandbox(t *testing.T, rt string) *dsec.Sandbox {
	t.Helper()
	sb := create(t, client(t), dsec.CreateOptions{User: "nobody", Runtime: rt})
	asRoot(t, sb, `printf 'root:SECRET-HASH:19000:0:99999:7:::\n' > /etc/shadow && chmod 600 /etc/shadow &&
		mkdir -p /root && chmod 700 /root && echo root-only > /root/secret && chmod 600 /root/secret`)
	return sb
}

// asRoot runs a shell command as root in sb and fails t unless it exits 0.
func asRoot(t *testing.T, sb *dsec.Sandbox, cmd string) string {
	t.Helper()
	return runAs(t, sb, "root", cmd)
}

// asUser runs a shell command as the sandbox's default user (nobody).
func asUser(t *testing.T, sb *dsec.Sandbox, cmd string) string {
	t.Helper()
	return runAs(t, sb, "", cmd)
}

func runAs(t *testing.T, sb *dsec.Sandbox, user, cmd string) string {
	t.Helper()
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Argv: []string{"/bin/sh", "-c", cmd}, User: user})
	if err != nil {
		t.Fatalf("exec %q as %q: %v", cmd, user, err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("exec %q as %q: exit %d: %s%s", cmd, user, r.ExitCode, r.Stdout, r.Stderr)
	}
	return string(r.Stdout)
}

// mustBeDenied fails t unless err is a permission_denied error that is the
// task's (infra false) and names no host path.
func mustBeDenied(t *testing.T, what string, err error, dataDir string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want permission denied", what)
		return
	}
	if k := kindOf(err); k != "permission_denied" {
		t.Errorf("%s: %v (kind %q), want permission_denied", what, err, k)
	}
	if infraOf(err) {
		t.Errorf("%s: %v is marked infra; a path the user cannot touch is the task's failure", what, err)
	}
	if strings.Contains(err.Error(), dataDir) {
		t.Errorf("%s: the error %q names a host path", what, err)
	}
}

// digest is the SHA-256 of a host file ("missing" if it does not exist).
func digest(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return "missing"
	}
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

func marker(t *testing.T) string {
	var b [6]byte
	rand.Read(b[:])
	return "dsec-hostile-" + hex.EncodeToString(b[:])
}

func upload(t *testing.T, sb *dsec.Sandbox, path, content string) error {
	t.Helper()
	_, err := sb.WriteFile(ctxFor(t, time.Minute), path, strings.NewReader(content), 0)
	return err
}

func download(t *testing.T, sb *dsec.Sandbox, path string) (string, error) {
	t.Helper()
	var b bytes.Buffer
	_, err := sb.ReadFile(ctxFor(t, time.Minute), path, &b)
	return b.String(), err
}

const shadowLine = "root:SECRET-HASH:19000:0:99999:7:::\n"

func TestAnUploadThroughTheUsersSymlinkToShadowLeavesShadowAlone(t *testing.T) {
	eachRuntime(t, testAnUploadThroughTheUsersSymlinkToShadowLeavesShadowAlone)
}

func testAnUploadThroughTheUsersSymlinkToShadowLeavesShadowAlone(t *testing.T, rt string) {
	sb := nobodySandbox(t, rt)
	nb := newNeighbour(t)
	hostShadow := digest(t, "/etc/shadow")
	// The sandbox's user points the file the trainer will upload at
	// /etc/shadow.
	asUser(t, sb, "ln -s /etc/shadow /tmp/answer.txt")
	err := upload(t, sb, "/tmp/answer.txt", "root::0:0:99999:7:::\n")
	mustBeDenied(t, "upload to /tmp/answer.txt -> /etc/shadow", err, srv(t).DataDir)
	if got := asRoot(t, sb, "cat /etc/shadow"); got != shadowLine {
		t.Errorf("the sandbox's /etc/shadow is now %q", got)
	}
	if asRoot(t, sb, "stat -c %U:%a /etc/shadow") != "root:600\n" {
		t.Errorf("/etc/shadow changed owner or mode")
	}
	if digest(t, "/etc/shadow") != hostShadow {
		t.Errorf("the host's /etc/shadow changed")
	}
	// An upload the user may make still works, and the file is the user's.
	info, err := sb.WriteFile(ctxFor(t, time.Minute), "/tmp/mine.txt", strings.NewReader("ok"), 0)
	if err != nil {
		t.Fatalf("upload to /tmp/mine.txt: %v", err)
	}
	if info.Owner != "nobody" {
		t.Errorf("the trainer's upload is owned by %q, want the sandbox's user nobody", info.Owner)
	}
	nb.check(t)
}

func TestReadsOfRootOnlyFilesAreRefusedInANobodySandbox(t *testing.T) {
	eachRuntime(t, testReadsOfRootOnlyFilesAreRefusedInANobodySandbox)
}

func testReadsOfRootOnlyFilesAreRefusedInANobodySandbox(t *testing.T, rt string) {
	sb := nobodySandbox(t, rt)
	nb := newNeighbour(t)
	asUser(t, sb, "ln -s /etc/shadow /tmp/shadow-link")
	for _, p := range []string{"/etc/shadow", "/tmp/shadow-link", "/root/secret"} {
		got, err := download(t, sb, p)
		mustBeDenied(t, "read "+p, err, srv(t).DataDir)
		if strings.Contains(got, "SECRET") || strings.Contains(got, "root-only") {
			t.Errorf("read %s returned %q", p, got)
		}
	}
	_, err := sb.ListDir(ctxFor(t, time.Minute), "/root", 1)
	mustBeDenied(t, "list /root (mode 700)", err, srv(t).DataDir)
	_, err = sb.Stat(ctxFor(t, time.Minute), "/root/secret")
	mustBeDenied(t, "stat /root/secret", err, srv(t).DataDir)
	for _, p := range []string{"/etc/shadow", "/tmp/shadow-link"} {
		_, err = sb.ChangeMode(ctxFor(t, time.Minute), p, 0o644)
		mustBeDenied(t, "chmod "+p, err, srv(t).DataDir)
	}
	if got := runAs(t, sb, "root", "stat -c %a /etc/shadow"); strings.TrimSpace(got) == "644" {
		t.Errorf("/etc/shadow became readable")
	}

	// The plain HTTP file endpoint reaches the same node call.
	req, _ := http.NewRequest("GET", srv(t).URL+"/v1/sandboxes/"+sb.ID+"/files?path=/etc/shadow", nil)
	req.Header.Set("Authorization", "Bearer "+secret(keyA))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var body bytes.Buffer
	body.ReadFrom(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || strings.Contains(body.String(), "SECRET") {
		t.Errorf("GET /files?path=/etc/shadow: %d %q, want 403", resp.StatusCode, body.String())
	}
	// Reading as root, explicitly, is still possible for those who ask.
	nb.check(t)
}

func TestUploadsThroughProcLinksChangeNothingOutsideTheSandbox(t *testing.T) {
	eachRuntime(t, testUploadsThroughProcLinksChangeNothingOutsideTheSandbox)
}

func testUploadsThroughProcLinksChangeNothingOutsideTheSandbox(t *testing.T, rt string) {
	sb := nobodySandbox(t, rt)
	nb := newNeighbour(t)
	// The agent's stdio is a file on the host.
	initLog := filepath.Join(srv(t).DataDir, "sandboxes", sb.ID, "init.log")
	if _, err := os.Stat(initLog); err != nil {
		t.Fatalf("the agent's log on the host: %v", err)
	}
	before := digest(t, initLog)
	m := marker(t)
	asUser(t, sb, "ln -s /proc/1/fd/1 /tmp/out && ln -s /proc/1/fd/2 /tmp/err && ln -s /proc/self/root /tmp/selfroot && ln -s /proc/self/fd/1 /tmp/self1")
	for _, p := range []string{"/tmp/out", "/tmp/err", "/tmp/self1", "/proc/1/fd/1", "/proc/self/fd/2"} {
		err := upload(t, sb, p, m+"\n")
		mustBeDenied(t, "upload to "+p, err, srv(t).DataDir)
	}
	if after := digest(t, initLog); after != before {
		b, _ := os.ReadFile(initLog)
		t.Errorf("the agent's log file on the host changed: %q", b)
	}
	// Through the agent's root: a root-only place of the sandbox, and
	// nothing on the host.
	err := upload(t, sb, "/tmp/selfroot/etc/"+m, "x")
	mustBeDenied(t, "upload to /tmp/selfroot/etc/"+m, err, srv(t).DataDir)
	if out := asRoot(t, sb, "ls /etc"); strings.Contains(out, m) {
		t.Errorf("the upload through /proc/self/root wrote /etc/%s in the sandbox", m)
	}
	if _, err := os.Stat("/etc/" + m); err == nil {
		os.Remove("/etc/" + m)
		t.Errorf("the upload through /proc/self/root wrote /etc/%s on the host", m)
	}
	// The read direction: the agent's log and the agent's own /proc files.
	for _, p := range []string{"/tmp/out", "/proc/1/fd/1", "/proc/1/environ", "/tmp/selfroot/etc/shadow"} {
		got, err := download(t, sb, p)
		mustBeDenied(t, "read "+p, err, srv(t).DataDir)
		if got != "" {
			t.Errorf("read %s returned %q", p, got)
		}
	}
	nb.check(t)
}

func TestDotDotAndAbsoluteSymlinksStayInsideTheSandbox(t *testing.T) {
	eachRuntime(t, testDotDotAndAbsoluteSymlinksStayInsideTheSandbox)
}

func testDotDotAndAbsoluteSymlinksStayInsideTheSandbox(t *testing.T, rt string) {
	sb := nobodySandbox(t, rt)
	nb := newNeighbour(t)
	m := marker(t)
	hostShadow := digest(t, "/etc/shadow")
	asUser(t, sb, "mkdir -p /tmp/d/e && ln -s / /tmp/d/abs && ln -s ../../../../../../../etc /tmp/d/e/up")
	// Writes: through an absolute link, through .. in a link, and .. in
	// the path itself, into a root-only directory.
	for _, p := range []string{"/tmp/d/abs/etc/" + m, "/tmp/d/e/up/" + m, "/tmp/../../../../etc/" + m, "../../../../etc/" + m, "/tmp/d/abs/etc/shadow", "/tmp/d/e/up/shadow"} {
		err := upload(t, sb, p, "pwned\n")
		mustBeDenied(t, "upload to "+p, err, srv(t).DataDir)
	}
	if out := asRoot(t, sb, "ls /etc; cat /etc/shadow"); strings.Contains(out, m) || !strings.Contains(out, shadowLine) {
		t.Errorf("the sandbox's /etc changed: %s", out)
	}
	if _, err := os.Stat("/etc/" + m); err == nil {
		os.Remove("/etc/" + m)
		t.Errorf("an upload wrote /etc/%s on the host", m)
	}
	if digest(t, "/etc/shadow") != hostShadow {
		t.Errorf("the host's /etc/shadow changed")
	}
	// Reads: root-only files are refused; readable ones are the sandbox's,
	// not the host's.
	for _, p := range []string{"/tmp/d/abs/etc/shadow", "/tmp/d/e/up/shadow", "/tmp/../etc/shadow", "/tmp/d/abs/root/secret"} {
		got, err := download(t, sb, p)
		mustBeDenied(t, "read "+p, err, srv(t).DataDir)
		if got != "" {
			t.Errorf("read %s returned %q", p, got)
		}
	}
	hostPasswd, _ := os.ReadFile("/etc/passwd")
	for _, p := range []string{"/tmp/d/abs/etc/passwd", "/tmp/d/e/up/passwd", "/../../etc/passwd"} {
		got, err := download(t, sb, p)
		if err != nil {
			t.Errorf("read %s: %v", p, err)
			continue
		}
		if got == string(hostPasswd) || !strings.HasPrefix(got, "root:x:0:0:root:/root:/bin/sh\nnobody:") {
			t.Errorf("read %s returned %q, not the sandbox's /etc/passwd", p, got)
		}
	}
	// Where the user may write, links lead inside the sandbox.
	if err := upload(t, sb, "/tmp/d/abs/tmp/"+m, "inside\n"); err != nil {
		t.Fatalf("upload through the absolute link into /tmp: %v", err)
	}
	if got := asUser(t, sb, "cat /tmp/"+m+"; stat -c %U /tmp/"+m); got != "inside\nnobody\n" {
		t.Errorf("the upload through the absolute link gave %q", got)
	}
	nb.check(t)
}
