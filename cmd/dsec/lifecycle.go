package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func lifecycleCmds(g *globals) []*cobra.Command {
	return []*cobra.Command{snapshotCmd(g), forkCmd(g), pauseCmd(g, "pause"), pauseCmd(g, "resume"), logCmd(g), replayCmd(g), rolloutCmd(g), sessionCmd(g), capacityCmd(g), eventsCmd(g), webhookCmd(g), statsCmd(g)}
}

func statsCmd(g *globals) *cobra.Command {
	var history bool
	cmd := &cobra.Command{
		Use:   "stats ID [--history]",
		Short: "Show a sandbox's resource use now, or with --history as the node sampled it (every 5 s, the last 15 minutes)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			sb := g.client().Sandbox(args[0])
			get := sb.Stats
			if history {
				get = sb.StatsHistory
			}
			st, err := get(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, st)
				return nil
			}
			fmt.Printf("cpu time %s (%g cores), memory %s of %s, disk %s of %s, %d processes, %d OOM kills\n",
				time.Duration(st.CpuTimeMs)*time.Millisecond, st.CpuLimit, humanBytes(st.MemoryBytes), humanBytes(st.MemoryLimitMb<<20),
				humanBytes(st.DiskBytes), humanBytes(st.DiskLimitMb<<20), st.Pids, st.OomKills)
			if !history {
				return nil
			}
			tw := table("TIME", "CPU", "MEMORY", "DISK", "PROCESSES")
			for i, s := range st.History {
				cpu := "-"
				if i > 0 {
					prev := st.History[i-1]
					if dt := s.At.AsTime().Sub(prev.At.AsTime()); dt > 0 {
						cpu = fmt.Sprintf("%.1f%%", float64(s.CpuTimeMs-prev.CpuTimeMs)/float64(dt.Milliseconds())*100)
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\n", s.At.AsTime().Local().Format("15:04:05"), cpu, humanBytes(s.MemoryBytes), humanBytes(s.DiskBytes), s.Pids)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&history, "history", false, "also list the samples the node kept")
	return cmd
}

func eventsCmd(g *globals) *cobra.Command {
	var o dsec.EventOptions
	var labels []string
	var selector string
	cmd := &cobra.Command{
		Use:   "events",
		Short: "Follow sandbox lifecycle events (created, paused, resumed, snapshotted, forked, ended) until interrupted",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Labels = strings.Join(append(labels, selectorParts(selector)...), ",")
			sub, err := g.client().Subscribe(cmd.Context(), o)
			if err != nil {
				return err
			}
			defer sub.Close()
			fmt.Fprintln(os.Stderr, "following events (interrupt to stop)")
			for {
				ev, err := sub.Next()
				if err != nil {
					if cmd.Context().Err() != nil {
						return nil
					}
					return err
				}
				if g.json() {
					b, _ := protojson.Marshal(ev)
					fmt.Println(string(b))
					continue
				}
				line := fmt.Sprintf("%s %-11s %s", ev.At.AsTime().Local().Format("15:04:05.000"), ev.Type, orDash(ev.SandboxId))
				switch ev.Type {
				case "ended":
					line += fmt.Sprintf(" %s: %s", ev.Cause, ev.Reason)
					if ev.Infra {
						line += " (infra)"
					}
				case "snapshotted":
					line += " " + ev.SnapshotId
				case "forked":
					line += " -> " + strings.Join(ev.Children, ",")
				case "dropped":
					line += fmt.Sprintf(" %d events lost (node %s)", ev.Dropped, orDash(ev.Node))
				}
				fmt.Println(line)
			}
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&labels, "label", nil, "only sandboxes with label key=value (repeatable)")
	f.StringVar(&selector, "selector", "", "label selector, as ls takes (k=v,k2!=v,!k3)")
	f.StringSliceVar(&o.Types, "type", nil, "event types to follow (repeatable or comma-separated; default all)")
	f.StringVar(&o.Project, "project", "", "with an admin key: one project's events only")
	return cmd
}

func snapshotCmd(g *globals) *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "snapshot ID | snapshot ls | snapshot rm SNAPSHOT",
		Short: "Snapshot a sandbox (prints the snapshot ID); ls and rm manage snapshots",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := g.client()
			ctx := cmd.Context()
			switch args[0] {
			case "ls", "list":
				list, err := c.ListSnapshots(ctx)
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, &dsecv1.ListSnapshotsResponse{Snapshots: list})
					return nil
				}
				tw := table("SNAPSHOT", "NAME", "FROM", "IMAGE", "SIZE", "CREATED")
				for _, s := range list {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.Id, orDash(s.Name), s.SandboxId, s.Image, humanBytes(s.SizeBytes), ago(s.CreatedAt.AsTime()))
				}
				return tw.Flush()
			case "rm", "delete":
				for _, id := range args[1:] {
					if err := c.DeleteSnapshot(ctx, id); err != nil {
						return err
					}
					fmt.Println(id)
				}
				return nil
			}
			snap, err := c.Snapshot(ctx, args[0], name)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, snap)
			} else {
				fmt.Println(snap.Id)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "a name for the snapshot")
	return cmd
}

func printCreates(g *globals, resp *dsecv1.CreateSandboxesResponse) error {
	if g.json() {
		printJSON(os.Stdout, resp)
	} else {
		for _, r := range resp.Results {
			if r.Error != nil {
				fmt.Fprintf(os.Stderr, "dsec: item %d: %s (%s)\n", r.Index, r.Error.Message, r.Error.Kind)
				continue
			}
			fmt.Println(r.Sandbox.Id)
		}
	}
	if resp.Failed > 0 {
		return fmt.Errorf("%d of %d failed", resp.Failed, len(resp.Results))
	}
	return nil
}

func forkCmd(g *globals) *cobra.Command {
	var n int
	var labels []string
	var key, session string
	cmd := &cobra.Command{
		Use:   "fork ID -n N",
		Short: "Snapshot a sandbox and create N children from it (prints their IDs)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			lm, err := parseKV(labels, "label")
			if err != nil {
				return err
			}
			resp, err := g.client().Fork(cmd.Context(), &dsecv1.ForkRequest{SandboxId: args[0], Count: int32(n), Labels: lm, IdempotencyKey: key, Session: session})
			if err != nil {
				return err
			}
			return printCreates(g, resp)
		},
	}
	cmd.Flags().IntVarP(&n, "count", "n", 1, "number of children")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "label key=value for the children (repeatable)")
	cmd.Flags().StringVar(&key, "idempotency-key", "", "return the same children when retried")
	cmd.Flags().StringVar(&session, "session", "", "bind the children to a session (default: the parent's)")
	return cmd
}

func pauseCmd(g *globals, op string) *cobra.Command {
	var labels []string
	cmd := &cobra.Command{
		Use:   op + " ID... | " + op + " --label k=v",
		Short: map[string]string{"pause": "Pause sandboxes (by ID or label); any later call resumes them", "resume": "Resume paused sandboxes (by ID or label)"}[op],
		RunE: func(cmd *cobra.Command, args []string) error {
			c := g.client()
			ctx := cmd.Context()
			if len(labels) > 0 {
				if len(args) > 0 {
					return fmt.Errorf("give IDs or --label, not both")
				}
				resp, err := c.Bulk(ctx, op, strings.Join(labels, ","))
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, resp)
				} else {
					for _, id := range resp.Ids {
						fmt.Println(id)
					}
				}
				for _, f := range resp.Failures {
					fmt.Fprintf(os.Stderr, "dsec: %s: %s\n", f.Id, f.Error.Message)
				}
				if len(resp.Failures) > 0 {
					return fmt.Errorf("%d sandboxes failed", len(resp.Failures))
				}
				return nil
			}
			if len(args) == 0 {
				return fmt.Errorf("give sandbox IDs or --label")
			}
			for _, id := range args {
				var s *dsecv1.Sandbox
				var err error
				if op == "pause" {
					s, err = c.Pause(ctx, id)
				} else {
					s, err = c.Resume(ctx, id)
				}
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, s)
				} else {
					fmt.Println(s.Id)
				}
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVarP(&labels, "label", "l", nil, "label selector term (repeatable)")
	return cmd
}

func logCmd(g *globals) *cobra.Command {
	var from uint64
	cmd := &cobra.Command{
		Use:   "log ID",
		Short: "Print a sandbox's trajectory log (-o json: JSON Lines, one entry per line)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			entries, err := g.client().Log(cmd.Context(), args[0], from)
			if err != nil {
				return err
			}
			if g.json() {
				for _, e := range entries {
					b, _ := protojson.MarshalOptions{UseProtoNames: true}.Marshal(e)
					fmt.Println(string(b))
				}
				return nil
			}
			tw := table("SEQ", "AT", "OP", "REQUEST", "RESULT", "CALL")
			for _, e := range entries {
				fmt.Fprintln(tw, logRow(e))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().Uint64Var(&from, "from", 0, "start at this sequence number")
	return cmd
}

// logRow is a log entry as a row of `dsec log`'s table (tab-separated):
// seq, time, op, request ID, result and what was called.
func logRow(e *dsecv1.LogEntry) string {
	what := strings.Join(e.Argv, " ")
	if mc := e.ModelCall; mc != nil {
		what = fmt.Sprintf("#%d %s %s %d tokens", mc.Index, mc.Endpoint, mc.Model, mc.PromptTokens+mc.CompletionTokens)
		if mc.Replayed {
			what += " (replayed)"
		}
		if mc.Diverged {
			what += " (diverged)"
		}
	} else if e.Op != "exec" {
		what = e.Path
		if e.To != "" {
			what += " → " + e.To
		}
	}
	if len(what) > 60 {
		what = what[:60] + "…"
	}
	res := "ok"
	switch {
	case e.Error != nil:
		res = "error: " + e.Error.Kind
	case e.Op == "exec":
		res = fmt.Sprintf("exit %d", e.Result.GetExitCode())
	case e.ModelCall != nil:
		res = fmt.Sprintf("status %d", e.ModelCall.Status)
	}
	return fmt.Sprintf("%d\t%s\t%s\t%s\t%s\t%s", e.Seq, e.At.AsTime().Format("15:04:05.000"), e.Op, orDash(e.RequestId), res, what)
}

func replayCmd(g *globals) *cobra.Command {
	var keep bool
	var until uint64
	cmd := &cobra.Command{
		Use:   "replay ID",
		Short: "Re-execute a sandbox's logged calls in a fresh sandbox and report divergences",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().Replay(cmd.Context(), &dsecv1.ReplayRequest{SandboxId: args[0], Keep: keep, UntilSeq: until})
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, resp)
			} else {
				for _, s := range resp.Steps {
					mark := "same"
					if s.Diverged {
						mark = "DIVERGED " + s.Detail
					}
					fmt.Printf("%4d %-10s %s\n", s.Seq, s.Op, mark)
				}
				fmt.Printf("replayed %d calls in %s: %d diverged\n", resp.Replayed, resp.SandboxId, resp.Diverged)
			}
			if resp.Diverged > 0 {
				return exitError(2)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the replay sandbox")
	cmd.Flags().Uint64Var(&until, "until", 0, "stop after this sequence number")
	return cmd
}

func rolloutCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "rollout", Short: "Agent rollouts: a command that runs on when its trainer goes, scored by a verifier"}
	var verifier string
	var timeout time.Duration
	var workers []string
	start := &cobra.Command{
		Use:   "start SANDBOX ROLLOUT -- CMD [ARG...]",
		Short: "Start an agent command as a rollout (an ID the sandbox has: show that rollout)",
		Args:  cobra.MinimumNArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.StartRolloutRequest{SandboxId: args[0], RolloutId: args[1], Argv: args[2:], TimeoutS: timeout.Seconds(), Workers: workers}
			if verifier != "" {
				req.Verifier = &dsecv1.RolloutVerifier{Cmd: verifier}
			}
			r, err := g.client().StartRollout(cmd.Context(), req)
			if err != nil {
				return err
			}
			printRollout(g, r)
			return nil
		},
	}
	start.Flags().StringVar(&verifier, "verifier", "", "a shell command run when the agent ended: the last line of its stdout, as a number, is the reward")
	start.Flags().DurationVar(&timeout, "timeout", 0, "the rollout's deadline (default: the node's longest exec timeout)")
	start.Flags().StringSliceVar(&workers, "worker", nil, "a sandbox the agent drives through the dsec API at $DSEC_URL (repeat or comma-separate; the agent's sandbox needs --model-gateway)")
	var wait time.Duration
	get := &cobra.Command{
		Use:   "get SANDBOX ROLLOUT [--wait D]",
		Short: "Show a rollout; with --wait, once it ended (or D passed)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := g.client().GetRollout(cmd.Context(), args[0], args[1], min(wait, 300*time.Second))
			if err != nil {
				return err
			}
			printRollout(g, r)
			return nil
		},
	}
	get.Flags().DurationVar(&wait, "wait", 0, "wait up to this long for it to end (at most 5m)")
	var from uint64
	watch := &cobra.Command{
		Use:   "watch SANDBOX ROLLOUT [--from-seq N]",
		Short: "Follow a rollout: each model call and command as it happens, then its outcome",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := g.client().WatchRollout(cmd.Context(), args[0], args[1], from, func(e *dsecv1.LogEntry) error {
				if g.json() {
					b, _ := protojson.MarshalOptions{UseProtoNames: true}.Marshal(e)
					fmt.Println(string(b)) // JSON Lines, as dsec log's
					return nil
				}
				fmt.Println(strings.ReplaceAll(logRow(e), "\t", "  "))
				return nil
			})
			if err != nil {
				return err
			}
			printRollout(g, r)
			return nil
		},
	}
	watch.Flags().Uint64Var(&from, "from-seq", 0, "the first log entry to show (default: the one after the rollout's start)")
	cmd.AddCommand(start, get, watch)
	return cmd
}

func printRollout(g *globals, r *dsecv1.Rollout) {
	if g.json() {
		printJSON(os.Stdout, r)
		return
	}
	reward := "-"
	if r.HasReward {
		reward = fmt.Sprint(r.Reward)
	}
	fmt.Printf("%s %s: %s, reward %s, %d model calls, %d commands", r.SandboxId, r.RolloutId, r.State, reward, r.ModelCalls, r.Commands)
	if r.WorkerCalls > 0 {
		fmt.Printf(", %d worker calls (%d from the log)", r.WorkerCalls, r.WorkerReplays)
	}
	if r.Divergence != "" {
		fmt.Printf(", diverged: %s", r.Divergence)
	}
	if r.Detail != "" {
		fmt.Printf(" (%s)", r.Detail)
	}
	fmt.Println()
}

func sessionCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "session", Short: "Trainer sessions (leases)"}
	cmd.AddCommand(&cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List sessions",
		RunE: func(cmd *cobra.Command, _ []string) error {
			list, err := g.client().ListSessions(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, &dsecv1.ListSessionsResponse{Sessions: list})
				return nil
			}
			tw := table("SESSION", "STATE", "HEARTBEAT", "GRACE", "ON EXPIRE", "LAST HEARTBEAT")
			for _, s := range list {
				fmt.Fprintf(tw, "%s\t%s\t%ds\t%ds\t%s\t%s\n", s.Name, s.State, s.HeartbeatS, s.GraceS, s.OnExpire, ago(s.LastHeartbeat.AsTime()))
			}
			return tw.Flush()
		},
	})
	var del bool
	closeCmd := &cobra.Command{
		Use:   "close NAME",
		Short: "Close a session (--delete also deletes its sandboxes)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := g.client().CloseSession(cmd.Context(), args[0], del)
			return err
		},
	}
	closeCmd.Flags().BoolVar(&del, "delete", false, "delete the session's sandboxes")
	cmd.AddCommand(closeCmd)
	cmd.AddCommand(sessionModelsCmd(g))
	return cmd
}

func sessionModelsCmd(g *globals) *cobra.Command {
	var file string
	cmd := &cobra.Command{
		Use:   "models [NAME] [-f upstreams.json]",
		Short: "Show a session's model upstreams (no NAME: the project's own), or set them from a file (JSON of SetModelUpstreamsRequest; - reads stdin)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			args = append(args, "")
			var out *dsecv1.ModelUpstreams
			var err error
			if file == "" {
				out, err = g.client().GetModelUpstreams(cmd.Context(), args[0])
			} else {
				var b []byte
				if file == "-" {
					b, err = io.ReadAll(os.Stdin)
				} else {
					b, err = os.ReadFile(file)
				}
				if err != nil {
					return err
				}
				req := &dsecv1.SetModelUpstreamsRequest{}
				if err := protojson.Unmarshal(b, req); err != nil {
					return fmt.Errorf("%s: %w", file, err)
				}
				req.Session = args[0]
				out, err = g.client().SetModelUpstreams(cmd.Context(), req)
			}
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, out)
				return nil
			}
			tw := table("UPSTREAM", "API", "BASE URL", "KEY", "MODELS")
			for _, u := range out.Upstreams {
				key := "-"
				if u.HasApiKey {
					key = "set"
				}
				models := strings.Join(u.Models, ",")
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", u.Name, orDash(u.Api), u.BaseUrl, key, orDash(models))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "set the upstreams from this JSON file")
	return cmd
}

func capacityCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "capacity",
		Short: "Show free slots, the start queue, the start rate and warm pools",
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client().Capacity(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, c)
				return nil
			}
			fmt.Printf("sandboxes: %d running, %d free of %d\n", c.Running, c.FreeSlots, c.MaxSandboxes)
			fmt.Printf("starts: %.1f/s recently, at most %d at once; queue %d of %d\n", c.StartsPerS, c.MaxConcurrentStarts, c.QueueDepth, c.QueueLimit)
			for _, p := range c.Pools {
				fmt.Printf("pool %s: %d/%d ready, %d hits, %d misses\n", p.Key, p.Ready, p.Target, p.Hits, p.Misses)
			}
			return nil
		},
	}
}
