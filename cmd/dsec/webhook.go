package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func webhookCmd(g *globals) *cobra.Command {
	var o dsec.WebhookOptions
	var labels []string
	var selector, secretFile string
	cmd := &cobra.Command{
		Use:   "webhook create --url URL --secret-file FILE | webhook ls | webhook enable|disable|rm ID...",
		Short: "Register URLs that receive sandbox lifecycle events as signed POSTs (create prints the webhook's ID)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := g.client()
			ctx := cmd.Context()
			switch args[0] {
			case "create":
				if len(args) != 1 {
					return fmt.Errorf("create takes flags only")
				}
				if secretFile != "" {
					b, err := os.ReadFile(secretFile)
					if err != nil {
						return err
					}
					o.Secret = strings.TrimSpace(string(b))
				}
				if o.Secret == "" {
					o.Secret = os.Getenv("DSEC_WEBHOOK_SECRET")
				}
				o.Labels = strings.Join(append(labels, selectorParts(selector)...), ",")
				w, err := c.CreateWebhook(ctx, o)
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, w)
				} else {
					fmt.Println(w.Id)
				}
				return nil
			case "ls", "list":
				list, err := c.Webhooks(ctx)
				if err != nil {
					return err
				}
				if g.json() {
					printJSON(os.Stdout, &dsecv1.ListWebhooksResponse{Webhooks: list})
					return nil
				}
				tw := table("WEBHOOK", "NAME", "URL", "ENABLED", "SELECTOR", "TYPES", "FORMAT", "CREATED")
				for _, w := range list {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%s\t%s\t%s\t%s\n", w.Id, orDash(w.Name), w.Url, w.Enabled, orDash(w.LabelSelector),
						orDash(strings.Join(w.Types, ",")), w.Format, ago(w.CreatedAt.AsTime()))
				}
				return tw.Flush()
			case "enable", "disable":
				for _, id := range args[1:] {
					if _, err := c.EnableWebhook(ctx, id, args[0] == "enable"); err != nil {
						return err
					}
					fmt.Println(id)
				}
				return nil
			case "rm", "delete":
				for _, id := range args[1:] {
					if err := c.DeleteWebhook(ctx, id); err != nil {
						return err
					}
					fmt.Println(id)
				}
				return nil
			}
			return fmt.Errorf("unknown webhook command %q (want create, ls, enable, disable or rm)", args[0])
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.URL, "url", "", "create: the URL that receives the events (http or https)")
	f.StringVar(&secretFile, "secret-file", "", "create: file holding the secret deliveries are signed with (default: env DSEC_WEBHOOK_SECRET)")
	f.StringVar(&o.Name, "name", "", "create: a name for it")
	f.StringArrayVar(&labels, "label", nil, "create: only sandboxes with label key=value (repeatable)")
	f.StringVar(&selector, "selector", "", "create: label selector, as ls takes (k=v,k2!=v,!k3)")
	f.StringSliceVar(&o.Types, "type", nil, "create: event types to deliver (repeatable or comma-separated; default all)")
	f.BoolVar(&o.Disabled, "disabled", false, "create: register it without delivering yet")
	return cmd
}
