package main

import (
	"strings"
	"testing"
)

func TestReport(t *testing.T) {
	ev := func(action, pkg, test, output string) string {
		return `{"Action":"` + action + `","Package":"` + pkg + `","Test":"` + test + `","Output":` + quote(output) + `}`
	}
	tests := []struct {
		name   string
		events []string
		code   int
		says   []string
	}{
		{"a passing package exits zero", []string{
			ev("run", "p", "TestA", ""), ev("output", "p", "TestA", "=== RUN   TestA\n"), ev("pass", "p", "TestA", ""), ev("pass", "p", "", ""),
		}, 0, []string{"ok  \tp"}},
		{"a failed test prints its output and fails", []string{
			ev("output", "p", "TestA", "    a_test.go:3: boom\n"), ev("fail", "p", "TestA", ""), ev("fail", "p", "", ""),
		}, 1, []string{"a_test.go:3: boom", "FAIL\tp"}},
		{"a skip for missing hardware is allowed", []string{
			ev("output", "p", "TestVM", "    vm_test.go:9: needs a KVM that boots\n"), ev("skip", "p", "TestVM", ""), ev("pass", "p", "", ""),
		}, 0, []string{"needs a KVM that boots"}},
		{"any other skip fails and names the test", []string{
			ev("output", "p", "TestE2B", "    e2b_test.go:70: needs Node.js >= 20.18.1\n"), ev("skip", "p", "TestE2B", ""), ev("pass", "p", "", ""),
		}, 1, []string{"NOT ALLOWED p TestE2B: e2b_test.go:70: needs Node.js >= 20.18.1"}},
		{"a build failure is shown and fails", []string{
			"# p", "./x.go:1:1: syntax error", ev("output", "p", "", "FAIL\tp [build failed]\n"), ev("fail", "p", "", ""),
		}, 1, []string{"syntax error", "FAIL\tp"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out strings.Builder
			code := report(strings.NewReader(strings.Join(tt.events, "\n")+"\n"), &out)
			if code != tt.code {
				t.Errorf("exit %d, want %d; printed:\n%s", code, tt.code, out.String())
			}
			for _, s := range tt.says {
				if !strings.Contains(out.String(), s) {
					t.Errorf("output lacks %q:\n%s", s, out.String())
				}
			}
		})
	}
}

func quote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`, "\t", `\t`)
	return `"` + r.Replace(s) + `"`
}
