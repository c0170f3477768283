package verdicts

import (
	"context"
	"fmt"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// sumChecker accepts any two positive integers whose sum is the input's
// number: a problem with many right answers.
const sumCheckerPy = `import sys
n = int(open(sys.argv[1]).read())
try:
    a, b = map(int, open(sys.argv[3]).read().split())
except Exception:
    print("not two integers")
    sys.exit(1)
if a > 0 and b > 0 and a + b == n:
    sys.exit(0)
print(f"{a} + {b} != {n}")
sys.exit(1)
`

const sumCheckerCpp = `#include <fstream>
#include <iostream>
int main(int argc, char **argv) {
  if (argc < 4) return 3;
  std::ifstream in(argv[1]), out(argv[3]);
  long n, a, b;
  if (!(in >> n)) return 3;
  if (!(out >> a >> b)) { std::cout << "not two integers\n"; return 1; }
  std::string extra;
  if (out >> extra) { std::cout << "extra output\n"; return 2; }
  return (a > 0 && b > 0 && a + b == n) ? 0 : 1;
}
`

// sumCases: n in, any split out; the expected output is one split of many.
func sumCases(n int) []*dsecv1.TestCase {
	var cs []*dsecv1.TestCase
	for i := 2; i < 2+n; i++ {
		cs = append(cs, &dsecv1.TestCase{Stdin: fmt.Sprint(i, "\n"), ExpectedStdout: fmt.Sprint(1, " ", i-1, "\n")})
	}
	return cs
}

type hostile struct {
	name string
	req  *dsecv1.RunCodeRequest
	want string
}

func py(code string) *dsecv1.RunCodeRequest {
	return &dsecv1.RunCodeRequest{Language: "python", Code: code, RunTimeoutS: 20}
}

func cases(r *dsecv1.RunCodeRequest, tcs ...*dsecv1.TestCase) *dsecv1.RunCodeRequest {
	r.Tests = tcs
	return r
}

func tc(in, want string) *dsecv1.TestCase { return &dsecv1.TestCase{Stdin: in, ExpectedStdout: want} }

func withChecker(r *dsecv1.RunCodeRequest, c *dsecv1.Checker) *dsecv1.RunCodeRequest {
	r.Checker = c
	return r
}

func withLimits(r *dsecv1.RunCodeRequest, timeout float64, memMB int64) *dsecv1.RunCodeRequest {
	r.RunTimeoutS, r.MemoryLimitMb = timeout, memMB
	return r
}

// readTests looks for the expected outputs everywhere a call might reach
// them: its directory, the temporary directories, the node's call storage,
// other processes' directories, environments and command lines.
const readTests = `import os, sys
secret = "SECRET-"
found = ""
def scan(path, depth=0):
    global found
    if found or depth > 6:
        return
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for e in os.listdir(path):
                scan(os.path.join(path, e), depth + 1)
        elif os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read(1 << 20)
            i = data.find(secret.encode())
            if i >= 0:
                found = data[i:i+40].split()[0].decode()
    except Exception:
        pass
for root in [os.getcwd(), "..", "/tmp", "/var/tmp", "/dev/shm", "/run", "/home", "/root"]:
    scan(root)
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    for f in ["environ", "cmdline"]:
        scan(f"/proc/{pid}/{f}")
    scan(f"/proc/{pid}/cwd")
    scan(f"/proc/{pid}/root/tmp")
print(found or "nothing")
`

func TestHostileProgramsGetTheirVerdicts(t *testing.T) {
	driver(t)
	secretCases := make([]*dsecv1.TestCase, 8)
	for i := range secretCases {
		secretCases[i] = tc(fmt.Sprint(i, "\n"), fmt.Sprintf("SECRET-%d-%d\n", i, time.Now().UnixNano()))
	}
	tests := []hostile{
		// Right answers other than the expected one.
		{"a float within the checker's tolerance passes", withChecker(cases(py("print(1/3)"), tc("", "0.333333333\n")), &dsecv1.Checker{Builtin: "float", FloatTolerance: 1e-6}), success},
		{"the same float fails exact line matching", cases(py("print(1/3)"), tc("", "0.333333333\n")), wa},
		{"a float outside the tolerance fails", withChecker(cases(py("print(0.3334)"), tc("", "0.333333333\n")), &dsecv1.Checker{Builtin: "float", FloatTolerance: 1e-6}), wa},
		{"lines in another order pass an unordered checker", withChecker(cases(py("print('b'); print('c'); print('a')"), tc("", "a\nb\nc\n")), &dsecv1.Checker{Builtin: "unordered_lines"}), success},
		{"a missing line fails an unordered checker", withChecker(cases(py("print('b'); print('a')"), tc("", "a\nb\nc\n")), &dsecv1.Checker{Builtin: "unordered_lines"}), wa},
		{"tokens across lines pass a token checker", withChecker(cases(py("print(5); print(); print('  6 ')"), tc("", "5 6\n")), &dsecv1.Checker{Builtin: "tokens"}), success},
		{"another valid split passes a Python checker", withChecker(cases(py("n = int(input()); print(n - 1, 1)"), sumCases(6)...), &dsecv1.Checker{Language: "python", Code: sumCheckerPy}), success},
		{"an invalid split fails a Python checker", withChecker(cases(py("n = int(input()); print(n, 0)"), sumCases(6)...), &dsecv1.Checker{Language: "python", Code: sumCheckerPy}), wa},
		{"another valid split passes a C++ checker", withChecker(cases(py("n = int(input()); print(n - 1, 1)"), sumCases(6)...), &dsecv1.Checker{Language: "cpp", Code: sumCheckerCpp}), success},
		{"extra output fails a C++ checker", withChecker(cases(py("n = int(input()); print(n - 1, 1, 7)"), sumCases(6)...), &dsecv1.Checker{Language: "cpp", Code: sumCheckerCpp}), wa},
		{"a C++ program judged by a Python checker", withChecker(cases(&dsecv1.RunCodeRequest{Language: "cpp", Code: "#include <cstdio>\nint main(){int n;scanf(\"%d\",&n);printf(\"%d 1\\n\",n-1);}\n", RunTimeoutS: 20, CompileTimeoutS: 120}, sumCases(6)...), &dsecv1.Checker{Language: "python", Code: sumCheckerPy}), success},
		{"a checker that crashes is a judge error", withChecker(cases(py("print(1)"), tc("", "1\n")), &dsecv1.Checker{Language: "python", Code: "raise SystemExit(3)"}), "judge_error"},
		{"a checker that does not compile is a judge error", withChecker(cases(py("print(1)"), tc("", "1\n")), &dsecv1.Checker{Language: "cpp", Code: "int main( {"}), "judge_error"},
		{"a checker that loops is a judge error", withChecker(cases(py("print(1)"), tc("", "1\n")), &dsecv1.Checker{Language: "python", Code: "while True: pass", TimeoutS: 1}), "judge_error"},
		{"surrounding whitespace and a missing newline pass", cases(py("import sys; sys.stdout.write('  5  ')"), tc("", "5\n")), success},
		{"stderr noise does not matter", cases(py("import sys; print('noise', file=sys.stderr); print(5)"), tc("", "5\n")), success},
		{"the right answer and a non-zero exit is a runtime error", cases(py("print(5); raise SystemExit(1)"), tc("", "5\n")), re},
		{"the right answer and then a crash is a runtime error", cases(&dsecv1.RunCodeRequest{Language: "c", Code: "#include <stdio.h>\nint main(){printf(\"5\\n\");fflush(stdout);volatile int*p=0;*p=1;}\n", RunTimeoutS: 20, CompileTimeoutS: 120}, tc("", "5\n")), re},
		{"the first failure is the call's verdict", cases(withLimits(py("n = int(input())\nif n == 2: raise SystemExit(1)\nif n == 3:\n    while True: pass\nprint(n)"), 3, 0), tc("1\n", "1\n"), tc("2\n", "2\n"), tc("3\n", "3\n")), re},

		// Memory.
		{"a Python allocation over the limit is a memory limit", withLimits(py("x = bytearray(1 << 30)\nprint(len(x))"), 20, 256), mle},
		{"a C++ allocation over the limit is a memory limit", withLimits(&dsecv1.RunCodeRequest{Language: "cpp", Code: "#include <vector>\n#include <cstdio>\nint main(){std::vector<long> v(1L<<28, 1);printf(\"%ld\\n\", v[5]);}\n", CompileTimeoutS: 120}, 20, 256), mle},
		{"a Java allocation over the limit is a memory limit", withLimits(&dsecv1.RunCodeRequest{Language: "java", Code: "public class Main { public static void main(String[] a) { long[] x = new long[1 << 28]; System.out.println(x.length); } }\n", CompileTimeoutS: 120}, 20, 256), mle},
		{"growing a Python list without end is a memory limit", withLimits(py("x = []\nwhile True: x.append([0] * 1000)"), 30, 256), mle},

		// Output floods.
		{"a flood that ends fails judging", cases(py("import sys\nfor _ in range(64): sys.stdout.write('5' * (1 << 20))\nprint()"), tc("", "5\n")), wa},
		{"a flood that never ends is a time limit", withLimits(py("while True: print('x' * 1000)"), 2, 0), tle},

		// Processes.
		{"a Python fork loop fails", withLimits(py("import os\nwhile True: os.fork()"), 10, 0), re},
		{"a C fork bomb is a time limit", withLimits(&dsecv1.RunCodeRequest{Language: "c", Code: "#include <unistd.h>\nint main(){for(;;)fork();}\n", CompileTimeoutS: 120}, 2, 0), tle},
		{"a daemon left behind does not change the verdict", cases(py("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint(5)"), tc("", "5\n")), success},

		// Writes outside the working directory.
		{"writing the root filesystem fails", py("open('/etc/passwd', 'a').write('x')"), re},
		{"writing /tmp is private to the call", py("open('/tmp/dsec-leak', 'w').write('x')\nprint('ok')"), success},
		{"another call sees nothing in /tmp", cases(py("import os\nprint('leak' if os.path.exists('/tmp/dsec-leak') else 5)"), tc("", "5\n")), success},

		// Recursion.
		{"infinite Python recursion is a runtime error", py("def f(n): return f(n + 1) + 1\nf(0)"), re},
		{"infinite C++ recursion is a runtime error", &dsecv1.RunCodeRequest{Language: "cpp", Code: "#include <vector>\nlong f(long n){std::vector<long> v(8, n);return f(n+1)+v[3];}\nint main(){return (int)f(0);}\n", RunTimeoutS: 20, CompileTimeoutS: 120}, re},
		{"infinite C recursion is a runtime error", &dsecv1.RunCodeRequest{Language: "c", Code: "int f(int n){volatile char b[256];b[0]=n;return f(n+1)+b[0];}\nint main(){return f(0);}\n", RunTimeoutS: 20, CompileTimeoutS: 120}, re},

		// Reading the tests.
		{"a program cannot read the expected outputs (built-in judge)", cases(py(readTests), secretCases...), wa},
		{"a program cannot read the expected outputs (checker program)", withChecker(cases(py(readTests), secretCases...), &dsecv1.Checker{Language: "python", Code: "import sys\nsys.exit(0 if open(sys.argv[2]).read() == open(sys.argv[3]).read() else 1)"}), wa},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	t.Cleanup(cancel) // the parallel subtests run after this function returns
	for i, ht := range tests {
		// The /tmp pair runs in order: the second looks for the first's
		// file.
		if ht.name == "another call sees nothing in /tmp" {
			continue
		}
		t.Run(ht.name, func(t *testing.T) {
			if ht.name != "writing /tmp is private to the call" {
				t.Parallel()
			}
			check(ctx, t, ht)
			if ht.name == "writing /tmp is private to the call" {
				check(ctx, t, tests[i+1])
			}
		})
	}
}

func check(ctx context.Context, t *testing.T, ht hostile) {
	t.Helper()
	res, err := driverOf(t).RunCode(ctx, ht.req)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != ht.want || res.Infra {
		t.Errorf("%s: %s (infra %v), want %s\n%s", ht.name, res.Status, res.Infra, ht.want, describe(res))
	}
	if ht.want != success && len(res.Cases) > 0 && res.FirstFailure == nil {
		t.Errorf("%s: no first failure reported", ht.name)
	}
}

func driverOf(t *testing.T) interface {
	RunCode(context.Context, *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error)
} {
	return driver(t)
}
