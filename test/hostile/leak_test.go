package hostile

import (
	"context"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// The smaller findings: what the CLI, the files endpoint and the inside of
// a sandbox give away or hide.

func TestHelpPrintsNoAPIKey(t *testing.T) {
	s := srv(t)
	const key = "a-secret-key-nobody-may-print-0123"
	for _, args := range [][]string{{"--help"}, {"exec", "--help"}, {"create", "--help"}} {
		cmd := exec.Command(s.Bin, args...)
		cmd.Env = append(cmd.Environ(), "DSEC_API_KEY="+key)
		out, _ := cmd.CombinedOutput()
		if strings.Contains(string(out), key) {
			t.Errorf("dsec %s prints $DSEC_API_KEY", strings.Join(args, " "))
		}
	}
}

func TestExecSaysWhenItsOutputWasCut(t *testing.T) { eachRuntime(t, testExecSaysWhenItsOutputWasCut) }

func testExecSaysWhenItsOutputWasCut(t *testing.T, rt string) {
	s := srv(t)
	sb := create(t, client(t), dsec.CreateOptions{Runtime: rt})
	ctx := ctxFor(t, time.Minute)
	cmd := exec.CommandContext(ctx, s.Bin, "exec", sb.ID, "--", "sh", "-c", "head -c 3000000 /dev/zero")
	cmd.Env = append(cmd.Environ(), "DSEC_URL="+s.URL, "DSEC_API_KEY="+secret(keyA))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("dsec exec: %v\n%s", err, stderr.String())
	}
	if len(out) >= 3000000 {
		t.Skipf("the output was not cut (%d bytes)", len(out))
	}
	if !strings.Contains(stderr.String(), "truncated") {
		t.Errorf("dsec exec printed %d of 3000000 bytes and said nothing on stderr (%q)", len(out), stderr.String())
	}
}

func TestAFileReadThatFailsIsNeverAShortSuccess(t *testing.T) {
	eachRuntime(t, testAFileReadThatFailsIsNeverAShortSuccess)
}

func testAFileReadThatFailsIsNeverAShortSuccess(t *testing.T, rt string) {
	s := srv(t)
	sb := create(t, client(t), dsec.CreateOptions{Runtime: rt})
	ctx := ctxFor(t, time.Minute)
	// Each opens, then fails to read: a directory, and memory at address
	// 0 (a range read, so no length is declared up front).
	for _, q := range []string{"path=/etc", "path=/proc/1/mem&max_bytes=64", "path=/proc/self/mem&max_bytes=64"} {
		req, _ := http.NewRequestWithContext(ctx, "GET", s.URL+"/v1/sandboxes/"+sb.ID+"/files?"+q, nil)
		req.Header.Set("Authorization", "Bearer "+secret(keyA))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			continue // broken off: not taken for a file
		}
		body, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && rerr == nil {
			t.Errorf("GET %s: 200 with %d bytes and no error", q, len(body))
		}
	}
}

func TestTheInsideNamesNoHostPath(t *testing.T) { eachRuntime(t, testTheInsideNamesNoHostPath) }

func testTheInsideNamesNoHostPath(t *testing.T, rt string) {
	s := srv(t)
	sb := create(t, client(t), dsec.CreateOptions{Runtime: rt})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := sb.Exec(ctx, dsec.Cmd("cat /proc/self/mountinfo /proc/1/mountinfo"))
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("read mountinfo: %v %v", err, r)
	}
	info := string(r.Stdout)
	for what, p := range map[string]string{
		"the data directory":       s.DataDir,
		"the binaries' directory":  filepath.Dir(s.Bin),
		"the node's run directory": "/run/dsec",
	} {
		if strings.Contains(info, p) {
			t.Errorf("/proc/self/mountinfo inside a sandbox names %s (%s):\n%s", what, p, info)
		}
	}
}

// TestExecAsRootInANobodySandbox: `dsec exec ID -u root` in a sandbox whose
// user is nobody runs as root, and a command that cannot start says why
// (it used to exit 127 with no output and no message).
func TestExecAsRootInANobodySandbox(t *testing.T) { eachRuntime(t, testExecAsRootInANobodySandbox) }

func testExecAsRootInANobodySandbox(t *testing.T, rt string) {
	s := srv(t)
	sb := create(t, client(t), dsec.CreateOptions{Runtime: rt, User: "nobody"})
	ctx := ctxFor(t, time.Minute)
	run := func(args ...string) (string, string, int) {
		cmd := exec.CommandContext(ctx, s.Bin, args...)
		cmd.Env = append(cmd.Environ(), "DSEC_URL="+s.URL, "DSEC_API_KEY="+secret(keyA))
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		return out.String(), errOut.String(), code
	}
	for _, args := range [][]string{{"exec", sb.ID, "-u", "root", "id", "-u"}, {"exec", sb.ID, "-u", "0", "id", "-u"}} {
		if out, errOut, code := run(args...); code != 0 || out != "0\n" {
			t.Errorf("dsec %s: code %d, stdout %q, stderr %q; want uid 0", strings.Join(args, " "), code, out, errOut)
		}
	}
	if _, errOut, code := run("exec", sb.ID, "no-such-command"); code != 127 || !strings.Contains(errOut, "not found") {
		t.Errorf("a command that cannot start: code %d, stderr %q; want 127 and why", code, errOut)
	}
}
