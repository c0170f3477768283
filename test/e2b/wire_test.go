package e2b_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/dsec/api/e2b/filesystem"
	"github.com/opendsec/dsec/api/e2b/filesystem/filesystemconnect"
	"github.com/opendsec/dsec/api/e2b/process"
	"github.com/opendsec/dsec/api/e2b/process/processconnect"
	"github.com/opendsec/dsec/internal/dsectest"
)

// The wire, without the SDKs: status codes and error bodies for bad input,
// as the SDKs' error mapping reads them, and Host-name routing.

type created struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken string  `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func do(t *testing.T, method, url string, header map[string]string, body []byte) response {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := http.DefaultClient.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return response{resp.StatusCode, resp.Header, b}
}

// wantE2BError checks E2B's REST error body: {"code": <status>, "message"}.
func wantE2BError(t *testing.T, r response, status int) {
	t.Helper()
	var body struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if r.status != status || json.Unmarshal(r.body, &body) != nil || body.Code != status || body.Message == "" {
		t.Fatalf("got %d %s, want %d with {\"code\":%d,\"message\":...}", r.status, r.body, status, status)
	}
}

// wantConnectError checks a unary Connect error: a string code in the body.
func wantConnectError(t *testing.T, r response, status int, code string) {
	t.Helper()
	var body struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	if r.status != status || json.Unmarshal(r.body, &body) != nil || body.Code != code {
		t.Fatalf("got %d %s, want %d with code %q", r.status, r.body, status, code)
	}
}

func create(t *testing.T, s *dsectest.Server) created {
	t.Helper()
	r := do(t, "POST", s.URL+"/v2/sandboxes", map[string]string{"X-API-Key": apiKey}, []byte(`{"templateID":"base","timeout":300}`))
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var c created
	if err := json.Unmarshal(r.body, &c); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { do(t, "DELETE", s.URL+"/sandboxes/"+c.SandboxID, map[string]string{"X-API-Key": apiKey}, nil) })
	return c
}

// envdHeaders are the headers the SDKs send to envd.
func envdHeaders(c created, extra ...string) map[string]string {
	h := map[string]string{"E2b-Sandbox-Id": c.SandboxID, "E2b-Sandbox-Port": "49983", "X-Access-Token": c.EnvdAccessToken}
	for i := 0; i+1 < len(extra); i += 2 {
		if extra[i+1] == "" {
			delete(h, extra[i])
		} else {
			h[extra[i]] = extra[i+1]
		}
	}
	return h
}

// envelope frames one Connect streaming message.
func envelope(flags byte, payload []byte) []byte {
	b := make([]byte, 5, 5+len(payload))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], uint32(len(payload)))
	return append(b, payload...)
}

// streamEnd parses a Connect streaming response and returns its
// end-of-stream error code ("" when it ended cleanly) and the messages.
func streamEnd(t *testing.T, r response) (code string, msgs []string) {
	t.Helper()
	b := r.body
	for len(b) >= 5 {
		n := int(binary.BigEndian.Uint32(b[1:5]))
		if len(b) < 5+n {
			t.Fatalf("truncated envelope in %q", r.body)
		}
		if b[0]&2 != 0 {
			var end struct {
				Error *struct {
					Code string `json:"code"`
				} `json:"error"`
			}
			json.Unmarshal(b[5:5+n], &end)
			if end.Error != nil {
				return end.Error.Code, msgs
			}
			return "", msgs
		}
		msgs = append(msgs, string(b[5:5+n]))
		b = b[5+n:]
	}
	t.Fatalf("stream without an end message: %d %q", r.status, r.body)
	return "", nil
}

func TestControlPlaneErrors(t *testing.T) {
	s := server(t)
	key := map[string]string{"X-API-Key": apiKey}
	c := create(t, s)
	tests := []struct {
		name   string
		method string
		path   string
		header map[string]string
		body   string
		status int
	}{
		{"a missing API key is 401", "POST", "/v2/sandboxes", nil, `{"templateID":"base"}`, 401},
		{"a wrong API key is 401", "GET", "/v2/sandboxes", map[string]string{"X-API-Key": "e2b_0123"}, "", 401},
		{"a bearer token is checked like X-API-Key", "GET", "/sandboxes/" + c.SandboxID, map[string]string{"Authorization": "Bearer e2b_0123"}, "", 401},
		{"an unknown sandbox is 404", "GET", "/sandboxes/aaaaaaaaaaaaaaaa-local", key, "", 404},
		{"a sandbox of an unknown node is 404", "DELETE", "/sandboxes/aaaaaaaaaaaaaaaa-elsewhere", key, "", 404},
		{"a malformed sandbox ID is 404", "POST", "/sandboxes/NOT_AN_ID/timeout", key, `{"timeout":10}`, 404},
		{"a body that is not JSON is 400", "POST", "/v2/sandboxes", key, `{"templateID":`, 400},
		{"an unknown template (image) is 404", "POST", "/v2/sandboxes", key, `{"templateID":"no-such-image"}`, 404},
		{"an unknown kind prefix is an image name, so 404", "POST", "/v2/sandboxes", key, `{"templateID":"quantum/base"}`, 404},
		{"a zero timeout is 400", "POST", "/sandboxes/" + c.SandboxID + "/timeout", key, `{"timeout":0}`, 400},
		{"a mount of an unknown volume is 404", "POST", "/v2/sandboxes", key, `{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}`, 404},
		{"a reserved metadata key is 400", "POST", "/v2/sandboxes", key, `{"templateID":"base","metadata":{"e2b.dev/template":"x"}}`, 400},
		{"an unknown list state is 400", "GET", "/v2/sandboxes?state=sleeping", key, "", 400},
		{"a forged next token is 400", "GET", "/v2/sandboxes?nextToken=***", key, "", 400},
		{"an unsupported call is 501", "GET", "/templates/base", key, "", 501},
		{"a snapshot of an unknown sandbox is 404", "POST", "/sandboxes/aaaaaaaaaaaaaaaa-local/snapshots", key, `{}`, 404},
		{"deleting an unknown snapshot is 404", "DELETE", "/templates/snap-aaaaaaaaaaaaaaaa-local", key, "", 404},
		{"a filesystem-only auto-pause with autoResume is 400", "POST", "/v2/sandboxes", key, `{"templateID":"base","autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}`, 400},
		{"autoResume without autoPause is 400", "POST", "/v2/sandboxes", key, `{"templateID":"base","autoResume":{"enabled":true}}`, 400},
		{"network rules for a sandbox without internet access are 400", "PUT", "/sandboxes/" + c.SandboxID + "/network", key, `{"allowOut":["pypi.org"]}`, 400},
		{"a domain name in denyOut is 400", "POST", "/v2/sandboxes", key, `{"templateID":"base","network":{"denyOut":["evil.test"]}}`, 400},
		{"a bad allowOut entry is 400", "POST", "/v2/sandboxes", key, `{"templateID":"base","network":{"allowOut":["not a host!"]}}`, 400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantE2BError(t, do(t, tt.method, s.URL+tt.path, tt.header, []byte(tt.body)), tt.status)
		})
	}
	t.Run("create answers 201 with what the SDKs read", func(t *testing.T) {
		if c.EnvdVersion != "0.6.4" || c.ClientID == "" || c.TemplateID != "base" || len(c.EnvdAccessToken) < 32 ||
			c.Domain == nil || *c.Domain != testDomain+":"+strconv.Itoa(domainPort) {
			t.Fatalf("create answered %+v", c)
		}
	})
	t.Run("network rules apply at create and change at runtime", func(t *testing.T) {
		r := do(t, "POST", s.URL+"/v2/sandboxes", key, []byte(`{"templateID":"base","network":{"denyOut":["0.0.0.0/0"],"allowOut":["pypi.org","1.1.1.1"]}}`))
		if r.status != http.StatusCreated {
			t.Fatalf("create: %d %s", r.status, r.body)
		}
		var n created
		json.Unmarshal(r.body, &n)
		defer do(t, "DELETE", s.URL+"/sandboxes/"+n.SandboxID, key, nil)
		for _, body := range []string{`{"allowOut":["*.pypi.org"],"denyOut":["0.0.0.0/0"]}`, `{"allowInternetAccess":false}`, `{}`} {
			if r := do(t, "PUT", s.URL+"/sandboxes/"+n.SandboxID+"/network", key, []byte(body)); r.status != http.StatusNoContent {
				t.Fatalf("update %s: %d %s", body, r.status, r.body)
			}
		}
	})
	t.Run("pausing twice is 409 the second time", func(t *testing.T) {
		if r := do(t, "POST", s.URL+"/sandboxes/"+c.SandboxID+"/pause", key, nil); r.status != 204 {
			t.Fatalf("pause: %d %s", r.status, r.body)
		}
		wantE2BError(t, do(t, "POST", s.URL+"/sandboxes/"+c.SandboxID+"/pause", key, nil), 409)
		if r := do(t, "POST", s.URL+"/v2/sandboxes/"+c.SandboxID+"/connect", key, []byte(`{"timeout":60}`)); r.status != 201 {
			t.Fatalf("connect to a paused sandbox: %d %s, want 201", r.status, r.body)
		}
		if r := do(t, "POST", s.URL+"/sandboxes/"+c.SandboxID+"/connect", key, []byte(`{"timeout":60}`)); r.status != 200 {
			t.Fatalf("connect to a running sandbox: %d %s, want 200", r.status, r.body)
		}
	})
	t.Run("killing twice is 204 then 404", func(t *testing.T) {
		d := create(t, s)
		if r := do(t, "DELETE", s.URL+"/sandboxes/"+d.SandboxID, key, nil); r.status != 204 {
			t.Fatalf("kill: %d %s", r.status, r.body)
		}
		wantE2BError(t, do(t, "DELETE", s.URL+"/sandboxes/"+d.SandboxID, key, nil), 404)
	})
}

func TestEnvdErrors(t *testing.T) {
	s := server(t)
	c := create(t, s)
	dead := create(t, s)
	do(t, "DELETE", s.URL+"/sandboxes/"+dead.SandboxID, map[string]string{"X-API-Key": apiKey}, nil)
	stat := s.URL + "/filesystem.Filesystem/Stat"
	start := s.URL + "/process.Process/Start"
	js := func(h map[string]string) map[string]string {
		h["Content-Type"], h["Connect-Protocol-Version"] = "application/json", "1"
		return h
	}
	stream := func(h map[string]string) map[string]string {
		h["Content-Type"] = "application/connect+json"
		return h
	}
	unary := []struct {
		name   string
		url    string
		header map[string]string
		body   string
		status int
		code   string
	}{
		{"a missing access token is unauthenticated", stat, js(envdHeaders(c, "X-Access-Token", "")), `{"path":"/"}`, 401, "unauthenticated"},
		{"another sandbox's token is unauthenticated", stat, js(envdHeaders(c, "X-Access-Token", dead.EnvdAccessToken)), `{"path":"/"}`, 401, "unauthenticated"},
		{"a request naming no sandbox is invalid", stat, js(envdHeaders(c, "E2b-Sandbox-Id", "")), `{"path":"/"}`, 400, "invalid_argument"},
		{"a killed sandbox is unavailable (the SDKs' TimeoutError)", stat, js(envdHeaders(dead)), `{"path":"/"}`, 503, "unavailable"},
		{"a missing file is not_found", stat, js(envdHeaders(c)), `{"path":"/no/such/file"}`, 404, "not_found"},
		{"JSON that does not fit the message is invalid_argument", stat, js(envdHeaders(c)), `{"path": 5}`, 400, "invalid_argument"},
		{"an unknown method is unimplemented", s.URL + "/filesystem.Filesystem/Chmod", js(envdHeaders(c)), `{}`, 501, "unimplemented"},
		{"the polling watcher RPCs are unimplemented", s.URL + "/filesystem.Filesystem/CreateWatcher", js(envdHeaders(c)), `{"path":"/tmp"}`, 501, "unimplemented"},
		{"signalling an unknown pid is not_found (kill returns false)", s.URL + "/process.Process/SendSignal", js(envdHeaders(c)), `{"process":{"pid":99999},"signal":"SIGNAL_SIGKILL"}`, 404, "not_found"},
		{"an unspecified signal is invalid_argument", s.URL + "/process.Process/SendSignal", js(envdHeaders(c)), `{"process":{"pid":1}}`, 400, "invalid_argument"},
	}
	for _, tt := range unary {
		t.Run(tt.name, func(t *testing.T) {
			wantConnectError(t, do(t, "POST", tt.url, tt.header, []byte(tt.body)), tt.status, tt.code)
		})
	}
	streams := []struct {
		name   string
		header map[string]string
		body   []byte
		code   string
	}{
		{"a truncated envelope is invalid_argument", stream(envdHeaders(c)), envelope(0, []byte(`{"process":{"cmd":"true"}}`))[:12], "invalid_argument"},
		{"an envelope holding bad JSON is invalid_argument", stream(envdHeaders(c)), envelope(0, []byte(`{"process":`)), "invalid_argument"},
		{"a Start without a command is invalid_argument", stream(envdHeaders(c)), envelope(0, []byte(`{}`)), "invalid_argument"},
		{"a stream without a token is unauthenticated", stream(envdHeaders(c, "X-Access-Token", "")), envelope(0, []byte(`{"process":{"cmd":"true"}}`)), "unauthenticated"},
		{"a stream to a killed sandbox is unavailable", stream(envdHeaders(dead)), envelope(0, []byte(`{"process":{"cmd":"true"}}`)), "unavailable"},
	}
	for _, tt := range streams {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, "POST", start, tt.header, tt.body)
			if code, _ := streamEnd(t, r); code != tt.code {
				t.Fatalf("stream ended with %q (%d %q), want %q", code, r.status, r.body, tt.code)
			}
		})
	}
	t.Run("a stream to an unknown method ends with unimplemented", func(t *testing.T) {
		r := do(t, "POST", s.URL+"/process.Process/Attach", stream(envdHeaders(c)), envelope(0, []byte(`{}`)))
		if code, _ := streamEnd(t, r); code != "unimplemented" {
			t.Fatalf("stream ended with %q (%d %q), want unimplemented", code, r.status, r.body)
		}
	})
	t.Run("a quiet stream carries keepalive events", func(t *testing.T) {
		if testing.Short() {
			t.Skip("waits for a keepalive (15 s)")
		}
		r := do(t, "POST", start, stream(envdHeaders(c)), envelope(0, []byte(`{"process":{"cmd":"sleep","args":["17"]},"stdin":false}`)))
		code, msgs := streamEnd(t, r)
		if code != "" || len(msgs) != 3 || !strings.Contains(msgs[1], `"keepalive"`) || !strings.Contains(msgs[2], `"end"`) {
			t.Fatalf("got code %q and events %q, want start, keepalive, end", code, msgs)
		}
	})
	t.Run("a well-formed Start streams start, data and end events", func(t *testing.T) {
		r := do(t, "POST", start, stream(envdHeaders(c)), envelope(0, []byte(`{"process":{"cmd":"/bin/sh","args":["-c","echo hi; exit 3"]},"stdin":false}`)))
		code, msgs := streamEnd(t, r)
		all := strings.Join(msgs, "\n")
		if code != "" || len(msgs) != 3 || !strings.Contains(msgs[0], `"start"`) || !strings.Contains(msgs[1], `"stdout":"aGkK"`) || !strings.Contains(msgs[2], `"exitCode":3`) {
			t.Fatalf("got code %q and events:\n%s", code, all)
		}
	})

	files := s.URL + "/files?path="
	restTests := []struct {
		name   string
		method string
		url    string
		header map[string]string
		body   string
		status int
	}{
		{"/files without a token is 401", "GET", files + "/etc/hostname", envdHeaders(c, "X-Access-Token", ""), "", 401},
		{"/files with a bad signature is 401", "GET", files + "/etc/hostname&signature=v1_forged", envdHeaders(c, "X-Access-Token", ""), "", 401},
		{"/files of a missing file is 404 (FileNotFoundError)", "GET", files + "/no/such/file", envdHeaders(c), "", 404},
		{"/files of a directory is 400", "GET", files + "/etc", envdHeaders(c), "", 400},
		{"/files of a killed sandbox is 502 (TimeoutError)", "GET", files + "/etc/hostname", envdHeaders(dead), "", 502},
		{"an upload without a file part is 400", "POST", files + "/tmp/x", envdHeaders(c, "Content-Type", "multipart/form-data; boundary=b"), "--b--\r\n", 400},
		{"/health of a killed sandbox is 502 (isRunning is false)", "GET", s.URL + "/health", envdHeaders(dead), "", 502},
		{"/execute without a token is 401", "POST", s.URL + "/execute", envdHeaders(c, "X-Access-Token", "", "E2b-Sandbox-Port", "49999"), `{"code":"1"}`, 401},
		{"/execute in a killed sandbox is 502 (TimeoutError)", "POST", s.URL + "/execute", envdHeaders(dead, "E2b-Sandbox-Port", "49999"), `{"code":"1"}`, 502},
		{"/execute of a body that is not JSON is 400", "POST", s.URL + "/execute", envdHeaders(c, "E2b-Sandbox-Port", "49999"), `{"code":`, 400},
		{"/execute in an unknown context is 404 (NotFoundError)", "POST", s.URL + "/execute", envdHeaders(c, "E2b-Sandbox-Port", "49999"), `{"code":"1","context_id":"nope"}`, 404},
		{"/execute in another language is 400", "POST", s.URL + "/execute", envdHeaders(c, "E2b-Sandbox-Port", "49999"), `{"code":"1","language":"r"}`, 400},
		{"/contexts with the traffic token of another sandbox is 401", "GET", s.URL + "/contexts", envdHeaders(c, "X-Access-Token", "", "E2b-Sandbox-Port", "49999", "E2B-Traffic-Access-Token", dead.TrafficAccessToken), "", 401},
	}
	for _, tt := range restTests {
		t.Run(tt.name, func(t *testing.T) {
			wantE2BError(t, do(t, tt.method, tt.url, tt.header, []byte(tt.body)), tt.status)
		})
	}
}

// TestHostRouting addresses a sandbox the way TLS deployments do, by
// <port>-<sandbox id>.<domain>, without the E2b-Sandbox-Id header.
func TestHostRouting(t *testing.T) {
	s := server(t)
	c := create(t, s)
	domain := testDomain + ":" + strconv.Itoa(domainPort) // the shared server's E2B domain
	host := "49983-" + c.SandboxID + "." + domain
	if r := do(t, "GET", s.URL+"/health", map[string]string{"Host": host}, nil); r.status != 204 {
		t.Fatalf("/health by host: %d %s", r.status, r.body)
	}
	hc := &http.Client{Transport: hostTransport{host: host}}
	auth := connect.WithInterceptors(connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("X-Access-Token", c.EnvdAccessToken)
			return next(ctx, req)
		}
	}))
	fs := filesystemconnect.NewFilesystemClient(hc, s.URL, connect.WithProtoJSON(), auth)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	info, err := fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/etc"}))
	if err != nil || info.Msg.GetEntry().GetType() != filesystem.FileType_FILE_TYPE_DIRECTORY {
		t.Fatalf("Stat by host: %v %v", info, err)
	}
	procs := processconnect.NewProcessClient(hc, s.URL, connect.WithProtoJSON(), auth)
	if _, err := procs.List(ctx, connect.NewRequest(&process.ListRequest{})); err != nil {
		t.Fatalf("List by host: %v", err)
	}
	other := "49983-aaaaaaaaaaaaaaaa-local." + domain
	if r := do(t, "GET", s.URL+"/health", map[string]string{"Host": other}, nil); r.status != 502 {
		t.Fatalf("/health of an unknown sandbox by host: %d, want 502", r.status)
	}
}

// hostTransport sends every request with a given Host.
type hostTransport struct{ host string }

func (h hostTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Host = h.host
	return http.DefaultTransport.RoundTrip(r)
}
