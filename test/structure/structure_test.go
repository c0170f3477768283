// Package structure_test keeps the repository's structural rules
// mechanical, in the spirit of Tailscale's deptest and pkgdoc tests: every
// package says what it is for, and the in-sandbox agent's dependencies are
// a checked-in list that changes only on purpose. (The import boundaries
// between the control plane and the node, and the agent's freedom from
// HTTP, are checked beside the packages they guard:
// internal/cluster/boundary_test.go, internal/guest/agent/boundary_test.go.)
package structure_test

import (
	"bytes"
	"flag"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the checked-in lists from what the code has now")

const mod = "github.com/opendsec/dsec"

func root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

func goCmd(t *testing.T) string {
	t.Helper()
	g, err := exec.LookPath("go")
	if err != nil {
		t.Fatal("the go command is required (go list)")
	}
	return g
}

// TestEveryPackageSaysWhatItIsFor: each package, tests-only packages
// included, has a package comment in one of its files. Generated packages
// (protobuf) are exempt.
func TestEveryPackageSaysWhatItIsFor(t *testing.T) {
	out, err := exec.Command(goCmd(t), "list", "-f", "{{.Dir}}", mod+"/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	dirs := strings.Fields(string(out))
	if len(dirs) < 20 {
		t.Fatalf("go list found %d packages", len(dirs))
	}
	for _, dir := range dirs {
		if missing := packagesWithoutDoc(t, dir); len(missing) > 0 {
			rel, _ := filepath.Rel(root(), dir)
			t.Errorf("package %s (%s) has no package comment: add `// Package %s ...` above one file's package clause", missing[0], rel, missing[0])
		}
	}
}

// packagesWithoutDoc returns the packages in dir (a package and its
// external test package count apart) none of whose files carries a package
// comment; generated files are skipped.
func packagesWithoutDoc(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(dir, e.Name()), nil, parser.ParseComments|parser.PackageClauseOnly)
		if err != nil {
			t.Fatal(err)
		}
		if isGenerated(f.Comments) {
			continue
		}
		name := f.Name.Name
		if !documented[name] {
			documented[name] = f.Doc != nil && strings.TrimSpace(f.Doc.Text()) != ""
		}
	}
	var missing []string
	for name, ok := range documented {
		if !ok && !(strings.HasSuffix(name, "_test") && documented[strings.TrimSuffix(name, "_test")]) {
			missing = append(missing, name)
		}
	}
	return missing
}

func isGenerated(comments []*ast.CommentGroup) bool {
	for _, c := range comments {
		if strings.Contains(c.Text(), "Code generated") && strings.Contains(c.Text(), "DO NOT EDIT") {
			return true
		}
	}
	return false
}

// TestTheAgentsDependenciesAreTheCheckedInList: dsec-guest runs in every
// sandbox; a new dependency (and the memory and attack surface it brings)
// is a reviewed change of cmd/dsec-guest/deps.txt, made with
// `go test ./test/structure -run Agent -update`.
func TestTheAgentsDependenciesAreTheCheckedInList(t *testing.T) {
	out, err := exec.Command(goCmd(t), "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", mod+"/cmd/dsec-guest").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	have := strings.Fields(string(out))
	sort.Strings(have)
	path := filepath.Join(root(), "cmd", "dsec-guest", "deps.txt")
	if *update {
		if err := os.WriteFile(path, []byte(strings.Join(have, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (create it with -update)", err)
	}
	want := strings.Fields(string(b))
	wantSet, haveSet := map[string]bool{}, map[string]bool{}
	for _, d := range want {
		wantSet[d] = true
	}
	for _, d := range have {
		haveSet[d] = true
		if !wantSet[d] {
			t.Errorf("dsec-guest now depends on %s, which cmd/dsec-guest/deps.txt does not list (review it; then -update)", d)
		}
	}
	for _, d := range want {
		if !haveSet[d] {
			t.Errorf("dsec-guest no longer depends on %s: remove it from cmd/dsec-guest/deps.txt (-update)", d)
		}
	}
}

// TestEveryFileIsGofmted: the code reads one way (gofmt), generated code
// included.
func TestEveryFileIsGofmted(t *testing.T) {
	out, err := exec.Command(goCmd(t), "list", "-f", "{{.Dir}}", mod+"/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dir := range strings.Fields(string(out)) {
		ents, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if !strings.HasSuffix(e.Name(), ".go") {
				continue
			}
			p := filepath.Join(dir, e.Name())
			src, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			got, err := format.Source(src)
			if err != nil {
				t.Errorf("%s: %v", p, err)
				continue
			}
			if !bytes.Equal(got, src) {
				rel, _ := filepath.Rel(root(), p)
				t.Errorf("%s is not gofmt'd (gofmt -w %s)", rel, rel)
			}
		}
	}
}

// TestImportRules: drivers never import each other (each implements the
// substrate contract on its own; what two share lives below them, as
// internal/substrate/qemu does for the VM drivers), and the image store
// does not reach into drivers. (The control plane's boundary with the
// node is internal/cluster/boundary_test.go.)
func TestImportRules(t *testing.T) {
	drivers := []string{"internal/substrate/container", "internal/substrate/function", "internal/substrate/microvm", "internal/substrate/vm"}
	rules := []struct {
		pkg       string
		forbidden []string
	}{
		{"internal/image", []string{"internal/substrate"}},
		{"internal/cpio", []string{"internal/substrate"}},
	}
	for _, d := range drivers {
		var others []string
		for _, o := range drivers {
			if o != d {
				others = append(others, o)
			}
		}
		rules = append(rules, struct {
			pkg       string
			forbidden []string
		}{d, others})
	}
	for _, r := range rules {
		t.Run(r.pkg+" keeps its boundary", func(t *testing.T) {
			out, err := exec.Command(goCmd(t), "list", "-deps", mod+"/"+r.pkg).CombinedOutput()
			if err != nil {
				t.Fatalf("go list: %v\n%s", err, out)
			}
			deps := strings.Fields(string(out))
			if len(deps) < 2 {
				t.Fatalf("go list found no dependencies of %s", r.pkg)
			}
			for _, d := range deps {
				for _, f := range r.forbidden {
					if d == mod+"/"+f || strings.HasPrefix(d, mod+"/"+f+"/") {
						t.Errorf("%s depends on %s", r.pkg, d)
					}
				}
			}
		})
	}
}

// TestNoBinaryLinksATestSupportPackage: the test-support packages (the
// substratetest fake driver above all, whose init can turn a binary into
// a sandbox's init) never ship in a binary.
func TestNoBinaryLinksATestSupportPackage(t *testing.T) {
	support := []string{"internal/substrate/substratetest", "internal/dsectest", "internal/cluster/clustertest", "internal/substrate/qemu/qemutest", "internal/gateway/gatewaytest"}
	out, err := exec.Command(goCmd(t), "list", "-f", "{{.ImportPath}}", mod+"/cmd/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, cmd := range strings.Fields(string(out)) {
		deps, err := exec.Command(goCmd(t), "list", "-deps", "-f", "{{.ImportPath}}", cmd).CombinedOutput()
		if err != nil {
			t.Fatalf("go list: %v\n%s", err, deps)
		}
		for _, d := range strings.Fields(string(deps)) {
			for _, s := range support {
				if d == mod+"/"+s {
					t.Errorf("%s links the test-support package %s", cmd, s)
				}
			}
		}
	}
}

// TestEveryServeFlagReachesTheConfig: each `dsec serve` flag bound to a
// config field (a flag set into flagCfg) is applied over the config file
// in applyFlags; a flag defined but never applied would be silently
// ignored (--image-layers was, until this test).
func TestEveryServeFlagReachesTheConfig(t *testing.T) {
	path := filepath.Join(root(), "cmd", "dsec", "serve.go")
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	rootIdent := func(e ast.Expr) string {
		for {
			switch x := e.(type) {
			case *ast.UnaryExpr:
				e = x.X
			case *ast.SelectorExpr:
				e = x.X
			case *ast.ParenExpr:
				e = x.X
			case *ast.CallExpr:
				e = x.Fun
			case *ast.Ident:
				return x.Name
			default:
				return ""
			}
		}
	}
	defined := map[string]bool{}
	applied := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		fn, ok := n.(*ast.FuncDecl)
		if ok && fn.Name.Name == "applyFlags" {
			ast.Inspect(fn, func(n ast.Node) bool {
				if call, ok := n.(*ast.CallExpr); ok {
					if id, ok := call.Fun.(*ast.Ident); ok && id.Name == "set" && len(call.Args) == 1 {
						if lit, ok := call.Args[0].(*ast.BasicLit); ok {
							applied[strings.Trim(lit.Value, `"`)] = true
						}
					}
				}
				return true
			})
			return false
		}
		call, ok := n.(*ast.CallExpr)
		if !ok || len(call.Args) < 2 {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok || !strings.HasSuffix(sel.Sel.Name, "Var") || rootIdent(call.Args[0]) != "flagCfg" {
			return true
		}
		if lit, ok := call.Args[1].(*ast.BasicLit); ok {
			defined[strings.Trim(lit.Value, `"`)] = true
		}
		return true
	})
	if len(defined) < 10 {
		t.Fatalf("found only %d flags bound to flagCfg in %s: the test no longer reads the file right", len(defined), path)
	}
	for name := range defined {
		if !applied[name] {
			t.Errorf("serve flag --%s is bound to the config but applyFlags never applies it: it is silently ignored", name)
		}
	}
}
