package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/dsec/internal/compose"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func createCmd(g *globals) *cobra.Command {
	var (
		o            dsec.CreateOptions
		memory       string
		labels, env  []string
		nodeSel      []string
		volumes      []string
		ttl, idleTTL time.Duration
		quiet        bool
		count        int
		policy       policyFlags
		composeFiles []string
	)
	cmd := &cobra.Command{
		Use:   "create (--image IMAGE | --compose FILE) [flags]",
		Short: "Create a sandbox and print its ID",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if o.MemoryMB, err = parseMemory(memory); err != nil {
				return err
			}
			if o.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			if o.Env, err = parseKV(env, "env"); err != nil {
				return err
			}
			if o.NodeSelector, err = parseKV(nodeSel, "node-selector"); err != nil {
				return err
			}
			for _, v := range volumes {
				m, err := dsec.ParseVolumeMount(v)
				if err != nil {
					return err
				}
				o.Volumes = append(o.Volumes, m)
			}
			o.TTL, o.IdleTTL = ttl, idleTTL
			if policy.set(cmd) {
				o.Policy = policy.policy()
			}
			for i, file := range composeFiles {
				b, err := os.ReadFile(file)
				if err != nil {
					return err
				}
				// Variables come from this shell, as docker compose
				// takes them; the server never sees the environment.
				text, err := compose.Interpolate(string(b), os.LookupEnv)
				if err != nil {
					return fmt.Errorf("%s: %w", file, err)
				}
				if i == 0 {
					o.Compose = text
				} else {
					o.ComposeOverrides = append(o.ComposeOverrides, text)
				}
				if count > 1 {
					return fmt.Errorf("--compose creates one sandbox at a time")
				}
			}
			if count > 1 {
				resp, err := g.client().CreateMany(cmd.Context(), o, count)
				if err != nil {
					return err
				}
				return printCreates(g, resp)
			}
			sb, err := g.client().Create(cmd.Context(), o)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, sb.Info)
			} else {
				fmt.Println(sb.ID)
			}
			_ = quiet
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Kind, "kind", "", "substrate: function, container (default), microvm or vm; with --from, the snapshot's kind")
	f.StringVar(&o.Runtime, "runtime", "", "another runtime of the kind: gvisor (kind container; `dsec info` lists where it is available)")
	f.StringVar(&o.Image, "image", "", "image name (see `dsec image ls`)")
	f.Float64Var(&o.CPU, "cpu", 0, "CPU limit in cores (default 1)")
	f.StringVar(&memory, "memory", "", "memory limit, e.g. 512M or 2G (default 512M)")
	f.Int64Var(&o.Pids, "pids", 0, "process limit (default 1024)")
	f.DurationVar(&ttl, "ttl", 0, "absolute lifetime (default 1h)")
	f.DurationVar(&idleTTL, "idle-ttl", 0, "delete after this long without API calls (default: no idle limit)")
	f.StringVar(&o.OnTimeout, "on-timeout", "", "what reaching --ttl or --idle-ttl does: delete (default) or pause (any call resumes it; paused at its TTL, it is kept for the node's paused_ttl, 24h by default)")
	f.StringArrayVar(&labels, "label", nil, "label key=value (repeatable)")
	f.StringArrayVar(&env, "env", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringVar(&o.Network, "network", "", "network mode: none (default) or egress")
	policy.flags(f)
	f.Int64Var(&o.BandwidthMbps, "bandwidth", 0, "limit egress throughput each way, in Mbit/s (default: none)")
	f.StringVar(&o.User, "user", "", "default user for commands")
	f.StringVar(&o.Workdir, "workdir", "", "default working directory")
	f.StringVar(&o.IdempotencyKey, "idempotency-key", "", "return the same sandbox when retried with this key")
	f.StringVar(&o.Snapshot, "from", "", "start from this snapshot instead of an image")
	f.StringVar(&o.Session, "session", "", "bind the sandbox to this trainer session")
	f.BoolVar(&o.ModelGateway, "model-gateway", false, "give the sandbox the model gateway: OPENAI_BASE_URL=http://127.0.0.1:4319/v1 inside, the session's and the project's upstreams behind it")
	f.StringVar(&o.FastForwardFrom, "fast-forward-from", "", "answer the sandbox's model calls from those sandbox ID recorded, while they are the same (with --model-gateway)")
	f.StringArrayVar(&nodeSel, "node-selector", nil, "place only on nodes with label key=value (cluster mode; repeatable)")
	f.StringArrayVar(&o.Layers, "layer", nil, "stack this image's layers over the image's (a workspace, a toolkit; repeatable, in order)")
	f.StringArrayVar(&volumes, "volume", nil, "mount a volume NAME:/PATH (read-write, this sandbox alone) or NAME:/PATH:ro (shared read-only); repeatable")
	f.StringArrayVar(&composeFiles, "compose", nil, "a Compose file: its service \"main\" (or its only one) is the main container, the others sidecars sharing its network (variables are substituted from this shell); repeated, later files are laid over earlier ones as docker compose -f does; see docs/sidecars.md")
	f.IntVarP(&count, "count", "n", 1, "create this many (one ID per line)")
	f.BoolVarP(&quiet, "quiet", "q", false, "print only the ID (the default in text output)")
	return cmd
}

func execCmd(g *globals) *cobra.Command {
	var (
		interactive, tty bool
		timeout          time.Duration
		env              []string
		cwd, user        string
		requestID        string
		maxOutput        string
		container        string
	)
	cmd := &cobra.Command{
		Use:   "exec [flags] ID [flags] [--] COMMAND [ARG...]",
		Short: "Run a command in a sandbox, streaming its output; exits with its exit code",
		Long: "Run a command in a sandbox, streaming its output; exits with its exit code.\n\n" +
			"Flags go before or after the ID (dsec exec -u root ID id, dsec exec ID -u root id);\n" +
			"everything from the command on is the command's, and -- ends the flags.",
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			argv := args[1:]
			// Flags after the ID: parsing stopped at the ID (the command's
			// own flags must not be taken), so parse what follows it up to
			// the command or "--". Without this, "dsec exec ID -u root id"
			// ran a command named "-u".
			if len(argv) > 0 && strings.HasPrefix(argv[0], "-") && argv[0] != "--" && argv[0] != "-" {
				if err := cmd.Flags().Parse(argv); err != nil {
					return err
				}
				argv = cmd.Flags().Args()
			} else if len(argv) > 0 && argv[0] == "--" {
				argv = argv[1:]
			}
			envMap, err := parseKV(env, "env")
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			sb := g.client().Sandbox(args[0]).Container(container)
			if len(argv) == 0 {
				return fmt.Errorf("no command given")
			}
			maxMB, err := parseMemory(maxOutput)
			if err != nil {
				return fmt.Errorf("--max-output: %w", err)
			}
			o := dsec.ExecOptions{Argv: argv, Env: envMap, Cwd: cwd, User: user, Timeout: timeout, PTY: tty, RequestID: requestID, MaxOutputBytes: maxMB << 20}
			var restore func()
			if tty {
				if w, h, err := term.GetSize(int(os.Stdout.Fd())); err == nil {
					o.Cols, o.Rows = uint32(w), uint32(h)
				}
				if term.IsTerminal(int(os.Stdin.Fd())) {
					if st, err := term.MakeRaw(int(os.Stdin.Fd())); err == nil {
						restore = func() { term.Restore(int(os.Stdin.Fd()), st) }
						defer restore()
					}
				}
			}
			st, err := sb.Start(ctx, o, interactive)
			if err != nil {
				return err
			}
			defer st.Close()
			// Ctrl-C and SIGTERM go to the remote process group.
			sigs := make(chan os.Signal, 4)
			signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(sigs)
			go func() {
				for s := range sigs {
					name := "INT"
					if s == syscall.SIGTERM {
						name = "TERM"
					}
					st.Signal(context.Background(), name)
				}
			}()
			if interactive {
				go func() {
					buf := make([]byte, 64<<10)
					for {
						n, err := os.Stdin.Read(buf)
						if n > 0 {
							if _, werr := st.Write(buf[:n]); werr != nil {
								return
							}
						}
						if err != nil {
							st.CloseStdin()
							return
						}
					}
				}()
			}
			res, err := st.Wait(os.Stdout, os.Stderr)
			if restore != nil {
				restore()
			}
			if err != nil {
				return err
			}
			if g.json() {
				res.Stdout, res.Stderr = nil, nil
				printJSON(os.Stderr, res)
			}
			if res.TimedOut {
				fmt.Fprintf(os.Stderr, "dsec: command timed out after %s\n", timeout)
			}
			if res.Truncated {
				fmt.Fprintln(os.Stderr, "dsec: output truncated: each stream is capped (the server's default is 1M; raise it with --max-output)")
			}
			if res.OomKilled {
				fmt.Fprintln(os.Stderr, "dsec: command was killed by the sandbox's memory limit")
			}
			if res.ExitCode != 0 {
				return exitError(res.ExitCode)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&interactive, "interactive", "i", false, "pass stdin to the command")
	f.BoolVarP(&tty, "tty", "t", false, "run the command on a terminal")
	f.DurationVar(&timeout, "timeout", 0, "kill the command after this long (default: the server's, 10m)")
	f.StringArrayVarP(&env, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringVarP(&cwd, "workdir", "w", "", "working directory")
	f.StringVarP(&user, "user", "u", "", "user to run as")
	f.StringVar(&requestID, "request-id", "", "exactly-once: a repeat with this ID returns the logged result")
	f.StringVarP(&container, "container", "c", "", "run in this sidecar (default: the main container)")
	f.StringVar(&maxOutput, "max-output", "", "cap on each output stream, e.g. 16M (default: the server's, 1M)")
	f.SetInterspersed(false)
	return cmd
}

// sandboxRef splits "ID:PATH"; ok is false for a local path.
func sandboxRef(s string) (id, path string, ok bool) {
	id, path, ok = strings.Cut(s, ":")
	if !ok || id == "" || strings.ContainsAny(id, "/.") {
		return "", "", false
	}
	return id, path, true
}

func cpCmd(g *globals) *cobra.Command {
	var mode uint32
	var container string
	cmd := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file to (LOCAL ID:PATH) or from (ID:PATH LOCAL) a sandbox; - is stdin/stdout",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			srcID, srcPath, srcRemote := sandboxRef(args[0])
			dstID, dstPath, dstRemote := sandboxRef(args[1])
			c := g.client()
			switch {
			case srcRemote && dstRemote:
				return fmt.Errorf("copy between two sandboxes: copy to a local file first")
			case dstRemote:
				var r io.Reader = os.Stdin
				if args[0] != "-" {
					f, err := os.Open(args[0])
					if err != nil {
						return err
					}
					defer f.Close()
					if st, err := f.Stat(); err == nil && st.IsDir() {
						return fmt.Errorf("%s is a directory: copy files one by one or tar them", args[0])
					} else if err == nil && mode == 0 {
						mode = uint32(st.Mode().Perm())
					}
					r = f
				}
				info, err := c.Sandbox(dstID).Container(container).WriteFile(ctx, dstPath, r, mode)
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, info)
				}
				return nil
			case srcRemote:
				var w io.Writer = os.Stdout
				var f *os.File
				if args[1] != "-" {
					var err error
					if f, err = os.CreateTemp(dirOf(args[1]), ".dsec-cp-"); err != nil {
						return err
					}
					defer os.Remove(f.Name())
					w = f
				}
				info, err := c.Sandbox(srcID).Container(container).ReadFile(ctx, srcPath, w)
				if err != nil {
					return err
				}
				if f != nil {
					f.Chmod(os.FileMode(info.GetMode() & 0o777))
					if err := f.Close(); err != nil {
						return err
					}
					if err := os.Rename(f.Name(), args[1]); err != nil {
						return err
					}
				}
				return nil
			}
			return fmt.Errorf("one of SRC and DST must be ID:PATH")
		},
	}
	cmd.Flags().Uint32Var(&mode, "mode", 0, "file mode in the sandbox (default: the local file's)")
	cmd.Flags().StringVarP(&container, "container", "c", "", "copy to or from this sidecar (default: the main container)")
	return cmd
}

func dirOf(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[:i+1]
	}
	return "."
}

func lsCmd(g *globals) *cobra.Command {
	var labels []string
	var selector string
	cmd := &cobra.Command{
		Use:     "ls [--label k=v]",
		Aliases: []string{"list"},
		Short:   "List sandboxes",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			sel := strings.Join(append(labels, selectorParts(selector)...), ",")
			list, err := g.client().List(cmd.Context(), sel)
			if err != nil {
				return err
			}
			if g.json() {
				msgs := make([]*dsecv1.Sandbox, len(list))
				copy(msgs, list)
				printSandboxesJSON(msgs)
				return nil
			}
			tw := table("ID", "KIND", "IMAGE", "STATE", "CREATED", "EXPIRES IN", "LABELS")
			for _, s := range list {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Id, s.Spec.GetKind(), s.Spec.GetImage(), s.State,
					ago(s.CreatedAt.AsTime()), until(s.ExpiresAt.AsTime()), formatLabels(s.Spec.GetLabels()))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringArrayVarP(&labels, "label", "l", nil, "label selector term k=v, k!=v or k (repeatable)")
	cmd.Flags().StringVar(&selector, "selector", "", "label selector, e.g. job=run42,step!=3")
	return cmd
}

func selectorParts(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

func printSandboxesJSON(list []*dsecv1.Sandbox) {
	fmt.Println("[")
	for i, s := range list {
		b, _ := marshal.Marshal(s)
		sep := ","
		if i == len(list)-1 {
			sep = ""
		}
		fmt.Println(string(b) + sep)
	}
	fmt.Println("]")
}

func formatLabels(m map[string]string) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, k+"="+v)
	}
	if len(parts) == 0 {
		return "-"
	}
	sortStrings(parts)
	return strings.Join(parts, ",")
}

func getCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "get ID",
		Short: "Show a sandbox",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.client().Get(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, s)
				return nil
			}
			tw := table("FIELD", "VALUE")
			fmt.Fprintf(tw, "id\t%s\nnode\t%s\nstate\t%s\n", s.Id, s.Node, s.State)
			if s.Reason != "" {
				fmt.Fprintf(tw, "reason\t%s\n", s.Reason)
			}
			r := s.Spec.GetResources()
			fmt.Fprintf(tw, "kind\t%s\nimage\t%s\ncpu\t%g\nmemory\t%dM\nnetwork\t%s\nlabels\t%s\ncreated\t%s\nexpires in\t%s\nlast active\t%s\n",
				s.Spec.GetKind(), s.Spec.GetImage(), r.GetCpu(), r.GetMemoryMb(), s.Spec.GetNetwork().GetMode(),
				formatLabels(s.Spec.GetLabels()), ago(s.CreatedAt.AsTime()), until(s.ExpiresAt.AsTime()), ago(s.LastActiveAt.AsTime()))
			return tw.Flush()
		},
	}
}

func rmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Delete sandboxes (deleting a deleted sandbox succeeds)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := g.client()
			var firstErr error
			for _, id := range args {
				if err := c.Delete(cmd.Context(), id); err != nil {
					fmt.Fprintf(os.Stderr, "dsec: %s: %v\n", id, err)
					if firstErr == nil {
						firstErr = err
					}
					continue
				}
				if !g.json() {
					fmt.Println(id)
				}
			}
			if g.json() && firstErr == nil {
				fmt.Printf("{\"deleted\": %d}\n", len(args))
			}
			return firstErr
		},
	}
}

func keepaliveCmd(g *globals) *cobra.Command {
	var extend time.Duration
	cmd := &cobra.Command{
		Use:   "keepalive ID",
		Short: "Reset a sandbox's idle timer, optionally extending its TTL",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.client().Sandbox(args[0]).Keepalive(cmd.Context(), extend)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, s)
			} else {
				fmt.Printf("%s expires in %s\n", s.Id, until(s.ExpiresAt.AsTime()))
			}
			return nil
		},
	}
	cmd.Flags().DurationVar(&extend, "extend", 0, "set the expiry to now + this")
	return cmd
}

func psCmd(g *globals) *cobra.Command {
	var container string
	cmd := &cobra.Command{
		Use:   "ps ID",
		Short: "List the processes started in a sandbox",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			procs, err := g.client().Sandbox(args[0]).Container(container).Processes(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, &dsecv1.ListProcessesResponse{Processes: procs})
				return nil
			}
			tw := table("PROCESS", "PID", "STATE", "TAG", "COMMAND")
			for _, p := range procs {
				state := "running"
				if !p.Running {
					state = fmt.Sprintf("exited %d", p.ExitCode)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", p.ProcessId, p.Pid, state, orDash(p.Tag), strings.Join(p.Argv, " "))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&container, "container", "c", "", "list this sidecar's processes (default: the main container's)")
	return cmd
}

func logsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "logs ID SIDECAR",
		Short: "Print a sidecar's output (its service process) so far and follow it until it exits (Ctrl-C stops)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := g.client().Sandbox(args[0]).Container(args[1]).Logs(cmd.Context(), os.Stdout, os.Stderr)
			if err != nil {
				return err
			}
			fmt.Fprintf(os.Stderr, "dsec: sidecar %s exited with status %d\n", args[1], res.ExitCode)
			return nil
		},
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func infoCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "info",
		Short: "Show the deployment: nodes, substrates and their capabilities",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			info, err := g.client().Info(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, info)
				return nil
			}
			fmt.Printf("dsec %s\n", info.Version)
			for _, n := range info.Nodes {
				fmt.Printf("\nnode %s (%s): %d/%d sandboxes, %g cores, %d MiB\n", n.Name, n.State, n.Sandboxes, n.MaxSandboxes, n.CpuCores, n.MemoryMb)
				// Each kind, then each of its other runtimes as kind/runtime
				// (what spec.runtime selects).
				type row struct {
					name, reason string
					available    bool
					caps         []string
					details      map[string]string
				}
				var rows []row
				for _, k := range n.Kinds {
					rows = append(rows, row{k.Kind, k.Reason, k.Available, k.Capabilities, k.Details})
					for _, r := range k.Runtimes {
						rows = append(rows, row{k.Kind + "/" + r.Name, r.Reason, r.Available, r.Capabilities, r.Details})
					}
				}
				tw := table("  KIND[/RUNTIME]", "AVAILABLE", "CAPABILITIES / REASON")
				for _, r := range rows {
					what := strings.Join(r.caps, ",")
					if !r.available {
						what = r.reason
					}
					fmt.Fprintf(tw, "  %s\t%v\t%s\n", r.name, r.available, what)
				}
				tw.Flush()
				for _, r := range rows {
					keys := make([]string, 0, len(r.details))
					for d := range r.details {
						keys = append(keys, d)
					}
					sort.Strings(keys)
					for _, d := range keys {
						fmt.Printf("  %s %s: %s\n", r.name, d, r.details[d])
					}
				}
				for k, v := range n.Host {
					fmt.Printf("  %s: %s\n", k, v)
				}
			}
			return nil
		},
	}
}
