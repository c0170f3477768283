package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// policyFlags are the flags that make a network policy (create, network
// set).
type policyFlags struct {
	allow, deny, creds []string
}

func (p *policyFlags) flags(f *pflag.FlagSet) {
	f.StringArrayVar(&p.allow, "allow", nil, "egress policy: allow a destination, an IPv4 address or CIDR, a host name, *.domain or * (repeatable; implies --network egress; what no rule allows is denied)")
	f.StringArrayVar(&p.deny, "deny", nil, "egress policy: deny a destination, as --allow (repeatable; the most specific rule wins)")
	f.StringArrayVar(&p.creds, "credential", nil, "egress policy: a brokered credential of the server's configuration, by name; the node's proxy injects it into plain-HTTP requests to its host (repeatable)")
}

// set reports whether any policy flag was given.
func (p *policyFlags) set(cmd *cobra.Command) bool {
	return cmd.Flags().Changed("allow") || cmd.Flags().Changed("deny") || cmd.Flags().Changed("credential")
}

func (p *policyFlags) policy() *dsec.Policy {
	out := &dsec.Policy{Allow: p.allow, Deny: p.deny}
	for _, c := range p.creds {
		out.Credentials = append(out.Credentials, dsec.Credential{Name: c})
	}
	return out
}

func networkCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "network", Short: "Show or change a sandbox's egress policy, and read its connection log"}
	cmd.AddCommand(&cobra.Command{
		Use:   "get ID",
		Short: "Show a sandbox's network mode and egress policy",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			nw, err := g.client().Sandbox(args[0]).NetworkPolicy(cmd.Context())
			if err != nil {
				return err
			}
			printNetwork(g, nw)
			return nil
		},
	})
	var p policyFlags
	var unrestricted bool
	set := &cobra.Command{
		Use:   "set ID [--allow DEST]... [--deny DEST]... [--credential NAME]... | --unrestricted",
		Short: "Put an egress policy in force for a sandbox's new connections (no rules: deny everything)",
		Long: "Put an egress policy in force for a sandbox's new connections; open connections it denies are cut.\n" +
			"Without --allow, --deny or --credential the policy denies everything; --unrestricted lifts every restriction.\n\n" +
			"  dsec network set ID --allow '*.pypi.org' --allow files.pythonhosted.org   # setup: the package mirror only\n" +
			"  dsec network set ID                                                       # rollout: nothing",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var pol *dsec.Policy
			switch {
			case unrestricted && p.set(cmd):
				return fmt.Errorf("--unrestricted takes no rules")
			case !unrestricted:
				pol = p.policy()
			}
			nw, err := g.client().Sandbox(args[0]).SetNetworkPolicy(cmd.Context(), pol)
			if err != nil {
				return err
			}
			printNetwork(g, nw)
			return nil
		},
	}
	p.flags(set.Flags())
	set.Flags().BoolVar(&unrestricted, "unrestricted", false, "lift every restriction (egress to the whole internet)")
	cmd.AddCommand(set)
	var after uint64
	logCmd := &cobra.Command{
		Use:   "log ID",
		Short: "Show the connections a sandbox opened, allowed and denied",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := g.client().Sandbox(args[0]).NetworkLog(cmd.Context(), after)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, r)
				return nil
			}
			tw := table("SEQ", "TIME", "VERDICT", "PROTO", "DESTINATION", "HOST", "REASON")
			for _, c := range r.Records {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s:%d\t%s\t%s\n", c.Seq, c.At.AsTime().Local().Format("15:04:05.000"), c.Verdict, c.Protocol, c.Address, c.Port, orDash(c.Host), c.Reason)
			}
			if r.Dropped > 0 {
				fmt.Fprintf(tw, "(%d records not kept)\n", r.Dropped)
			}
			return tw.Flush()
		},
	}
	logCmd.Flags().Uint64Var(&after, "after", 0, "show the records after this sequence number")
	cmd.AddCommand(logCmd)
	return cmd
}

// printNetwork prints a network as JSON or as the rules a user writes.
func printNetwork(g *globals, nw *dsecv1.Network) {
	if g.json() {
		printJSON(os.Stdout, nw)
		return
	}
	fmt.Printf("mode: %s\n", nw.GetMode())
	switch {
	case nw.GetMode() != "egress":
	case nw.Policy == nil:
		fmt.Println("policy: none (unrestricted egress)")
	case len(nw.Policy.Rules) == 0 && len(nw.Policy.Credentials) == 0:
		fmt.Println("policy: deny everything")
	default:
		for _, r := range nw.Policy.Rules {
			fmt.Printf("%s %s\n", r.Action, r.Destination)
		}
		for _, c := range nw.Policy.Credentials {
			if c.Name != "" {
				fmt.Printf("credential %s\n", c.Name)
			} else {
				fmt.Printf("credential %s (header %s)\n", c.Host, strings.TrimSpace(c.Header))
			}
		}
	}
}
