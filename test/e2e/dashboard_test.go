package e2e

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// artifacts is where tests keep what a person may want to look at after a
// run (the dashboard's screenshots): $DSEC_TEST_ARTIFACTS, else the
// repository's .dsec/artifacts (CI keeps .dsec).
func artifacts(t *testing.T, sub string) string {
	dir := os.Getenv("DSEC_TEST_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join("..", "..", ".dsec", "artifacts")
	}
	dir = filepath.Join(dir, sub)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// newBrowser starts the distribution's headless Chromium for the test. Its
// profile and the singleton socket it makes under TMPDIR live in a
// directory of the test's, removed at its end, so nothing of it is left in
// the host's /tmp (a short name: the socket's path must fit a sockaddr).
func newBrowser(t *testing.T, ctx context.Context, chromium string) context.Context {
	dir, err := os.MkdirTemp("", "dsec-chromium-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	alloc, cancel := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1280, 900),
		chromedp.UserDataDir(filepath.Join(dir, "profile")), chromedp.Env("TMPDIR="+dir))...)
	t.Cleanup(cancel)
	browser, cancel := chromedp.NewContext(alloc)
	t.Cleanup(cancel)
	return browser
}

// TestTheDashboardShowsASandboxInAHeadlessBrowser signs in to the
// dashboard in the distribution's Chromium, as a person would, and clicks
// through to a sandbox: its spec, its trajectory log and its use charts.
func TestTheDashboardShowsASandboxInAHeadlessBrowser(t *testing.T) {
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium is not installed (scripts/setup.sh installs it): ", err)
	}
	srv := dsectest.Start(t, dsectest.Options{APIKeys: []string{"dash=dash-key-0123456789"}, Args: []string{"--sample-every", "1s"}})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	sb := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "dash"}})
	if _, err := sb.Exec(ctx, dsec.Cmd("echo hello-from-the-log")); err != nil {
		t.Fatal(err)
	}

	// The pages are public; the data is not.
	if resp, err := http.Get(srv.URL + "/ui/"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /ui/: %v %v", resp, err)
	}
	resp, err := http.Post(srv.URL+"/dsec.v1.LifecycleService/ListSandboxes", "application/json", strings.NewReader("{}"))
	if err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("the dashboard's data without a key: %v %v, want 401", resp, err)
	}

	browser := newBrowser(t, ctx, chromium)
	dir := artifacts(t, "dashboard")
	do := func(steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(browser, steps...); err != nil {
			t.Fatalf("the browser: %v", err)
		}
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("the browser: text of %s: %v", sel, err)
		}
		return s
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("the browser: screenshot: %v", err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A wrong key is refused on the sign-in form.
	do(chromedp.Navigate(srv.URL+"/ui/"), chromedp.WaitVisible(chromedp.ID("key")),
		chromedp.SendKeys(chromedp.ID("key"), "not-a-key"), chromedp.Click(chromedp.ID("signin")))
	if _, err := chromedp.Run(browser, chromedp.Poll[bool](`document.getElementById("loginerror").textContent.length > 0`)); err != nil {
		t.Fatalf("the browser: no sign-in error: %v", err)
	}
	loginError := text("#loginerror")
	// The project's key signs in to the overview.
	do(chromedp.SetValue(chromedp.ID("key"), "dash-key-0123456789"), chromedp.Click(chromedp.ID("signin")),
		chromedp.WaitVisible(chromedp.ID("running")))
	shot("overview.png")
	// The sandboxes, filtered by label, lead to the sandbox's page.
	// (A change of the URL's fragment loads nothing: set it from the page.)
	if _, err := chromedp.Run(browser, chromedp.Evaluate[string](`location.hash = "#/sandboxes?labels=job%3Ddash"`)); err != nil {
		t.Fatalf("the browser: %v", err)
	}
	do(chromedp.WaitVisible(chromedp.CSS("#sandboxes tbody a")))
	rows := text("#sandboxes tbody")
	shot("sandboxes.png")
	do(chromedp.Click(chromedp.CSS("#sandboxes tbody a")), chromedp.WaitVisible(chromedp.ID("facts")),
		chromedp.WaitVisible(chromedp.CSS("#log tbody tr")))
	facts, log := text("#facts"), text("#log")
	// The charts come with the history's second sample.
	do(chromedp.WaitVisible(chromedp.ID("chart-cpu")), chromedp.WaitVisible(chromedp.ID("chart-memory")))
	shot("sandbox.png")
	if !strings.Contains(loginError, "refused") {
		t.Errorf("a wrong key: the sign-in form says %q", loginError)
	}
	if !strings.Contains(rows, sb.ID) {
		t.Errorf("the sandboxes table %q lacks %s", rows, sb.ID)
	}
	for _, want := range []string{sb.ID, "busybox", "running", "job=dash", "container"} {
		if !strings.Contains(facts, want) {
			t.Errorf("the sandbox's page %q lacks %q", facts, want)
		}
	}
	if !strings.Contains(log, "echo hello-from-the-log") || !strings.Contains(log, "exit 0") {
		t.Errorf("the trajectory log on the page: %q", log)
	}
	t.Logf("screenshots in %s", dir)
}
