package verdicts

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// A corpus program of a language. Stdin programs read "2 3" and print the
// sum; test-runner modes (pytest, go_test, junit, jest) and languages
// without input (verilog, sql) print or assert without reading.
type langCorpus struct {
	lang                      string
	ok, wrong, crash, tle, ce string
	// ceStatus is what a program that does not build gets: compile_error
	// where the language compiles before it runs, runtime_error where the
	// interpreter finds the error.
	ceStatus string
	// runner: a test-runner mode, judged by its exit (no tests).
	runner bool
	// tleTimeout is the run timeout of the looping program (the
	// runtime's start must fit in it).
	tleTimeout float64
}

const (
	success = "success"
	wa      = "wrong_answer"
	re      = "runtime_error"
	tle     = "time_limit_exceeded"
	mle     = "memory_limit_exceeded"
	ce      = "compile_error"
)

var corpus = []langCorpus{
	{lang: "python", ceStatus: re,
		ok:    "a, b = map(int, input().split())\nprint(a + b)\n",
		wrong: "a, b = map(int, input().split())\nprint(a + b + 1)\n",
		crash: "x = []\nprint(x[1])\n",
		tle:   "while True:\n    pass\n",
		ce:    "def (:\n"},
	{lang: "pytest", runner: true, ceStatus: re,
		ok:    "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(2, 3) == 5\n",
		wrong: "def add(a, b):\n    return a + b + 1\n\ndef test_add():\n    assert add(2, 3) == 5\n",
		crash: "def test_crash():\n    raise RuntimeError('boom')\n",
		tle:   "def test_loop():\n    while True:\n        pass\n",
		ce:    "def test_(:\n"},
	{lang: "bash", ceStatus: re,
		ok:    "read a b\necho $((a + b))\n",
		wrong: "read a b\necho $((a + b + 1))\n",
		crash: "exit 3\n",
		tle:   "while :; do :; done\n",
		ce:    "if then fi (\n"},
	{lang: "c", ceStatus: ce,
		ok:    "#include <stdio.h>\nint main(void){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);return 0;}\n",
		wrong: "#include <stdio.h>\nint main(void){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b+1);return 0;}\n",
		crash: "int main(void){volatile int *p=0;*p=1;return 0;}\n",
		tle:   "int main(void){volatile int x=0;for(;;)x++;}\n",
		ce:    "int main(void){ return }\n"},
	{lang: "cpp", ceStatus: ce,
		ok:    "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<\"\\n\";}\n",
		wrong: "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b+1<<\"\\n\";}\n",
		crash: "#include <stdexcept>\nint main(){throw std::runtime_error(\"boom\");}\n",
		tle:   "int main(){volatile int x=0;for(;;)x++;}\n",
		ce:    "int main(){ std::cout << 1 }\n"},
	{lang: "go", ceStatus: ce,
		ok:    "package main\nimport \"fmt\"\nfunc main(){var a,b int;fmt.Scan(&a,&b);fmt.Println(a+b)}\n",
		wrong: "package main\nimport \"fmt\"\nfunc main(){var a,b int;fmt.Scan(&a,&b);fmt.Println(a+b+1)}\n",
		crash: "package main\nfunc main(){var m map[string]int;m[\"a\"]=1}\n",
		tle:   "package main\nfunc main(){for{}}\n",
		ce:    "package main\nfunc main(){x :=}\n"},
	{lang: "go_test", runner: true, ceStatus: ce,
		ok:    "package main\nimport \"testing\"\nfunc add(a, b int) int { return a + b }\nfunc TestAdd(t *testing.T){ if add(2,3) != 5 { t.Fatal(\"wrong\") } }\n",
		wrong: "package main\nimport \"testing\"\nfunc add(a, b int) int { return a + b + 1 }\nfunc TestAdd(t *testing.T){ if add(2,3) != 5 { t.Fatal(\"wrong\") } }\n",
		crash: "package main\nimport \"testing\"\nfunc TestCrash(t *testing.T){ var p *int; *p = 1 }\n",
		tle:   "package main\nimport \"testing\"\nfunc TestLoop(t *testing.T){ for {} }\n",
		ce:    "package main\nimport \"testing\"\nfunc TestX(t *testing.T){ x := }\n"},
	{lang: "nodejs", ceStatus: re,
		ok:    "const v = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(v[0] + v[1]);\n",
		wrong: "const v = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(v[0] + v[1] + 1);\n",
		crash: "null.x = 1;\n",
		tle:   "while (true) {}\n",
		ce:    "function (\n"},
	{lang: "typescript", ceStatus: ce,
		ok:    "const v: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(v[0] + v[1]);\n",
		wrong: "const v: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(v[0] + v[1] + 1);\n",
		crash: "throw new Error('boom');\n",
		tle:   "while (true) {}\n",
		ce:    "let x: = 5;\n"},
	{lang: "jest", runner: true, ceStatus: ce, tleTimeout: 15,
		ok:    "const add = (a: number, b: number): number => a + b;\ntest('adds', () => { expect(add(2, 3)).toBe(5); });\n",
		wrong: "const add = (a: number, b: number): number => a + b + 1;\ntest('adds', () => { expect(add(2, 3)).toBe(5); });\n",
		crash: "test('crashes', () => { throw new Error('boom'); });\n",
		tle:   "test('loops', () => { while (true) {} });\n",
		ce:    "test('x', () => { let y: = ; });\n"},
	{lang: "java", ceStatus: ce, tleTimeout: 3,
		ok:    "import java.util.*;\npublic class Main { public static void main(String[] a) { Scanner s = new Scanner(System.in); long x = s.nextLong(), y = s.nextLong(); System.out.println(x + y); } }\n",
		wrong: "import java.util.*;\npublic class Main { public static void main(String[] a) { Scanner s = new Scanner(System.in); long x = s.nextLong(), y = s.nextLong(); System.out.println(x + y + 1); } }\n",
		crash: "public class Main { public static void main(String[] a) { int[] z = new int[1]; z[2] = 0; } }\n",
		tle:   "public class Main { public static void main(String[] a) { while (true) {} } }\n",
		ce:    "public class Main { public static void main(String[] a) { int x = 1 } }\n"},
	{lang: "junit", runner: true, ceStatus: ce, tleTimeout: 5,
		ok:    "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\npublic class AddTest { @Test void adds() { assertEquals(5, 2 + 3); } }\n",
		wrong: "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\npublic class AddTest { @Test void adds() { assertEquals(6, 2 + 3); } }\n",
		crash: "import org.junit.jupiter.api.Test;\npublic class AddTest { @Test void crashes() { throw new RuntimeException(\"boom\"); } }\n",
		tle:   "import org.junit.jupiter.api.Test;\npublic class AddTest { @Test void loops() { while (true) {} } }\n",
		ce:    "import org.junit.jupiter.api.Test;\npublic class AddTest { @Test void x() { int y = } }\n"},
	{lang: "scala", ceStatus: ce, tleTimeout: 5,
		ok:    "object Main { def main(args: Array[String]): Unit = { val Array(a, b) = scala.io.StdIn.readLine().trim.split(\"\\\\s+\").map(_.toLong); println(a + b) } }\n",
		wrong: "object Main { def main(args: Array[String]): Unit = { val Array(a, b) = scala.io.StdIn.readLine().trim.split(\"\\\\s+\").map(_.toLong); println(a + b + 1) } }\n",
		crash: "object Main { def main(args: Array[String]): Unit = { throw new RuntimeException(\"boom\") } }\n",
		tle:   "object Main { def main(args: Array[String]): Unit = { while (true) {} } }\n",
		ce:    "object Main { def main(args: Array[String]): Unit = { val x: Int = \"s\" } }\n"},
	{lang: "kotlin_script", ceStatus: re, tleTimeout: 20,
		ok:    "val (a, b) = readLine()!!.trim().split(Regex(\"\\\\s+\")).map { it.toLong() }\nprintln(a + b)\n",
		wrong: "val (a, b) = readLine()!!.trim().split(Regex(\"\\\\s+\")).map { it.toLong() }\nprintln(a + b + 1)\n",
		crash: "throw RuntimeException(\"boom\")\n",
		tle:   "while (true) {}\n",
		ce:    "val x: Int = \"s\"\n"},
	{lang: "csharp", ceStatus: ce,
		ok:    "using System;\nclass P { static void Main() { var p = Console.ReadLine().Split(' '); Console.WriteLine(long.Parse(p[0]) + long.Parse(p[1])); } }\n",
		wrong: "using System;\nclass P { static void Main() { var p = Console.ReadLine().Split(' '); Console.WriteLine(long.Parse(p[0]) + long.Parse(p[1]) + 1); } }\n",
		crash: "using System;\nclass P { static void Main() { int[] z = new int[1]; z[2] = 0; } }\n",
		tle:   "class P { static void Main() { while (true) {} } }\n",
		ce:    "class P { static void Main() { int x = 1 } }\n"},
	{lang: "rust", ceStatus: ce,
		ok:    "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s).unwrap();let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]+v[1]);}\n",
		wrong: "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s).unwrap();let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]+v[1]+1);}\n",
		crash: "fn main(){ panic!(\"boom\"); }\n",
		tle:   "fn main(){ loop { std::thread::sleep(std::time::Duration::from_millis(10)); } }\n",
		ce:    "fn main(){ let x: i32 = \"s\"; }\n"},
	{lang: "D_ut", ceStatus: ce,
		ok:    "import std.stdio;\nvoid main(){ long a, b; readf(\" %d %d\", &a, &b); writeln(a + b); }\n",
		wrong: "import std.stdio;\nvoid main(){ long a, b; readf(\" %d %d\", &a, &b); writeln(a + b + 1); }\n",
		crash: "unittest { assert(1 + 1 == 3); }\nvoid main(){}\n",
		tle:   "void main(){ for (;;) {} }\n",
		ce:    "void main(){ int x = \"s\"; }\n"},
	{lang: "php", ceStatus: re,
		ok:    "<?php\n$v = explode(' ', trim(fgets(STDIN)));\necho $v[0] + $v[1], \"\\n\";\n",
		wrong: "<?php\n$v = explode(' ', trim(fgets(STDIN)));\necho $v[0] + $v[1] + 1, \"\\n\";\n",
		crash: "<?php\nthrow new Exception('boom');\n",
		tle:   "<?php\nwhile (true) {}\n",
		ce:    "<?php\necho (;\n"},
	{lang: "ruby", ceStatus: re,
		ok:    "a, b = gets.split.map(&:to_i)\nputs a + b\n",
		wrong: "a, b = gets.split.map(&:to_i)\nputs a + b + 1\n",
		crash: "raise 'boom'\n",
		tle:   "loop {}\n",
		ce:    "def (\n"},
	{lang: "lua", ceStatus: re,
		ok:    "local a, b = io.read('n', 'n')\nprint(a + b)\n",
		wrong: "local a, b = io.read('n', 'n')\nprint(a + b + 1)\n",
		crash: "error('boom')\n",
		tle:   "while true do end\n",
		ce:    "x = = 1\n"},
	{lang: "R", ceStatus: re,
		ok:    "x <- scan(file('stdin'), quiet = TRUE)\ncat(x[1] + x[2], '\\n', sep = '')\n",
		wrong: "x <- scan(file('stdin'), quiet = TRUE)\ncat(x[1] + x[2] + 1, '\\n', sep = '')\n",
		crash: "stop('boom')\n",
		tle:   "while (TRUE) {}\n",
		ce:    "x <- (\n"},
	{lang: "perl", ceStatus: re,
		ok:    "my ($a, $b) = split ' ', <STDIN>;\nprint $a + $b, \"\\n\";\n",
		wrong: "my ($a, $b) = split ' ', <STDIN>;\nprint $a + $b + 1, \"\\n\";\n",
		crash: "die 'boom';\n",
		tle:   "1 while 1;\n",
		ce:    "my $x = ;\n"},
	{lang: "racket", ceStatus: re, tleTimeout: 3,
		ok:    "#lang racket/base\n(define a (read))\n(define b (read))\n(displayln (+ a b))\n",
		wrong: "#lang racket/base\n(define a (read))\n(define b (read))\n(displayln (+ a b 1))\n",
		crash: "#lang racket/base\n(error \"boom\")\n",
		tle:   "#lang racket/base\n(let loop () (loop))\n",
		ce:    "#lang racket/base\n(define\n"},
	{lang: "verilog", ceStatus: ce,
		ok:    "module tb;\n  initial begin\n    $display(\"%0d\", 2 + 3);\n    $finish;\n  end\nendmodule\n",
		wrong: "module tb;\n  initial begin\n    $display(\"%0d\", 2 + 4);\n    $finish;\n  end\nendmodule\n",
		crash: "module tb;\n  initial begin\n    $fatal(1, \"boom\");\n  end\nendmodule\n",
		tle:   "module tb;\n  reg clk = 0;\n  always #1 clk = ~clk;\nendmodule\n",
		ce:    "module tb;\n  initial begin\n    $display(\"x\")\n  end\nendmodule\n"},
	{lang: "sql", ceStatus: re,
		ok:    "SELECT 2 + 3;\n",
		wrong: "SELECT 2 + 4;\n",
		crash: "SELECT * FROM no_such_table;\n",
		tle:   "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c;\n",
		ce:    "SELEC 1;\n"},
}

// TestEveryLanguageGetsItsVerdicts runs each language's right, wrong,
// crashing, looping and broken program, once as a judged call (one test
// case: "2 3" → "5") and once as a plain call (SandboxFusion's /run_code),
// and checks every verdict.
func TestEveryLanguageGetsItsVerdicts(t *testing.T) {
	d := driver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	t.Cleanup(cancel) // the parallel subtests run after this function returns
	langs, err := d.Languages(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	avail := map[string]string{}
	for _, l := range langs {
		avail[l.Name] = l.Missing
		if l.Available {
			avail[l.Name] = ""
		}
	}
	var calls, wrong atomic.Int64
	for _, lc := range corpus {
		if why := avail[lc.lang]; why != "" {
			t.Errorf("%s is not available on the polyglot image: %s", lc.lang, why)
			continue
		}
		t.Run(lc.lang, func(t *testing.T) {
			t.Parallel()
			tleT := lc.tleTimeout
			if tleT == 0 {
				tleT = 2
			}
			type item struct {
				name, code, judged, plain string
				timeout                   float64
			}
			items := []item{
				{"a right answer passes", lc.ok, success, success, 60},
				{"a wrong answer fails", lc.wrong, wa, success, 60},
				{"a crash is a runtime error", lc.crash, re, re, 60},
				{"a loop is a time limit", lc.tle, tle, tle, tleT},
				{"a program that does not build", lc.ce, lc.ceStatus, lc.ceStatus, 60},
			}
			if lc.runner {
				// A test runner judges itself: its failing test is its exit.
				items[1].judged, items[1].plain = re, re
			}
			for _, it := range items {
				t.Run(it.name, func(t *testing.T) {
					t.Parallel()
					req := &dsecv1.RunCodeRequest{Language: lc.lang, Code: it.code, Stdin: "2 3\n", RunTimeoutS: it.timeout, CompileTimeoutS: 120}
					if !lc.runner {
						calls.Add(1)
						j := cloneReq(req)
						j.Tests = []*dsecv1.TestCase{{Stdin: "2 3\n", ExpectedStdout: "5\n"}}
						res, err := d.RunCode(ctx, j)
						if err != nil {
							t.Fatal(err)
						}
						if res.Status != it.judged {
							wrong.Add(1)
							t.Errorf("judged: %s, want %s\n%s", res.Status, it.judged, describe(res))
						}
					}
					calls.Add(1)
					res, err := d.RunCode(ctx, req)
					if err != nil {
						t.Fatal(err)
					}
					if res.Status != it.plain {
						wrong.Add(1)
						t.Errorf("plain: %s, want %s\n%s", res.Status, it.plain, describe(res))
					}
				})
			}
		})
	}
	t.Cleanup(func() { t.Logf("%d calls, %d wrong verdicts", calls.Load(), wrong.Load()) })
}

func cloneReq(r *dsecv1.RunCodeRequest) *dsecv1.RunCodeRequest {
	return proto.Clone(r).(*dsecv1.RunCodeRequest)
}

// describe shows a result for a failure message.
func describe(res *dsecv1.RunCodeResult) string {
	var b strings.Builder
	b.WriteString("message: " + res.Message + "\n")
	show := func(name string, s *dsecv1.StageResult) {
		if s != nil {
			b.WriteString(name + ": " + s.Status + " exit " + itoa(s.ExitCode) + " signal " + s.Signal + "\n  stdout: " + clip(s.Stdout) + "\n  stderr: " + clip(s.Stderr) + "\n")
		}
	}
	show("compile", res.Compile)
	show("run", res.Run)
	for _, c := range res.Cases {
		show("case "+c.Status, c.Run)
		show("checker", c.Checker)
		if c.CheckerMessage != "" {
			b.WriteString("  checker message: " + clip(c.CheckerMessage) + "\n")
		}
	}
	return b.String()
}

func clip(s string) string {
	if len(s) > 600 {
		return s[:300] + " … " + s[len(s)-300:]
	}
	return s
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }
