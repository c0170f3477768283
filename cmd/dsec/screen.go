package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func screenshotCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "screenshot ID FILE.png",
		Short: "Save a sandbox's screen as PNG (kind vm); - writes to stdout",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			shot, err := g.client().Sandbox(args[0]).Screenshot(cmd.Context())
			if err != nil {
				return err
			}
			if args[1] == "-" {
				_, err = os.Stdout.Write(shot.Png)
				return err
			}
			if err := os.WriteFile(args[1], shot.Png, 0o644); err != nil {
				return err
			}
			if !g.json() {
				fmt.Fprintf(os.Stderr, "%s: %dx%d\n", args[1], shot.Width, shot.Height)
			}
			return nil
		},
	}
}

func vncCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "vnc ID",
		Short: "Give a sandbox's VNC server a new password and print its loopback address and the password (kind vm, node with vm.vnc)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			v, err := g.client().Sandbox(args[0]).OpenVNC(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, v)
				return nil
			}
			fmt.Printf("address  %s (on the node)\npassword %s\nexpires  %s\n", v.Address, v.Password, until(v.ExpiresAt.AsTime()))
			return nil
		},
	}
}

func inputCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "input ID ACTION ARG [ACTION ARG]...",
		Short: "Type, press keys and use the mouse on a sandbox's screen (kind vm), in order",
		Long: `Actions, run in order:
  type TEXT          type TEXT (US keyboard layout)
  key COMBO          press a key combination: Return, ctrl+c, alt+F4, shift+Tab, ...
  move X,Y           move the pointer to a screen position (pixels)
  click X,Y[,BUTTON[,COUNT]]
                     click there (BUTTON left, middle or right; COUNT 2 is a double click)
  button BUTTON,down|up
                     press or release a button where the pointer is
  scroll DX,DY       turn the wheel (DY > 0 scrolls down)

Example: dsec input ID type 'ls /' key Return click 100,200`,
		Args: cobra.MinimumNArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			actions, err := parseInput(args[1:])
			if err != nil {
				return err
			}
			return g.client().Sandbox(args[0]).Input(cmd.Context(), actions...)
		},
	}
}

// parseInput parses "ACTION ARG" pairs of `dsec input`.
func parseInput(args []string) ([]*dsecv1.InputAction, error) {
	if len(args)%2 != 0 {
		return nil, fmt.Errorf("action %q has no argument", args[len(args)-1])
	}
	ints := func(s string, n int) ([]int, []string, error) {
		parts := strings.Split(s, ",")
		if len(parts) < n {
			return nil, nil, fmt.Errorf("%q: want %d comma-separated numbers", s, n)
		}
		out := make([]int, n)
		for i := range out {
			v, err := strconv.Atoi(strings.TrimSpace(parts[i]))
			if err != nil {
				return nil, nil, fmt.Errorf("%q: %v", s, err)
			}
			out[i] = v
		}
		return out, parts[n:], nil
	}
	var out []*dsecv1.InputAction
	for i := 0; i < len(args); i += 2 {
		verb, arg := args[i], args[i+1]
		switch verb {
		case "type":
			out = append(out, dsec.TypeText(arg))
		case "key", "keys":
			out = append(out, dsec.PressKeys(arg))
		case "move":
			xy, _, err := ints(arg, 2)
			if err != nil {
				return nil, err
			}
			out = append(out, dsec.MoveMouse(xy[0], xy[1]))
		case "click":
			xy, rest, err := ints(arg, 2)
			if err != nil {
				return nil, err
			}
			button, count := "", 0
			if len(rest) > 0 {
				button = rest[0]
			}
			if len(rest) > 1 {
				if count, err = strconv.Atoi(rest[1]); err != nil {
					return nil, fmt.Errorf("click %q: count: %v", arg, err)
				}
			}
			out = append(out, dsec.Click(xy[0], xy[1], button, count))
		case "button":
			b, state, ok := strings.Cut(arg, ",")
			if !ok || (state != "down" && state != "up") {
				return nil, fmt.Errorf("button %q: want BUTTON,down or BUTTON,up", arg)
			}
			out = append(out, dsec.MouseButton(b, state == "down"))
		case "scroll":
			d, _, err := ints(arg, 2)
			if err != nil {
				return nil, err
			}
			out = append(out, dsec.Scroll(d[0], d[1]))
		default:
			return nil, fmt.Errorf("unknown input action %q (type, key, move, click, button, scroll)", verb)
		}
	}
	return out, nil
}
