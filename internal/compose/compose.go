// Package compose turns a Compose file into a sandbox: the service that
// runs the agent becomes the sandbox's main container, every other one a
// sidecar (dsecv1.Sidecar) sharing its network namespace.
//
// The keys dsec honours are the ones RL task environments use (Harbor's
// and terminal-bench's compose tasks: image, command, entrypoint,
// environment, working_dir, user, healthcheck, depends_on, resource
// limits, names). Every other key is refused by name: a file whose
// meaning dsec would change is an error, never a sandbox that silently
// differs from what the file says. Extension keys (x-*) and keys that
// change nothing inside one network namespace (expose, ports' container
// side, restart "no", init, tty, stdin_open, labels, platform
// linux/amd64, pull_policy, stop_signal, stop_grace_period) are accepted.
//
// Variables (${VAR}, ${VAR:-default}, ...) are substituted by the caller
// first (Interpolate): the server never sees the client's environment.
package compose

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// Main is the main container as the file describes it: what goes into the
// sandbox's spec.
type Main struct {
	Name     string // the service's name
	Image    string
	Env      map[string]string
	Workdir  string
	User     string
	CPU      float64
	MemoryMB int64
	Pids     int64
	// Aliases are the service's other names (its own name if not "main",
	// hostname, container_name, network aliases).
	Aliases []string
	// Volumes are its mounts of the file's named volumes.
	Volumes []*dsecv1.VolumeMount
}

// File is a parsed Compose file.
type File struct {
	Main     Main
	Sidecars []*dsecv1.Sidecar
	// Shared are the file's named volumes: the sandbox's shared volumes.
	Shared []*dsecv1.SharedVolume
}

// mainNames are the service names taken as the main container, in order,
// when the file has more than one service: dsec's and Harbor's "main",
// terminal-bench's "client".
var mainNames = []string{"main", "client"}

// Parse reads a Compose file (YAML, variables already substituted), and
// the files laid over it in order, as `docker compose -f base -f over`
// merges them (Merge).
func Parse(data []byte, overrides ...[]byte) (*File, error) {
	top, err := load(data)
	if err != nil {
		return nil, err
	}
	for i, o := range overrides {
		over, err := load(o)
		if err != nil {
			return nil, errdefs.Invalid("compose override %d: %s", i+1, errdefs.Classify(err).Msg)
		}
		top = Merge(top, over)
	}
	return parse(top)
}

// load reads one file's YAML as Compose does: YAML 1.2's core schema
// (yes, no, on and off are strings, not booleans), through JSON so that
// numbers keep their text.
func load(data []byte) (map[string]any, error) {
	var doc any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, errdefs.Invalid("compose file: %v", err)
	}
	js, err := json.Marshal(doc)
	if err != nil {
		return nil, errdefs.Invalid("compose file: %v", err)
	}
	var top map[string]any
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	if err := dec.Decode(&top); err != nil || top == nil {
		return nil, errdefs.Invalid("compose file: not a mapping of top-level keys")
	}
	return top, nil
}

// Merge lays over on base as Compose merges files: mappings merge key by
// key, recursively; environment, labels and depends_on merge by name
// whichever form (list or mapping) each file writes them in; expose and
// ports add what is new; anything else (command, entrypoint, image, a
// health check's test, ...) over replaces. base is changed and returned.
func Merge(base, over map[string]any) map[string]any {
	for k, ov := range over {
		bv, ok := base[k]
		if !ok {
			base[k] = ov
			continue
		}
		switch k {
		case "environment", "labels":
			base[k] = mergeNamed(asMap(bv, "="), asMap(ov, "="))
			continue
		case "depends_on":
			base[k] = mergeNamed(asMap(bv, ""), asMap(ov, ""))
			continue
		case "expose", "ports":
			base[k] = union(bv, ov)
			continue
		}
		bm, bok := bv.(map[string]any)
		om, ook := ov.(map[string]any)
		if bok && ook {
			base[k] = Merge(bm, om)
			continue
		}
		base[k] = ov
	}
	return base
}

// asMap reads a list form (["K=V", "K"] with sep "=", or ["name"] with
// sep "") as a mapping; a mapping is returned as it is.
func asMap(v any, sep string) map[string]any {
	if m, ok := v.(map[string]any); ok {
		return m
	}
	out := map[string]any{}
	l, _ := v.([]any)
	for _, x := range l {
		s, _ := x.(string)
		if sep == "" {
			out[s] = map[string]any{"condition": "service_started"}
			continue
		}
		if k, val, ok := strings.Cut(s, sep); ok {
			out[k] = val
		} else {
			out[s] = nil
		}
	}
	return out
}

func mergeNamed(a, b map[string]any) map[string]any {
	for k, v := range b {
		am, aok := a[k].(map[string]any)
		bm, bok := v.(map[string]any)
		if aok && bok {
			a[k] = Merge(am, bm)
			continue
		}
		a[k] = v
	}
	return a
}

func union(a, b any) any {
	al, _ := a.([]any)
	bl, _ := b.([]any)
	seen := map[string]bool{}
	var out []any
	for _, x := range append(append([]any(nil), al...), bl...) {
		k := fmt.Sprint(x)
		if !seen[k] {
			seen[k] = true
			out = append(out, x)
		}
	}
	return out
}

func parse(top map[string]any) (*File, error) {
	for k, v := range top {
		switch {
		case k == "services", k == "version", k == "name", strings.HasPrefix(k, "x-"):
		case k == "networks":
			if err := checkNetworks(v); err != nil {
				return nil, err
			}
		case k == "volumes":
		case k == "secrets" || k == "configs":
			if m, ok := v.(map[string]any); !ok || len(m) > 0 {
				return nil, errdefs.Invalid("compose file: top-level %q is not supported: a sandbox's containers share no %s yet", k, k)
			}
		default:
			return nil, errdefs.Invalid("compose file: unknown top-level key %q", k)
		}
	}
	services, ok := top["services"].(map[string]any)
	if !ok || len(services) == 0 {
		return nil, errdefs.Invalid("compose file: no services")
	}
	mainName := ""
	if len(services) == 1 {
		for name := range services {
			mainName = name
		}
	} else {
		for _, n := range mainNames {
			if _, ok := services[n]; ok {
				mainName = n
				break
			}
		}
	}
	if mainName == "" {
		return nil, errdefs.Invalid("compose file: which service is the main container (where commands run)? Name it \"main\"")
	}
	names := make([]string, 0, len(services))
	for name := range services {
		names = append(names, name)
	}
	sort.Strings(names)
	f := &File{}
	declared := map[string]bool{}
	if vols, ok := top["volumes"]; ok && vols != nil {
		vm, ok := vols.(map[string]any)
		if !ok {
			return nil, errdefs.Invalid("compose file: volumes is not a mapping")
		}
		vnames := make([]string, 0, len(vm))
		for name := range vm {
			vnames = append(vnames, name)
		}
		sort.Strings(vnames)
		for _, name := range vnames {
			def, _ := vm[name].(map[string]any)
			for k, v := range def {
				switch {
				case k == "driver" && v == "local", k == "labels", k == "name", strings.HasPrefix(k, "x-"):
				default:
					return nil, errdefs.Invalid("compose file: volumes.%s.%s is not supported: a named volume is a file system of the sandbox alone, made empty at create (docs/sidecars.md)", name, k)
				}
			}
			declared[name] = true
			f.Shared = append(f.Shared, &dsecv1.SharedVolume{Name: name})
		}
	}
	for _, name := range names {
		raw, ok := services[name].(map[string]any)
		if !ok {
			return nil, errdefs.Invalid("compose file: service %q is not a mapping", name)
		}
		svc, err := parseService(name, raw, name == mainName)
		if err != nil {
			return nil, err
		}
		for _, m := range svc.volumes {
			if !declared[m.Name] {
				return nil, errdefs.Invalid("compose file: services.%s.volumes: volume %q is not declared in the top-level volumes", name, m.Name)
			}
		}
		if name == mainName {
			f.Main = svc.main()
			continue
		}
		f.Sidecars = append(f.Sidecars, svc.sidecar())
	}
	// Dependencies on the main container always hold: it starts first.
	for _, sc := range f.Sidecars {
		deps := sc.DependsOn[:0]
		for _, d := range sc.DependsOn {
			if d.Name == mainName {
				if d.Condition != "started" {
					return nil, errdefs.Invalid("compose file: service %q depends on %q being %s; the main container runs no service of its own, only started applies", sc.Name, mainName, d.Condition)
				}
				continue
			}
			deps = append(deps, d)
		}
		sc.DependsOn = deps
	}
	return f, nil
}

// service is one service's keys, as dsec reads them.
type service struct {
	name       string
	image      string
	command    []string
	entrypoint []string
	env        map[string]string
	workdir    string
	user       string
	cpu        float64
	memoryMB   int64
	pids       int64
	health     *dsecv1.HealthCheck
	deps       []*dsecv1.SidecarDependency
	aliases    []string
	volumes    []*dsecv1.VolumeMount
}

func (s *service) main() Main {
	aliases := s.aliases
	if s.name != "main" {
		aliases = append([]string{s.name}, aliases...)
	}
	return Main{Name: s.name, Image: s.image, Env: s.env, Workdir: s.workdir, User: s.user,
		CPU: s.cpu, MemoryMB: s.memoryMB, Pids: s.pids, Aliases: dedupe(aliases, "main"), Volumes: s.volumes}
}

func (s *service) sidecar() *dsecv1.Sidecar {
	sc := &dsecv1.Sidecar{
		Name: s.name, Image: s.image, Command: s.command, Entrypoint: s.entrypoint, Env: s.env,
		Workdir: s.workdir, User: s.user, Healthcheck: s.health, DependsOn: s.deps,
		Aliases: dedupe(s.aliases, s.name), Volumes: s.volumes,
	}
	if s.cpu != 0 || s.memoryMB != 0 || s.pids != 0 {
		sc.Resources = &dsecv1.Resources{Cpu: s.cpu, MemoryMb: s.memoryMB, Pids: s.pids}
	}
	return sc
}

// dedupe drops repeats and skip from names, keeping their order.
func dedupe(names []string, skip string) []string {
	seen := map[string]bool{skip: true}
	var out []string
	for _, n := range names {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}

// keepAlive are main-container commands that only keep a Docker container
// running (Harbor's "sleep infinity"): dsec's agent does that.
func keepAlive(argv []string) bool {
	switch strings.Join(argv, " ") {
	case "sleep infinity", "tail -f /dev/null", "sh -c sleep infinity", "/bin/sh -c sleep infinity",
		"bash -c sleep infinity", "/bin/bash -c sleep infinity":
		return true
	}
	return false
}

func parseService(name string, raw map[string]any, isMain bool) (*service, error) {
	s := &service{name: name}
	fail := func(key, format string, a ...any) error {
		return errdefs.Invalid("compose file: services.%s.%s: %s", name, key, fmt.Sprintf(format, a...))
	}
	keys := make([]string, 0, len(raw))
	for k := range raw {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := raw[k]
		var err error
		switch k {
		case "image":
			s.image, err = str(v)
		case "build":
			return nil, fail(k, "dsec builds no images from a compose file yet: import the image (dsec image import) and name it with image")
		case "command":
			s.command, err = words(v)
		case "entrypoint":
			s.entrypoint, err = words(v)
		case "environment":
			s.env, err = environment(v)
		case "env_file":
			return nil, fail(k, "not supported: put the variables in environment")
		case "volumes":
			s.volumes, err = serviceVolumes(v)
		case "working_dir":
			s.workdir, err = str(v)
		case "user":
			s.user, err = str(v)
		case "hostname", "container_name":
			var h string
			if h, err = str(v); err == nil {
				s.aliases = append(s.aliases, h)
			}
		case "networks":
			var a []string
			if a, err = serviceNetworks(v); err == nil {
				s.aliases = append(s.aliases, a...)
			}
		case "network_mode":
			var m string
			if m, err = str(v); err == nil && m != "bridge" && !(isMain && m == "none") {
				return nil, fail(k, "%q is not supported: a sandbox's containers share one network namespace, and the sandbox's network mode and policy say what leaves it", m)
			}
		case "healthcheck":
			if isMain {
				return nil, fail(k, "the main container runs no service of its own to check: run the check with exec once the sandbox is created")
			}
			s.health, err = healthcheck(v)
		case "depends_on":
			s.deps, err = dependsOn(v)
		case "deploy":
			err = s.deploy(v)
		case "cpus":
			err = s.limit("cpus", v)
		case "mem_limit":
			err = s.limit("memory", v)
		case "pids_limit":
			err = s.limit("pids", v)
		case "restart":
			var r string
			if r, err = str(v); err == nil && r != "no" {
				return nil, fail(k, "%q is not supported: a sidecar that exits stays exited (its status says so)", r)
			}
		case "platform":
			var p string
			if p, err = str(v); err == nil && p != "linux/amd64" && p != "linux/x86_64" && p != "amd64" {
				return nil, fail(k, "%q: this node runs linux/amd64", p)
			}
		case "expose", "ports", "init", "tty", "stdin_open", "labels", "pull_policy", "stop_signal", "stop_grace_period":
			// Nothing to do: every port is reachable from every container
			// (one network namespace), none is published on the host; the
			// agent is the container's init and reaps; labels, pulls and
			// stop signals change nothing in a sandbox.
		default:
			if strings.HasPrefix(k, "x-") {
				continue
			}
			return nil, fail(k, "not supported by dsec (see docs/sidecars.md for the keys it honours)")
		}
		if err != nil {
			return nil, fail(k, "%v", err)
		}
	}
	if s.image == "" && !isMain {
		return nil, fail("image", "required")
	}
	if isMain {
		argv := append(append([]string(nil), s.entrypoint...), s.command...)
		if len(argv) > 0 && !keepAlive(argv) {
			return nil, fail("command", "the main container runs dsec's agent, not a command of its own (%q): run it with exec once the sandbox is created", strings.Join(argv, " "))
		}
		s.command, s.entrypoint = nil, nil
	}
	return s, nil
}

// serviceVolumes reads a service's mounts of named volumes, short
// ("name:/path[:ro]") or long ({type: volume, source, target, read_only})
// syntax. Host paths (binds) and anonymous volumes are refused: a sandbox
// cannot see the caller's files, and a file system of its own is named.
func serviceVolumes(v any) ([]*dsecv1.VolumeMount, error) {
	l, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("not a list")
	}
	var out []*dsecv1.VolumeMount
	for _, x := range l {
		m := &dsecv1.VolumeMount{}
		switch x := x.(type) {
		case string:
			parts := strings.Split(x, ":")
			if len(parts) < 2 || len(parts) > 3 {
				return nil, fmt.Errorf("%q: anonymous volumes are not supported (name it, and declare it in the top-level volumes)", x)
			}
			m.Name, m.Path = parts[0], parts[1]
			if len(parts) == 3 {
				switch parts[2] {
				case "ro":
					m.ReadOnly = true
				case "rw":
				default:
					return nil, fmt.Errorf("%q: mode %q is not supported (ro or rw)", x, parts[2])
				}
			}
		case map[string]any:
			for k, val := range x {
				switch k {
				case "type":
					if val != "volume" {
						return nil, fmt.Errorf("type %v is not supported: only named volumes (type volume) are", val)
					}
				case "source":
					m.Name, _ = val.(string)
				case "target":
					m.Path, _ = val.(string)
				case "read_only":
					m.ReadOnly, _ = val.(bool)
				default:
					return nil, fmt.Errorf("%s: not supported", k)
				}
			}
		default:
			return nil, fmt.Errorf("an item is neither a string nor a mapping")
		}
		if m.Name == "" || strings.ContainsAny(m.Name[:1], "/.~$") || strings.Contains(m.Name, "/") {
			return nil, fmt.Errorf("%q is a host path: bind mounts are not supported (a sandbox cannot see the caller's files; use a named volume)", m.Name)
		}
		out = append(out, m)
	}
	return out, nil
}

func (s *service) deploy(v any) error {
	m, err := mapping(v, "")
	if err != nil {
		return err
	}
	for k, v := range m {
		switch k {
		case "resources":
			r, err := mapping(v, "resources")
			if err != nil {
				return err
			}
			for k, v := range r {
				switch k {
				case "limits":
					l, err := mapping(v, "resources.limits")
					if err != nil {
						return err
					}
					for k, v := range l {
						if err := s.limit(k, v); err != nil {
							return fmt.Errorf("resources.limits.%s: %v", k, err)
						}
					}
				case "reservations":
					return fmt.Errorf("resources.reservations: not supported (dsec limits; GPUs are not offered to containers here)")
				default:
					return fmt.Errorf("resources.%s: not supported", k)
				}
			}
		case "replicas":
			if n, err := number(v); err != nil || n != 1 {
				return fmt.Errorf("replicas: only 1")
			}
		case "restart_policy":
			return fmt.Errorf("restart_policy: not supported (a sidecar that exits stays exited)")
		default:
			return fmt.Errorf("%s: not supported", k)
		}
	}
	return nil
}

// limit sets one of the service's limits (cpus, memory, pids), written
// as deploy.resources.limits or as the older cpus, mem_limit, pids_limit.
func (s *service) limit(which string, v any) (err error) {
	switch which {
	case "cpus":
		s.cpu, err = number(v)
	case "memory":
		s.memoryMB, err = megabytes(v)
	case "pids":
		var p float64
		p, err = number(v)
		s.pids = int64(p)
	default:
		return fmt.Errorf("not supported")
	}
	return err
}

// mapping is v as a mapping, or an error naming what is not one.
func mapping(v any, what string) (map[string]any, error) {
	m, ok := v.(map[string]any)
	if !ok && what == "" {
		return nil, fmt.Errorf("not a mapping")
	}
	if !ok {
		return nil, fmt.Errorf("%s: not a mapping", what)
	}
	return m, nil
}

// checkNetworks accepts top-level network definitions that change nothing
// for one network namespace: plain ones, at most one of them internal
// (which is for the sandbox's network policy to say: refused).
func checkNetworks(v any) error {
	m, ok := v.(map[string]any)
	if !ok {
		return errdefs.Invalid("compose file: networks is not a mapping")
	}
	for name, def := range m {
		d, _ := def.(map[string]any)
		for k, v := range d {
			switch k {
			case "driver":
				if s, _ := v.(string); s != "bridge" {
					return errdefs.Invalid("compose file: networks.%s.driver %q is not supported (one network namespace per sandbox)", name, v)
				}
			case "name":
			default:
				return errdefs.Invalid("compose file: networks.%s.%s is not supported: a sandbox's containers share one network namespace; what leaves it is the sandbox's network mode and policy", name, k)
			}
		}
	}
	return nil
}

// serviceNetworks reads a service's networks: a list of names or a map of
// names to settings, of which aliases count.
func serviceNetworks(v any) ([]string, error) {
	switch v := v.(type) {
	case []any:
		return nil, nil
	case map[string]any:
		var aliases []string
		for name, set := range v {
			m, _ := set.(map[string]any)
			for k, x := range m {
				if k != "aliases" {
					return nil, fmt.Errorf("%s.%s: not supported", name, k)
				}
				a, err := strList(x)
				if err != nil {
					return nil, fmt.Errorf("%s.aliases: %v", name, err)
				}
				aliases = append(aliases, a...)
			}
		}
		sort.Strings(aliases)
		return aliases, nil
	}
	return nil, fmt.Errorf("not a list or mapping")
}

func healthcheck(v any) (*dsecv1.HealthCheck, error) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("not a mapping")
	}
	if d, _ := m["disable"].(bool); d {
		return nil, nil
	}
	hc := &dsecv1.HealthCheck{}
	for k, v := range m {
		var err error
		switch k {
		case "test":
			hc.Command, err = healthTest(v)
			if err == nil && hc.Command == nil {
				return nil, nil // NONE
			}
		case "interval":
			hc.IntervalMs, err = millis(v)
		case "timeout":
			hc.TimeoutMs, err = millis(v)
		case "start_period":
			hc.StartPeriodMs, err = millis(v)
		case "start_interval":
			hc.StartIntervalMs, err = millis(v)
		case "retries":
			var r float64
			r, err = number(v)
			hc.Retries = int32(r)
		case "disable":
		default:
			err = fmt.Errorf("%s: not supported", k)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %v", k, err)
		}
	}
	if len(hc.Command) == 0 {
		return nil, fmt.Errorf("test is required")
	}
	return hc, nil
}

// healthTest reads Docker's test forms: ["CMD", argv...],
// ["CMD-SHELL", command], a plain string (a shell command) and ["NONE"]
// (nil: no check).
func healthTest(v any) ([]string, error) {
	if s, ok := v.(string); ok {
		return []string{"/bin/sh", "-c", s}, nil
	}
	l, err := strList(v)
	if err != nil {
		return nil, err
	}
	if len(l) == 0 {
		return nil, fmt.Errorf("empty")
	}
	switch l[0] {
	case "NONE":
		return nil, nil
	case "CMD":
		if len(l) < 2 {
			return nil, fmt.Errorf("CMD without a command")
		}
		return l[1:], nil
	case "CMD-SHELL":
		if len(l) != 2 {
			return nil, fmt.Errorf("CMD-SHELL takes one command string")
		}
		return []string{"/bin/sh", "-c", l[1]}, nil
	}
	return nil, fmt.Errorf("%q: the first element is CMD, CMD-SHELL or NONE", l[0])
}

var conditions = map[string]string{
	"service_started":                "started",
	"service_healthy":                "healthy",
	"service_completed_successfully": "completed",
}

func dependsOn(v any) ([]*dsecv1.SidecarDependency, error) {
	var out []*dsecv1.SidecarDependency
	switch v := v.(type) {
	case []any:
		names, err := strList(v)
		if err != nil {
			return nil, err
		}
		for _, n := range names {
			out = append(out, &dsecv1.SidecarDependency{Name: n, Condition: "started"})
		}
	case map[string]any:
		for name, c := range v {
			d := &dsecv1.SidecarDependency{Name: name, Condition: "started"}
			m, _ := c.(map[string]any)
			for k, x := range m {
				switch k {
				case "condition":
					s, _ := x.(string)
					cond, ok := conditions[s]
					if !ok {
						return nil, fmt.Errorf("%s.condition %q (use service_started, service_healthy or service_completed_successfully)", name, x)
					}
					d.Condition = cond
				case "required":
					if r, _ := x.(bool); !r {
						return nil, fmt.Errorf("%s.required false is not supported (every service starts)", name)
					}
				case "restart":
				default:
					return nil, fmt.Errorf("%s.%s: not supported", name, k)
				}
			}
			out = append(out, d)
		}
		sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	default:
		return nil, fmt.Errorf("not a list or mapping")
	}
	return out, nil
}

func environment(v any) (map[string]string, error) {
	out := map[string]string{}
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			switch x := x.(type) {
			case nil:
				return nil, fmt.Errorf("%s has no value (variables from the caller's environment are substituted before the file is sent: write %s: ${%s})", k, k, k)
			case string:
				out[k] = x
			case json.Number:
				out[k] = x.String()
			case bool:
				out[k] = strconv.FormatBool(x)
			default:
				return nil, fmt.Errorf("%s: not a scalar", k)
			}
		}
	case []any:
		l, err := strList(v)
		if err != nil {
			return nil, err
		}
		for _, e := range l {
			k, val, ok := strings.Cut(e, "=")
			if !ok {
				return nil, fmt.Errorf("%s has no value (write %s=${%s})", e, e, e)
			}
			out[k] = val
		}
	default:
		return nil, fmt.Errorf("not a mapping or list")
	}
	return out, nil
}

func str(v any) (string, error) {
	switch v := v.(type) {
	case string:
		return v, nil
	case json.Number:
		return v.String(), nil
	}
	return "", fmt.Errorf("not a string")
}

func strList(v any) ([]string, error) {
	l, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("not a list")
	}
	out := make([]string, len(l))
	for i, x := range l {
		s, err := str(x)
		if err != nil {
			return nil, fmt.Errorf("item %d: %v", i, err)
		}
		out[i] = s
	}
	return out, nil
}

// words reads a command: a list, or a string split as a shell splits
// words (quotes and backslashes; no expansion), as Compose does.
func words(v any) ([]string, error) {
	if s, ok := v.(string); ok {
		return Split(s)
	}
	return strList(v)
}

// Split splits s into words as a POSIX shell would, without expansions.
func Split(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
				inWord = false
			}
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, fmt.Errorf("unterminated single quote")
			}
			cur.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case c == '"':
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '\\' && i+1 < len(s) && strings.IndexByte("\"\\$`\n", s[i+1]) >= 0 {
					i++
				}
				cur.WriteByte(s[i])
			}
			if i >= len(s) {
				return nil, fmt.Errorf("unterminated double quote")
			}
			inWord = true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			inWord = true
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}

func number(v any) (float64, error) {
	var f float64
	var err error
	switch v := v.(type) {
	case json.Number:
		f, err = v.Float64()
	case string:
		f, err = strconv.ParseFloat(v, 64)
	default:
		return 0, fmt.Errorf("not a number")
	}
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
		return 0, fmt.Errorf("%v is not a non-negative number", v)
	}
	return f, nil
}

var sizeRe = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)\s*([bkmg]?)b?$`)

// megabytes reads a Compose byte size (bytes as a number, or "512m",
// "1.5g", "1024kb") in MiB, rounded up.
func megabytes(v any) (int64, error) {
	var s string
	switch v := v.(type) {
	case json.Number:
		s = v.String()
	case string:
		s = strings.ToLower(strings.TrimSpace(v))
	default:
		return 0, fmt.Errorf("not a size")
	}
	m := sizeRe.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("%q is not a size (512m, 2g, ...)", s)
	}
	f, _ := strconv.ParseFloat(m[1], 64)
	mult := map[string]float64{"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m[2]]
	return int64(math.Ceil(f * mult / (1 << 20))), nil
}

// millis reads a Compose duration ("10s", "1m30s", "500ms") in
// milliseconds.
func millis(v any) (int64, error) {
	s, err := str(v)
	if err != nil {
		return 0, err
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%q is not a duration (10s, 1m30s, 500ms)", s)
	}
	return d.Milliseconds(), nil
}

// Apply makes spec the sandbox f describes. The file's main service says
// what a Compose service says over its image: its environment is added to
// the spec's (the file's entries win), its working directory, user and
// limits replace the spec's. The image comes from one of the two (a file
// whose main service has none takes the spec's image or snapshot, as
// Harbor's tasks do, whose main image Harbor builds). The sidecars and
// aliases are the file's.
func Apply(f *File, spec *dsecv1.SandboxSpec) error {
	m := f.Main
	switch {
	case m.Image != "" && (spec.Image != "" || spec.Snapshot != ""):
		return errdefs.Invalid("the compose file's main container (service %q) and the spec both name an image: name it in one of them", m.Name)
	case m.Image == "" && spec.Image == "" && spec.Snapshot == "":
		return errdefs.Invalid("compose file: services.%s.image: required (or give the spec an image)", m.Name)
	case m.Image != "":
		spec.Image = m.Image
	}
	if len(m.Env) > 0 {
		if spec.Env == nil {
			spec.Env = map[string]string{}
		}
		for k, v := range m.Env {
			spec.Env[k] = v
		}
	}
	if m.Workdir != "" {
		spec.Workdir = m.Workdir
	}
	if m.User != "" {
		spec.User = m.User
	}
	if m.CPU != 0 || m.MemoryMB != 0 || m.Pids != 0 {
		if spec.Resources == nil {
			spec.Resources = &dsecv1.Resources{}
		}
		r := spec.Resources
		if m.CPU != 0 {
			r.Cpu = m.CPU
		}
		if m.MemoryMB != 0 {
			r.MemoryMb = m.MemoryMB
		}
		if m.Pids != 0 {
			r.Pids = m.Pids
		}
	}
	if len(spec.Sidecars) > 0 || len(spec.SharedVolumes) > 0 {
		return errdefs.Invalid("give sidecars and shared volumes in the compose file or in the spec, not both")
	}
	spec.Aliases = append(spec.Aliases, m.Aliases...)
	spec.Sidecars = f.Sidecars
	spec.SharedVolumes = f.Shared
	spec.Volumes = append(spec.Volumes, m.Volumes...)
	return nil
}

var varRe = regexp.MustCompile(`\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|[A-Za-z_][A-Za-z0-9_]*)`)

// Interpolate substitutes variables as Compose does: $VAR and ${VAR}
// (empty if unset), ${VAR:-default} (default if unset or empty),
// ${VAR-default} (if unset), ${VAR:?message} and ${VAR?message} (an error
// if unset, or empty with the colon), ${VAR:+other} and ${VAR+other},
// and $$ for a literal $.
func Interpolate(text string, lookup func(string) (string, bool)) (string, error) {
	var firstErr error
	out := varRe.ReplaceAllStringFunc(text, func(m string) string {
		if m == "$$" {
			return "$"
		}
		sub := varRe.FindStringSubmatch(m)
		name, op, arg := sub[2], sub[3], sub[4]
		if name == "" {
			name = m[1:]
		}
		val, set := lookup(name)
		switch op {
		case "":
			return val
		case ":-":
			if val == "" {
				return arg
			}
		case "-":
			if !set {
				return arg
			}
		case ":?", "?":
			if !set || (op == ":?" && val == "") {
				if firstErr == nil {
					firstErr = errdefs.Invalid("compose file: required variable %s is missing: %s", name, arg)
				}
			}
		case ":+":
			if val != "" {
				return arg
			}
			return ""
		case "+":
			if set {
				return arg
			}
			return ""
		}
		return val
	})
	if firstErr != nil {
		return "", firstErr
	}
	return out, nil
}
