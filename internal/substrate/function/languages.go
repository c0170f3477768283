package function

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
)

// language says how to build and run one language in a worker. Commands
// run in the call's directory; the source is written to source. The names
// are SandboxFusion's (its `language` field), so its clients need no
// mapping; aliases are matched without regard to case.
type language struct {
	name    string
	aliases []string
	source  string
	// sourceOf names the source file after the code (a Java file is named
	// for its public class); "" keeps source. An error is the program's
	// (a compile error).
	sourceOf func(code string) (string, error)
	// transform rewrites the code before it is written (PHP's open tag).
	transform func(code string) string
	compile   []string
	run       []string
	// runOf builds the run command from the code (Scala runs the object
	// the code declares); nil keeps run.
	runOf func(code string) []string
	// python runs the script in the runner's warm interpreter.
	python bool
	// needs are the programs the worker image must have.
	needs []string
	// noAS skips the address-space limit (runtimes that reserve large
	// virtual memory, like the JVM, Go, Node.js, Mono and Racket): the
	// worker's memory cgroup bounds them.
	noAS bool
	// heap passes the memory limit to a runtime with its own heap limit
	// (the JVM's -Xmx, Node's --max-old-space-size): the flag is inserted
	// after the run command's first word, with %d the limit in MiB.
	heap string
	// env is added to the call's environment.
	env []string
	// missing says why no worker image of this build can have the
	// language (not packaged by Debian 12, or needs a GPU).
	missing string
}

// helpers are scripts the node installs in every worker (readable by
// calls) under libDir.
const libDir = "/run/dsec-fn/lib"

var (
	javaClass  = regexp.MustCompile(`(?m)^\s*public\s+(?:final\s+|abstract\s+)*class\s+(\w+)`)
	scalaObj   = regexp.MustCompile(`object\s+(\w+)`)
	tsCompile  = []string{"node", libDir + "/ts.js", "main.ts", "main.js"}
	goEnv      = []string{"GOCACHE=/tmp/go-build", "GOPATH=/tmp/go", "GO111MODULE=off", "GOTOOLCHAIN=local", "CGO_ENABLED=0"}
	notDebian  = "not packaged by Debian 12 (bookworm), which function images are built from"
	needsGPU   = "needs a GPU worker; this build runs CPU workers only"
	phpOpenTag = func(code string) string {
		if strings.HasPrefix(strings.TrimLeft(code, " \t\r\n"), "<?php") {
			return strings.TrimLeft(code, " \t\r\n")
		}
		return "<?php\n" + code
	}
)

var languages = []*language{
	{name: "python", aliases: []string{"python3", "py"}, source: "main.py", run: []string{"main.py"}, python: true, needs: []string{"python3"}},
	{name: "pytest", source: "main_test.py", run: []string{"python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "main_test.py"}, needs: []string{"python3", "pytest-3"}},
	{name: "bash", aliases: []string{"sh", "shell"}, source: "main.sh", run: []string{"bash", "main.sh"}, needs: []string{"bash"}},
	{name: "c", source: "main.c", compile: []string{"gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"}, run: []string{"./main"}, needs: []string{"gcc"}},
	{name: "cpp", aliases: []string{"c++", "cxx"}, source: "main.cpp", compile: []string{"g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp", "-lpthread"}, run: []string{"./main"}, needs: []string{"g++"}},
	{name: "go", aliases: []string{"golang"}, source: "main.go", compile: []string{"go", "build", "-o", "main", "main.go"}, run: []string{"./main"}, needs: []string{"go"}, noAS: true, env: goEnv},
	{name: "go_test", source: "main_test.go", compile: []string{"go", "test", "-c", "-o", "main.test", "main_test.go"}, run: []string{"./main.test", "-test.v"}, needs: []string{"go"}, noAS: true, env: goEnv},
	{name: "nodejs", aliases: []string{"javascript", "js", "node"}, source: "main.js", run: []string{"node", "main.js"}, needs: []string{"node"}, noAS: true, heap: "--max-old-space-size=%d"},
	{name: "typescript", aliases: []string{"ts"}, source: "main.ts", compile: tsCompile, run: []string{"node", "main.js"}, needs: []string{"node", "tsc"}, noAS: true, heap: "--max-old-space-size=%d"},
	{name: "jest", source: "main.test.ts", compile: []string{"node", libDir + "/ts.js", "main.test.ts", "main.test.js"}, run: []string{"jest", "--ci", "--runInBand", "--colors=false", "--config", `{"testEnvironment":"node"}`, "--rootDir", ".", "main.test.js"}, needs: []string{"node", "tsc", "jest"}, noAS: true},
	{name: "java", source: "Main.java", sourceOf: javaSource, compile: []string{"sh", "-c", "javac -encoding UTF-8 -cp . *.java"}, run: []string{"java", "-cp", ".", "-ea", "Main"}, needs: []string{"javac", "java"}, noAS: true, heap: "-Xmx%dm"},
	{name: "junit", source: "Main.java", sourceOf: javaSource, compile: []string{"sh", "-c", "javac -encoding UTF-8 -cp .:/usr/share/java/junit-jupiter-api.jar:/usr/share/java/apiguardian-api.jar:/usr/share/java/opentest4j.jar *.java"},
		run: []string{"java", "-jar", "/usr/share/java/junit-platform-console-standalone.jar", "--disable-banner", "--details=tree", "--class-path", ".", "--scan-class-path"}, needs: []string{"javac", "java", "/usr/share/java/junit-platform-console-standalone.jar"}, noAS: true, heap: "-Xmx%dm"},
	{name: "scala", source: "main.scala", compile: []string{"scalac", "-nowarn", "main.scala"}, runOf: func(code string) []string {
		m := scalaObj.FindStringSubmatch(code)
		if m == nil {
			return nil
		}
		return []string{"scala", "-nc", "-cp", ".", m[1]}
	}, needs: []string{"scalac", "scala"}, noAS: true},
	{name: "kotlin_script", aliases: []string{"kotlin", "kts"}, source: "main.kts", run: []string{"kotlinc", "-script", "main.kts"}, needs: []string{"kotlinc"}, noAS: true},
	{name: "csharp", aliases: []string{"cs", "c#"}, source: "main.cs", compile: []string{"mcs", "-nologo", "-out:main.exe", "main.cs"}, run: []string{"mono", "main.exe"}, needs: []string{"mcs", "mono"}, noAS: true},
	{name: "rust", aliases: []string{"rs"}, source: "main.rs", compile: []string{"rustc", "-O", "-o", "main", "main.rs"}, run: []string{"./main"}, needs: []string{"rustc"}},
	{name: "D_ut", aliases: []string{"d"}, source: "main.d", compile: []string{"gdc", "-O2", "-funittest", "-o", "main", "main.d"}, run: []string{"./main"}, needs: []string{"gdc"}, noAS: true},
	{name: "php", source: "main.php", transform: phpOpenTag, run: []string{"php", "-f", "main.php"}, needs: []string{"php"}},
	{name: "ruby", aliases: []string{"rb"}, source: "main.rb", run: []string{"ruby", "main.rb"}, needs: []string{"ruby"}},
	{name: "lua", source: "main.lua", run: []string{"lua5.4", "main.lua"}, needs: []string{"lua5.4"}},
	{name: "R", aliases: []string{"r", "rscript"}, source: "main.R", run: []string{"Rscript", "main.R"}, needs: []string{"Rscript"}, noAS: true},
	{name: "perl", aliases: []string{"pl"}, source: "main.pl", run: []string{"perl", "main.pl"}, needs: []string{"perl"}},
	{name: "racket", aliases: []string{"rkt"}, source: "main.rkt", run: []string{"racket", "main.rkt"}, needs: []string{"racket"}, noAS: true},
	{name: "verilog", aliases: []string{"systemverilog", "sv"}, source: "main.sv", compile: []string{"iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o", "main.vvp", "main.sv"}, run: []string{"vvp", "-n", "main.vvp"}, needs: []string{"iverilog", "vvp"}},
	{name: "sql", aliases: []string{"sqlite"}, source: "main.sql", run: []string{"sqlite3", "-bail", "-batch", ":memory:", ".read main.sql"}, needs: []string{"sqlite3"}},
	{name: "julia", aliases: []string{"jl"}, missing: notDebian},
	{name: "lean", missing: notDebian},
	{name: "swift", missing: notDebian},
	{name: "cuda", missing: needsGPU},
	{name: "python_gpu", missing: needsGPU},
}

// javaSource names a Java file for its public class (javac insists), as
// SandboxFusion does; without one, Main.java.
func javaSource(code string) (string, error) {
	if m := javaClass.FindStringSubmatch(code); m != nil {
		return m[1] + ".java", nil
	}
	return "Main.java", nil
}

var byName = func() map[string]*language {
	m := map[string]*language{}
	for _, l := range languages {
		m[strings.ToLower(l.name)] = l
		for _, a := range l.aliases {
			m[a] = l
		}
	}
	return m
}()

// lookup finds a language by name or alias, ignoring case.
func lookup(name string) *language {
	return byName[strings.ToLower(strings.TrimSpace(name))]
}

// LanguageNames lists every language name a call may give, sorted.
func LanguageNames() []string {
	var out []string
	for _, l := range languages {
		out = append(out, l.name)
	}
	sort.Strings(out)
	return out
}

// lacking names what a worker of an image with the programs have lacks to
// run l, or "" if nothing.
func (l *language) lacking(have map[string]bool) string {
	if l.missing != "" {
		return l.missing
	}
	var miss []string
	for _, n := range l.needs {
		if !have[n] {
			miss = append(miss, n)
		}
	}
	if len(miss) == 0 {
		return ""
	}
	return fmt.Sprintf("its toolchain (%s) is not in the worker image", strings.Join(miss, ", "))
}

// probeScript prints the programs (and files, for absolute paths) a
// worker has, one per line.
func probeScript() string {
	seen := map[string]bool{}
	var bins []string
	for _, l := range languages {
		for _, n := range l.needs {
			if !seen[n] {
				seen[n] = true
				bins = append(bins, n)
			}
		}
	}
	sort.Strings(bins)
	s := "for b in"
	for _, b := range bins {
		s += " " + b
	}
	return s + "; do case $b in /*) test -e $b && echo $b;; *) command -v $b >/dev/null 2>&1 && echo $b;; esac; done; true"
}

// Recipe says how a call of language name runs code, for benchmarks that
// run the same commands outside dsec: the source file, the compile and
// run commands (in the call's directory) and the environment added; ok
// is false for unknown languages and those no image has.
func Recipe(name, code string) (source string, compile, run, env []string, ok bool) {
	l := lookup(name)
	if l == nil || l.missing != "" {
		return "", nil, nil, nil, false
	}
	source, run = l.source, l.run
	if l.sourceOf != nil {
		if s, err := l.sourceOf(code); err == nil {
			source = s
		}
	}
	if l.runOf != nil {
		run = l.runOf(code)
	}
	if l.python {
		run = append([]string{"python3"}, run...)
	}
	return source, l.compile, run, l.env, true
}

// Helpers are the files the node installs in every worker, by path.
func Helpers() map[string][]byte { return map[string][]byte{libDir + "/ts.js": tsScript} }
