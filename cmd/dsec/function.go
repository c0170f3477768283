package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// extLanguages guesses a language from a file name.
var extLanguages = map[string]string{".py": "python", ".sh": "bash", ".c": "c", ".cc": "cpp", ".cpp": "cpp", ".go": "go", ".js": "nodejs", ".java": "java", ".rs": "rust"}

func runCodeCmd(g *globals) *cobra.Command {
	var (
		lang, tests, image string
		timeout, compile   time.Duration
		memory             string
		caseInsensitive    bool
		tolerance          float64
	)
	cmd := &cobra.Command{
		Use:   "run-code [--language L] FILE|- [--tests cases.jsonl]",
		Short: "Run a program as a function call (stdin passes through); with --tests, judge it",
		Long: "Runs FILE in a warm function worker. Without --tests, stdin is the program's stdin and the command\n" +
			"exits with the program's exit code. With --tests (JSON Lines of {\"stdin\": ..., \"expected_stdout\": ...}),\n" +
			"each case runs and is compared; the command exits 0 only if all pass.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var code []byte
			var err error
			if args[0] == "-" {
				code, err = io.ReadAll(os.Stdin)
			} else {
				code, err = os.ReadFile(args[0])
				if lang == "" {
					lang = extLanguages[filepath.Ext(args[0])]
				}
			}
			if err != nil {
				return err
			}
			if lang == "" {
				return fmt.Errorf("--language is required (no known extension)")
			}
			mem, err := parseMemory(memory)
			if err != nil {
				return err
			}
			req := &dsecv1.RunCodeRequest{Language: lang, Code: string(code), RunTimeoutS: timeout.Seconds(), CompileTimeoutS: compile.Seconds(), MemoryLimitMb: mem, Image: image}
			if tests != "" {
				f, err := os.Open(tests)
				if err != nil {
					return err
				}
				sc := bufio.NewScanner(f)
				sc.Buffer(make([]byte, 1<<20), 64<<20)
				for n := 1; sc.Scan(); n++ {
					line := strings.TrimSpace(sc.Text())
					if line == "" {
						continue
					}
					var tc struct {
						Stdin    string `json:"stdin"`
						Input    string `json:"input"`
						Expected string `json:"expected_stdout"`
						Output   string `json:"output"`
						Name     string `json:"name"`
					}
					if err := json.Unmarshal([]byte(line), &tc); err != nil {
						f.Close()
						return fmt.Errorf("%s line %d: %v", tests, n, err)
					}
					req.Tests = append(req.Tests, &dsecv1.TestCase{Stdin: tc.Stdin + tc.Input, ExpectedStdout: tc.Expected + tc.Output, Name: tc.Name})
				}
				f.Close()
				req.Judge = &dsecv1.JudgeOptions{CaseInsensitive: caseInsensitive, FloatTolerance: tolerance}
			} else if args[0] != "-" {
				if fi, _ := os.Stdin.Stat(); fi != nil && fi.Mode()&os.ModeCharDevice == 0 {
					in, _ := io.ReadAll(os.Stdin)
					req.Stdin = string(in)
				}
			}
			res, err := g.client().RunCode(cmd.Context(), req)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, res)
			} else if len(req.Tests) > 0 {
				for _, c := range res.Cases {
					fmt.Printf("case %d %s: %s\n", c.Index, c.Name, c.Status)
				}
				fmt.Printf("%s: %d of %d passed\n", res.Status, res.Passed, res.Total)
			} else {
				if res.Compile != nil && res.Compile.Status != "finished" {
					os.Stderr.WriteString(res.Compile.Stderr)
				}
				if res.Run != nil {
					os.Stdout.WriteString(res.Run.Stdout)
					os.Stderr.WriteString(res.Run.Stderr)
				}
				if res.Status != "success" {
					fmt.Fprintf(os.Stderr, "dsec: %s %s\n", res.Status, res.Message)
				}
			}
			switch {
			case res.Infra:
				return exitError(3)
			case len(req.Tests) > 0 && res.Status != "success":
				return exitError(1)
			case res.Run != nil && res.Run.ExitCode != 0:
				return exitError(res.Run.ExitCode)
			case res.Status != "success":
				return exitError(1)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&lang, "language", "l", "", "python, bash, c, cpp, go, nodejs, java, rust (default: from the file's extension)")
	f.StringVar(&tests, "tests", "", "JSON Lines test cases to judge against")
	f.DurationVar(&timeout, "timeout", 0, "run time limit (default 10s)")
	f.DurationVar(&compile, "compile-timeout", 0, "compile time limit (default 10s)")
	f.StringVar(&memory, "memory", "", "memory limit (default 1G)")
	f.StringVar(&image, "image", "", "worker image (default: the server's function image)")
	f.BoolVar(&caseInsensitive, "ignore-case", false, "judge ignoring case")
	f.Float64Var(&tolerance, "float-tolerance", 0, "judge numbers within this relative tolerance")
	return cmd
}
