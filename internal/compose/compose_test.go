package compose

import (
	"reflect"
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// A Harbor-style task: main kept alive by "sleep infinity", a web
// service under test with a health check, and a database it waits for.
const harborTask = `
services:
  main:
    image: debian
    command: ["sh", "-c", "sleep infinity"]
    environment:
      TASK: "1"
    working_dir: /app
    deploy:
      resources:
        limits: {cpus: "2", memory: 1g}
    depends_on:
      api:
        condition: service_healthy
  api:
    image: webapp
    command: python3 -m http.server 8080 --bind 127.0.0.1
    environment: ["DB=db:5432", "MODE=test"]
    healthcheck:
      test: ["CMD-SHELL", "wget -qO- http://localhost:8080/ || exit 1"]
      interval: 10s
      start_interval: 200ms
      start_period: 5s
      timeout: 2s
      retries: 5
    depends_on: [db]
    hostname: api.internal
    mem_limit: 256m
    expose: ["8080"]
  db:
    image: postgres
    networks:
      default:
        aliases: [database]
x-harbor: {anything: goes}
`

func TestParseHarborTask(t *testing.T) {
	f, err := Parse([]byte(harborTask))
	if err != nil {
		t.Fatal(err)
	}
	m := f.Main
	if m.Name != "main" || m.Image != "debian" || m.Workdir != "/app" || m.CPU != 2 || m.MemoryMB != 1024 || m.Env["TASK"] != "1" || len(m.Aliases) != 0 {
		t.Fatalf("main: %+v", m)
	}
	if len(f.Sidecars) != 2 {
		t.Fatalf("sidecars: %v", f.Sidecars)
	}
	api, db := f.Sidecars[0], f.Sidecars[1]
	if api.Name != "api" || db.Name != "db" {
		t.Fatalf("order: %s, %s", api.Name, db.Name)
	}
	if want := []string{"python3", "-m", "http.server", "8080", "--bind", "127.0.0.1"}; !reflect.DeepEqual(api.Command, want) || len(api.Entrypoint) != 0 {
		t.Fatalf("api command %q entrypoint %q", api.Command, api.Entrypoint)
	}
	if api.Env["DB"] != "db:5432" || api.Env["MODE"] != "test" {
		t.Fatalf("api env %v", api.Env)
	}
	hc := api.Healthcheck
	if want := []string{"/bin/sh", "-c", "wget -qO- http://localhost:8080/ || exit 1"}; !reflect.DeepEqual(hc.GetCommand(), want) ||
		hc.IntervalMs != 10000 || hc.StartIntervalMs != 200 || hc.StartPeriodMs != 5000 || hc.TimeoutMs != 2000 || hc.Retries != 5 {
		t.Fatalf("api healthcheck %v", hc)
	}
	if len(api.DependsOn) != 1 || api.DependsOn[0].Name != "db" || api.DependsOn[0].Condition != "started" {
		t.Fatalf("api depends_on %v", api.DependsOn)
	}
	if !reflect.DeepEqual(api.Aliases, []string{"api.internal"}) || api.Resources.GetMemoryMb() != 256 {
		t.Fatalf("api aliases %v resources %v", api.Aliases, api.Resources)
	}
	if db.Image != "postgres" || len(db.Command) != 0 || !reflect.DeepEqual(db.Aliases, []string{"database"}) || db.Healthcheck != nil || db.Resources != nil {
		t.Fatalf("db %v", db)
	}

	spec := &dsecv1.SandboxSpec{TtlS: 60}
	if err := Apply(f, spec); err != nil {
		t.Fatal(err)
	}
	if spec.Image != "debian" || spec.Workdir != "/app" || spec.Resources.Cpu != 2 || len(spec.Sidecars) != 2 || spec.TtlS != 60 {
		t.Fatalf("applied: %v", spec)
	}
	if err := Apply(f, &dsecv1.SandboxSpec{Image: "other"}); err == nil || !strings.Contains(err.Error(), "image") {
		t.Fatalf("spec and file both giving the image: %v", err)
	}
	// A main service without an image takes the spec's (Harbor builds the
	// main image); its environment goes over the spec's.
	f, err = Parse([]byte("services:\n  main:\n    environment: {A: file, C: c}\n    working_dir: /w\n  db:\n    image: pg\n"))
	if err != nil {
		t.Fatal(err)
	}
	spec = &dsecv1.SandboxSpec{Snapshot: "built", Env: map[string]string{"A": "image", "B": "b"}, Workdir: "/image"}
	if err := Apply(f, spec); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(spec.Env, map[string]string{"A": "file", "B": "b", "C": "c"}) || spec.Workdir != "/w" || spec.Snapshot != "built" || len(spec.Sidecars) != 1 {
		t.Fatalf("applied over a built main: %v", spec)
	}
	if err := Apply(f, &dsecv1.SandboxSpec{}); err == nil || !strings.Contains(err.Error(), "image: required") {
		t.Fatalf("no image anywhere: %v", err)
	}
}

// The main container is "main", else "client" (terminal-bench's), else
// the only service; its own name becomes an alias.
func TestMainService(t *testing.T) {
	f, err := Parse([]byte("services:\n  client:\n    image: a\n  redis:\n    image: b\n"))
	if err != nil {
		t.Fatal(err)
	}
	if f.Main.Name != "client" || !reflect.DeepEqual(f.Main.Aliases, []string{"client"}) || f.Sidecars[0].Name != "redis" {
		t.Fatalf("%+v %v", f.Main, f.Sidecars)
	}
	f, err = Parse([]byte("services:\n  app:\n    image: a\n    command: tail -f /dev/null\n"))
	if err != nil || f.Main.Name != "app" || len(f.Sidecars) != 0 {
		t.Fatalf("%v %+v", err, f)
	}
	if _, err := Parse([]byte("services:\n  a:\n    image: a\n  b:\n    image: b\n")); err == nil || !strings.Contains(err.Error(), "main") {
		t.Fatalf("two services, none main: %v", err)
	}
}

// Keys dsec cannot honour are refused by name, never dropped.
func TestRefusedKeys(t *testing.T) {
	for _, c := range []struct{ file, want string }{
		{"services:\n  main:\n    image: a\n    privileged: true\n", "services.main.privileged"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    build: .\n", "services.s.build"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    volumes: [\"./x:/y\"]\n", "services.s.volumes"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    restart: always\n", "services.s.restart"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    network_mode: host\n", "services.s.network_mode"},
		{"services:\n  main:\n    image: a\n    command: python app.py\n", "services.main.command"},
		{"services:\n  main:\n    image: a\n    healthcheck: {test: [CMD, \"true\"]}\n", "services.main.healthcheck"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    environment: [FOO]\n", "FOO has no value"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    deploy: {resources: {reservations: {devices: []}}}\n", "reservations"},
		{"services:\n  main:\n    image: a\nvolumes:\n  data:\n    external: true\n", "volumes.data.external"},
		{"services:\n  main:\n    image: a\n    volumes: [\"data:/d\"]\n", "not declared"},
		{"services:\n  main:\n    image: a\n    volumes: [\"/anon\"]\n", "anonymous"},
		{"services:\n  main:\n    image: a\n    volumes: [{type: tmpfs, target: /t}]\n", "type tmpfs"},
		{"services:\n  main:\n    image: a\nnetworks:\n  n:\n    internal: true\n", "networks.n.internal"},
		{"services:\n  main:\n    image: a\n  s:\n    image: b\n    depends_on: {main: {condition: service_healthy}}\n", "only started applies"},
		{"services:\n  main:\n    image: a\n  s: {}\n", "services.s.image: required"},
		{"servics: {}\n", "unknown top-level key"},
	} {
		_, err := Parse([]byte(c.file))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: got %v, want an error naming %q", c.file, err, c.want)
		}
	}
}

func TestHealthcheckForms(t *testing.T) {
	for _, c := range []struct {
		test string
		want []string
	}{
		{`["CMD", "pg_isready", "-U", "x"]`, []string{"pg_isready", "-U", "x"}},
		{`["CMD-SHELL", "curl -f localhost"]`, []string{"/bin/sh", "-c", "curl -f localhost"}},
		{`curl -f localhost`, []string{"/bin/sh", "-c", "curl -f localhost"}},
		{`["NONE"]`, nil},
	} {
		f, err := Parse([]byte("services:\n  main:\n    image: a\n  s:\n    image: b\n    healthcheck:\n      test: " + c.test + "\n"))
		if err != nil {
			t.Fatalf("%s: %v", c.test, err)
		}
		if got := f.Sidecars[0].Healthcheck.GetCommand(); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %q, want %q", c.test, got, c.want)
		}
	}
}

func TestSplit(t *testing.T) {
	for in, want := range map[string][]string{
		`a b  c`:                  {"a", "b", "c"},
		`sh -c 'echo "hi there"'`: {"sh", "-c", `echo "hi there"`},
		`echo "a \"b\" $c"`:       {"echo", `a "b" $c`},
		`a\ b c`:                  {"a b", "c"},
		`''`:                      {""},
	} {
		got, err := Split(in)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("Split(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := Split(`a 'b`); err == nil {
		t.Error("an unterminated quote was accepted")
	}
}

func TestInterpolate(t *testing.T) {
	env := map[string]string{"IMG": "debian", "EMPTY": ""}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	for in, want := range map[string]string{
		"image: ${IMG}":            "image: debian",
		"image: $IMG:1":            "image: debian:1",
		"${MISSING:-def}":          "def",
		"${EMPTY:-def}":            "def",
		"${EMPTY-def}":             "",
		"${MISSING-def}":           "def",
		"${IMG:+set}${MISSING+no}": "set",
		"price: $$5 and $${IMG}":   "price: $5 and ${IMG}",
		"${MISSING}":               "",
	} {
		got, err := Interpolate(in, lookup)
		if err != nil || got != want {
			t.Errorf("Interpolate(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := Interpolate("${MISSING:?set MISSING}", lookup); err == nil || !strings.Contains(err.Error(), "set MISSING") {
		t.Errorf("required variable: %v", err)
	}
	if _, err := Interpolate("${EMPTY?x}", lookup); err != nil {
		t.Errorf("${EMPTY?x} with EMPTY set: %v", err)
	}
}

func TestSizesAndDurations(t *testing.T) {
	for in, want := range map[string]int64{"512m": 512, "1g": 1024, "1.5G": 1536, "1048576": 1, "2048kb": 2, "100": 1} {
		if got, err := megabytes(in); err != nil || got != want {
			t.Errorf("megabytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	if _, err := megabytes("lots"); err == nil {
		t.Error(`megabytes("lots") accepted`)
	}
	if ms, err := millis("1m30s"); err != nil || ms != 90000 {
		t.Errorf("millis(1m30s) = %d, %v", ms, err)
	}
}

// YAML 1.2, as Compose reads it: yes, no, on and off stay strings.
func TestYAMLCoreSchema(t *testing.T) {
	f, err := Parse([]byte("services:\n  main:\n    image: a\n    environment:\n      DEBUG: yes\n      MODE: off\n"))
	if err != nil {
		t.Fatal(err)
	}
	if e := f.Main.Env; e["DEBUG"] != "yes" || e["MODE"] != "off" {
		t.Fatalf("environment %v", e)
	}
}

// Files laid over one another merge as docker compose -f merges them:
// Harbor's job-level extra_docker_compose adds a sidecar and changes the
// main service's environment.
func TestOverrides(t *testing.T) {
	base := "services:\n  main:\n    image: a\n    environment: [A=1, B=2]\n    depends_on: [db]\n  db:\n    image: pg\n    command: [postgres]\n    expose: [\"5432\"]\n"
	over := "services:\n  main:\n    environment: {B: over, C: \"3\"}\n    depends_on:\n      mcp: {condition: service_healthy}\n  db:\n    command: postgres -c fsync=off\n    expose: [\"5432\", \"5433\"]\n  mcp:\n    image: mcp-server\n    healthcheck: {test: [CMD, \"true\"]}\n"
	f, err := Parse([]byte(base), []byte(over))
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"A": "1", "B": "over", "C": "3"}; !reflect.DeepEqual(f.Main.Env, want) {
		t.Fatalf("main env %v", f.Main.Env)
	}
	if len(f.Sidecars) != 2 || f.Sidecars[0].Name != "db" || f.Sidecars[1].Name != "mcp" {
		t.Fatalf("sidecars %v", f.Sidecars)
	}
	if want := []string{"postgres", "-c", "fsync=off"}; !reflect.DeepEqual(f.Sidecars[0].Command, want) {
		t.Fatalf("db command %q", f.Sidecars[0].Command)
	}
	if _, err := Parse([]byte(base), []byte("services: {oops\n")); err == nil || !strings.Contains(err.Error(), "override 1") {
		t.Fatalf("a broken override: %v", err)
	}
}

// Named volumes between services become the sandbox's shared volumes,
// mounted where each service says.
func TestNamedVolumes(t *testing.T) {
	f, err := Parse([]byte("services:\n  main:\n    image: a\n    volumes: [\"data:/data:ro\"]\n  w:\n    image: b\n    volumes:\n      - {type: volume, source: data, target: /out}\nvolumes:\n  data:\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Shared) != 1 || f.Shared[0].Name != "data" {
		t.Fatalf("shared %v", f.Shared)
	}
	if m := f.Main.Volumes; len(m) != 1 || m[0].Name != "data" || m[0].Path != "/data" || !m[0].ReadOnly {
		t.Fatalf("main mounts %v", m)
	}
	if m := f.Sidecars[0].Volumes; len(m) != 1 || m[0].Path != "/out" || m[0].ReadOnly {
		t.Fatalf("sidecar mounts %v", m)
	}
	spec := &dsecv1.SandboxSpec{}
	if err := Apply(f, spec); err != nil || len(spec.SharedVolumes) != 1 || len(spec.Volumes) != 1 {
		t.Fatalf("applied: %v %v", spec, err)
	}
}
