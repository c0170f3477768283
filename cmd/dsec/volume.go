package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func volumeCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "volume", Short: "Manage volumes: named file systems of a project that outlive sandboxes (mount one with `dsec create --volume NAME:/PATH[:ro]`)"}
	cmd.AddCommand(volumeCreateCmd(g), volumeLsCmd(g), volumeRmCmd(g))
	return cmd
}

func volumeCreateCmd(g *globals) *cobra.Command {
	var (
		size   string
		labels []string
		node   string
	)
	cmd := &cobra.Command{
		Use:   "create NAME [--size 1G]",
		Short: "Create an empty volume and print its ID",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			o := dsec.VolumeOptions{Node: node}
			var err error
			if o.SizeMB, err = parseMemory(size); err != nil {
				return fmt.Errorf("--size: %w", err)
			}
			if o.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			v, err := g.client().CreateVolume(cmd.Context(), args[0], o)
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, v)
			} else {
				fmt.Println(v.Id)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&size, "size", "", "size, its limit: e.g. 512M or 10G (default: the node's, 1G)")
	f.StringArrayVar(&labels, "label", nil, "label key=value (repeatable)")
	f.StringVar(&node, "node", "", "put it on this node (cluster mode; sandboxes that mount it run there)")
	return cmd
}

func volumeLsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List volumes",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			vols, err := g.client().ListVolumes(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, &dsecv1.ListVolumesResponse{Volumes: vols})
				return nil
			}
			tw := table("NAME", "ID", "NODE", "SIZE", "USED", "MOUNTED BY", "CREATED")
			for _, v := range vols {
				var by []string
				if v.Writer != "" {
					by = append(by, v.Writer+" (rw)")
				}
				for _, r := range v.Readers {
					by = append(by, r+" (ro)")
				}
				if len(by) == 0 {
					by = []string{"-"}
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.Name, v.Id, v.Node, humanBytes(v.SizeMb<<20), humanBytes(v.UsedBytes), strings.Join(by, ", "), ago(v.CreatedAt.AsTime()))
			}
			return tw.Flush()
		},
	}
}

func volumeRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME|ID...",
		Short: "Delete volumes and their content (a volume a live sandbox mounts is refused)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, n := range args {
				if err := g.client().DeleteVolume(cmd.Context(), n); err != nil {
					return err
				}
				fmt.Println(n)
			}
			return nil
		},
	}
}
