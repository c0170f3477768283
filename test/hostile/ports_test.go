package hostile

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// The E2B facade's data plane beyond envd: signed /files URLs, which name
// no sandbox when the SDK builds them on E2B_SANDBOX_URL (the facade finds
// the sandbox by the signature), and sandbox ports, reached by sandbox ID
// and, for sandboxes created with allowPublicTraffic false, only with that
// sandbox's traffic token.

// e2bSandbox is a sandbox created through the E2B facade.
type e2bSandbox struct {
	ID      string `json:"sandboxID"`
	Access  string `json:"envdAccessToken"`
	Traffic string `json:"trafficAccessToken"`
}

// e2bCreate creates a busybox sandbox through the E2B facade with key's
// project and network config nw (nil: none), killed at the test's end.
func e2bCreate(t *testing.T, key string, nw map[string]any) e2bSandbox {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"templateID": "busybox", "timeout": 600, "network": nw})
	req, _ := http.NewRequestWithContext(ctxFor(t, 2*time.Minute), "POST", srv(t).URL+"/sandboxes", strings.NewReader(string(body)))
	req.Header.Set("X-API-Key", secret(key))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("E2B create: %d %s", resp.StatusCode, b)
	}
	var sb e2bSandbox
	if err := json.Unmarshal(b, &sb); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { clientFor(t, key).Delete(ctxFor(t, time.Minute), sb.ID) })
	return sb
}

// sign is the SDK's signature of a /files URL (getSignature).
func sign(path, op, user, token, exp string) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if exp != "" {
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

// call sends a request to the server with headers, and returns the status
// and body.
func call(t *testing.T, method, path string, headers map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctxFor(t, time.Minute), method, srv(t).URL+path, strings.NewReader("x"))
	for k, v := range headers {
		if k == "Host" {
			req.Host = v // a <port>-<id>.<domain> name: the server has no domain, so any routes
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestASignedFileURLOpensOnlyItsOwnSandbox(t *testing.T) {
	a1 := e2bCreate(t, keyA, nil)
	a2 := e2bCreate(t, keyA, nil)
	b1 := e2bCreate(t, keyB, nil)
	for _, sb := range []struct {
		s   e2bSandbox
		key string
	}{{a1, keyA}, {a2, keyA}, {b1, keyB}} {
		w := clientFor(t, sb.key).Sandbox(sb.s.ID)
		if _, err := w.WriteFile(ctxFor(t, time.Minute), "/tmp/secret.txt", strings.NewReader("secret of "+sb.s.ID), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	q := func(path, op, token string, exp string) string {
		v := url.Values{"path": {path}, "signature": {sign(path, op, "", token, exp)}}
		if exp != "" {
			v.Set("signature_expiration", exp)
		}
		return "/files?" + v.Encode()
	}
	later := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)
	own := q("/tmp/secret.txt", "read", a1.Access, later)

	t.Run("the URL reads its own sandbox's file without naming it", func(t *testing.T) {
		code, body := call(t, "GET", own, nil)
		if code != 200 || body != "secret of "+a1.ID {
			t.Fatalf("A1's signed URL: %d %q, want A1's file", code, body)
		}
	})
	t.Run("the URL aimed at another sandbox of the project or of another project is refused", func(t *testing.T) {
		for _, other := range []e2bSandbox{a2, b1} {
			code, body := call(t, "GET", own, map[string]string{"E2b-Sandbox-Id": other.ID, "E2b-Sandbox-Port": "49983"})
			if code != http.StatusUnauthorized || strings.Contains(body, "secret of") {
				t.Fatalf("A1's signed URL with E2b-Sandbox-Id %s: %d %q", other.ID, code, body)
			}
			code, body = call(t, "GET", own+"&x=1", map[string]string{"Host": "49983-" + other.ID + ".e2b.test"})
			if strings.Contains(body, "secret of "+other.ID) {
				t.Fatalf("A1's signed URL by host name of %s read its file: %d", other.ID, code)
			}
		}
	})
	t.Run("a tampered, expired, reused or write-for-read URL is refused", func(t *testing.T) {
		past := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
		for name, path := range map[string]string{
			"another path under the same signature":   strings.Replace(own, "secret.txt", "other.txt", 1),
			"a later expiry under the same signature": strings.Replace(own, later, strconv.FormatInt(time.Now().Add(48*time.Hour).Unix(), 10), 1),
			"an expired signature":                    q("/tmp/secret.txt", "read", a1.Access, past),
			"a signature made with a guessed token":   q("/tmp/secret.txt", "read", a1.Traffic, later),
			"a signature made with B1's token":        q("/tmp/secret.txt", "read", b1.Access+"x", later),
		} {
			code, body := call(t, "GET", path, nil)
			if code != http.StatusUnauthorized || strings.Contains(body, "secret of") {
				t.Errorf("%s: %d %q, want 401", name, code, body)
			}
		}
		code, _ := call(t, "POST", own, map[string]string{"Content-Type": "application/octet-stream"})
		if code != http.StatusUnauthorized {
			t.Errorf("a read URL used to upload: %d, want 401", code)
		}
		code, body := call(t, "GET", "/files?path=/tmp/secret.txt", nil)
		if code < 400 || strings.Contains(body, "secret of") {
			t.Errorf("no signature at all: %d %q", code, body)
		}
	})
}

func TestProjectACannotReachProjectBsPrivatePorts(t *testing.T) {
	a1 := e2bCreate(t, keyA, map[string]any{"allowPublicTraffic": false})
	b1 := e2bCreate(t, keyB, map[string]any{"allowPublicTraffic": false})
	bs := clientFor(t, keyB).Sandbox(b1.ID)
	if r, err := bs.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: "mkdir -p /tmp/www && echo private page > /tmp/www/index.html && busybox httpd -p 8080 -h /tmp/www"}); err != nil || r.ExitCode != 0 {
		t.Fatalf("start httpd: %v %v", r, err)
	}
	nb := newNeighbour(t)
	forms := map[string]func(h map[string]string) (int, string){
		"by header": func(h map[string]string) (int, string) {
			h["E2b-Sandbox-Id"], h["E2b-Sandbox-Port"] = b1.ID, "8080"
			return call(t, "GET", "/index.html", h)
		},
		"by path": func(h map[string]string) (int, string) {
			return call(t, "GET", "/sandboxes/"+b1.ID+"/ports/8080/index.html", h)
		},
		"by host name": func(h map[string]string) (int, string) {
			h["Host"] = "8080-" + b1.ID + ".e2b.test"
			return call(t, "GET", "/index.html", h)
		},
	}
	for form, get := range forms {
		t.Run(form, func(t *testing.T) {
			for name, h := range map[string]map[string]string{
				"no credential":                        {},
				"A's API key":                          {"X-API-Key": secret(keyA), "Authorization": "Bearer " + secret(keyA)},
				"A1's traffic token":                   {"E2b-Traffic-Access-Token": a1.Traffic},
				"A1's envd access token":               {"X-Access-Token": a1.Access},
				"B1's envd access token (not traffic)": {"E2b-Traffic-Access-Token": b1.Access},
			} {
				code, body := get(h)
				if code != http.StatusForbidden || strings.Contains(body, "private page") {
					t.Errorf("%s: %d %q, want 403", name, code, body)
				}
			}
			code, body := get(map[string]string{"E2b-Traffic-Access-Token": b1.Traffic})
			if code != 200 || body != "private page\n" {
				t.Fatalf("B1's own traffic token: %d %q, want the page", code, body)
			}
		})
	}
	nb.check(t)
}
