// Package kubernetes_test checks the manifests in this directory: each
// document decodes strictly into its Kubernetes API type (a misspelt field
// fails), and the pieces fit together (selectors, ports, volumes, secrets,
// and every dsec flag the containers pass exists).
package kubernetes_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/opendsec/dsec/internal/dsectest"
)

type objects struct {
	services     []*corev1.Service
	secrets      map[string]*corev1.Secret
	deployments  []*appsv1.Deployment
	daemonSets   []*appsv1.DaemonSet
	statefulSets []*appsv1.StatefulSet
	namespaces   map[string]bool
}

// decode reads every manifest, strictly, into its API type.
func decode(t *testing.T) *objects {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	o := &objects{secrets: map[string]*corev1.Secret{}, namespaces: map[string]bool{}}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(b), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var meta struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var obj any
			switch meta.APIVersion + " " + meta.Kind {
			case "v1 Namespace":
				obj = &corev1.Namespace{}
			case "v1 Service":
				obj = &corev1.Service{}
			case "v1 Secret":
				obj = &corev1.Secret{}
			case "apps/v1 Deployment":
				obj = &appsv1.Deployment{}
			case "apps/v1 DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "apps/v1 StatefulSet":
				obj = &appsv1.StatefulSet{}
			default:
				t.Fatalf("%s document %d: unexpected %s %s", f, i, meta.APIVersion, meta.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s document %d (%s): %v", f, i, meta.Kind, err)
			}
			switch v := obj.(type) {
			case *corev1.Namespace:
				o.namespaces[v.Name] = true
			case *corev1.Service:
				o.services = append(o.services, v)
			case *corev1.Secret:
				o.secrets[v.Name] = v
			case *appsv1.Deployment:
				o.deployments = append(o.deployments, v)
			case *appsv1.DaemonSet:
				o.daemonSets = append(o.daemonSets, v)
			case *appsv1.StatefulSet:
				o.statefulSets = append(o.statefulSets, v)
			}
		}
	}
	return o
}

func stripComments(doc string) string {
	var out []string
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func TestStrictDecodingCatchesTypos(t *testing.T) {
	doc := []byte("apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      hostNetwrk: true\n")
	if err := yaml.UnmarshalStrict(doc, &appsv1.DaemonSet{}); err == nil {
		t.Fatal("a misspelt field decoded")
	}
}

type workload struct {
	kind, name, namespace string
	selector              map[string]string
	template              corev1.PodTemplateSpec
}

func (o *objects) workloads() []workload {
	var out []workload
	for _, d := range o.deployments {
		out = append(out, workload{"Deployment", d.Name, d.Namespace, d.Spec.Selector.MatchLabels, d.Spec.Template})
	}
	for _, d := range o.daemonSets {
		out = append(out, workload{"DaemonSet", d.Name, d.Namespace, d.Spec.Selector.MatchLabels, d.Spec.Template})
	}
	for _, d := range o.statefulSets {
		out = append(out, workload{"StatefulSet", d.Name, d.Namespace, d.Spec.Selector.MatchLabels, d.Spec.Template})
	}
	return out
}

func TestManifestsFitTogether(t *testing.T) {
	o := decode(t)
	for _, w := range o.workloads() {
		t.Run(w.kind+" "+w.name+" is consistent", func(t *testing.T) {
			if !o.namespaces[w.namespace] {
				t.Errorf("namespace %q is not defined", w.namespace)
			}
			for k, v := range w.selector {
				if w.template.Labels[k] != v {
					t.Errorf("selector %s=%s does not match the pod labels %v", k, v, w.template.Labels)
				}
			}
			vols := map[string]bool{}
			for _, v := range w.template.Spec.Volumes {
				vols[v.Name] = true
			}
			for _, c := range w.template.Spec.Containers {
				for _, m := range c.VolumeMounts {
					if !vols[m.Name] {
						if w.kind != "StatefulSet" {
							t.Errorf("container %s mounts undefined volume %q", c.Name, m.Name)
						}
					}
				}
				for _, e := range c.Env {
					if r := e.ValueFrom; r != nil && r.SecretKeyRef != nil {
						s := o.secrets[r.SecretKeyRef.Name]
						if s == nil {
							t.Errorf("env %s names undefined secret %q", e.Name, r.SecretKeyRef.Name)
						} else if _, ok := s.StringData[r.SecretKeyRef.Key]; !ok {
							t.Errorf("env %s names key %q the secret lacks", e.Name, r.SecretKeyRef.Key)
						}
					}
				}
			}
		})
	}
	for _, s := range o.services {
		t.Run("Service "+s.Name+" reaches its pods", func(t *testing.T) {
			var match *workload
			for _, w := range o.workloads() {
				ok := len(s.Spec.Selector) > 0
				for k, v := range s.Spec.Selector {
					ok = ok && w.template.Labels[k] == v
				}
				if ok {
					match = &w
				}
			}
			if match == nil {
				t.Fatalf("selector %v matches no pods", s.Spec.Selector)
			}
			for _, p := range s.Spec.Ports {
				found := false
				for _, c := range match.template.Spec.Containers {
					for _, cp := range c.Ports {
						found = found || cp.Name == p.TargetPort.StrVal || cp.ContainerPort == p.TargetPort.IntVal
					}
				}
				if !found {
					t.Errorf("port %s targets %s, which no container exposes", p.Name, p.TargetPort.String())
				}
			}
		})
	}
}

func TestNodeAgentHasWhatItNeeds(t *testing.T) {
	o := decode(t)
	if len(o.daemonSets) != 1 {
		t.Fatalf("%d DaemonSets, want the node agent's", len(o.daemonSets))
	}
	ds := o.daemonSets[0]
	c := ds.Spec.Template.Spec.Containers[0]
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("the node agent is not privileged")
	}
	if !ds.Spec.Template.Spec.HostNetwork {
		t.Error("the node agent does not use the host network (bridges, nftables)")
	}
	mounted := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounted[m.MountPath] = m.Name
	}
	host := map[string]string{}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			host[v.Name] = v.HostPath.Path
		}
	}
	for _, p := range []string{"/var/lib/dsec", "/run/dsec", "/sys/fs/cgroup", "/lib/modules"} {
		if host[mounted[p]] != p {
			t.Errorf("%s is not the host's %s", p, p)
		}
	}
}

// Every flag the manifests pass to dsec exists.
func TestContainersPassRealFlags(t *testing.T) {
	o := decode(t)
	bin := filepath.Join(dsectest.Binaries(t), "dsec")
	flagRe := regexp.MustCompile(`(?:^|\s)(--[a-z][a-z0-9-]*)`)
	check := func(verb string, args []string) {
		help, err := exec.Command(bin, verb, "--help").CombinedOutput()
		if err != nil {
			t.Fatalf("dsec %s --help: %v\n%s", verb, err, help)
		}
		for _, f := range flagRe.FindAllStringSubmatch(strings.Join(args, " "), -1) {
			if !bytes.Contains(help, []byte(f[1]+" ")) {
				t.Errorf("dsec %s has no flag %s", verb, f[1])
			}
		}
	}
	for _, w := range o.workloads() {
		for _, c := range w.template.Spec.Containers {
			if !strings.HasPrefix(c.Image, "dsec") {
				continue
			}
			args := append(append([]string(nil), c.Command...), c.Args...)
			all := strings.Join(args, " ")
			switch {
			case strings.Contains(all, "dsec node") || (len(c.Args) > 0 && c.Args[0] == "node"):
				check("node", args)
			case len(c.Args) > 0 && c.Args[0] == "api":
				check("api", args)
			default:
				t.Errorf("%s %s: container %s runs neither dsec api nor dsec node: %v", w.kind, w.name, c.Name, args)
			}
		}
	}
}
