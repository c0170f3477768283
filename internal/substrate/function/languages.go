package function

import "sort"

// language says how to build and run one language in a worker. Commands
// run in the call's directory; the source is written to source.
type language struct {
	name    string
	aliases []string
	source  string
	compile []string
	run     []string
	// python runs the script in the runner's warm interpreter.
	python bool
	// needs are the programs the worker image must have.
	needs []string
	// noAS skips the address-space limit (runtimes that reserve large
	// virtual memory, like the JVM and Go).
	noAS bool
}

var languages = []*language{
	{name: "python", aliases: []string{"python3", "py"}, source: "main.py", run: []string{"main.py"}, python: true, needs: []string{"python3"}},
	{name: "bash", aliases: []string{"sh", "shell"}, source: "main.sh", run: []string{"bash", "main.sh"}, needs: []string{"bash"}},
	{name: "c", source: "main.c", compile: []string{"gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"}, run: []string{"./main"}, needs: []string{"gcc"}},
	{name: "cpp", aliases: []string{"c++", "cxx"}, source: "main.cpp", compile: []string{"g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"}, run: []string{"./main"}, needs: []string{"g++"}},
	{name: "go", aliases: []string{"golang"}, source: "main.go", compile: []string{"go", "build", "-o", "main", "main.go"}, run: []string{"./main"}, needs: []string{"go"}, noAS: true},
	{name: "nodejs", aliases: []string{"javascript", "js", "node"}, source: "main.js", run: []string{"node", "main.js"}, needs: []string{"node"}, noAS: true},
	{name: "java", source: "Main.java", compile: []string{"javac", "Main.java"}, run: []string{"java", "-cp", ".", "Main"}, needs: []string{"javac", "java"}, noAS: true},
	{name: "rust", aliases: []string{"rs"}, source: "main.rs", compile: []string{"rustc", "-O", "-o", "main", "main.rs"}, run: []string{"./main"}, needs: []string{"rustc"}},
}

var byName = func() map[string]*language {
	m := map[string]*language{}
	for _, l := range languages {
		m[l.name] = l
		for _, a := range l.aliases {
			m[a] = l
		}
	}
	return m
}()

// probeScript prints the programs a worker has, one per line.
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
	return s + "; do command -v $b >/dev/null 2>&1 && echo $b; done; true"
}
