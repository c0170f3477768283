package main

import (
	"archive/tar"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/spf13/cobra"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/buildctx"
	"github.com/opendsec/dsec/internal/image"
)

func imageCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "image", Short: "Manage images"}
	cmd.AddCommand(imageImportCmd(g), imageLsCmd(g), imageRmCmd(g), imageBootstrapCmd(g), imageBuildVMCmd(g), imageImportVMCmd(g), imageBuildCmd(g), imagePruneCmd(g), imagePushCmd(g), imageExportCmd(g))
	return cmd
}

func imageImportCmd(g *globals) *cobra.Command {
	var as string
	var insecure bool
	cmd := &cobra.Command{
		Use:   "import SRC --name NAME",
		Short: "Import an image: a `docker save` archive, an OCI layout directory or archive, a registry reference, or the http(s) URL of an OCI layout (`dsec image export`; loaded on demand)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			src := args[0]
			c := g.client()
			bar := newProgress("import " + src)
			var img *dsecv1.Image
			var err error
			if st, statErr := os.Stat(src); statErr == nil {
				if as == "" {
					return fmt.Errorf("--name is required for a local archive")
				}
				var r io.Reader
				size := st.Size()
				if st.IsDir() {
					// An OCI layout directory travels as a tar stream.
					size = 0
					pr, pw := io.Pipe()
					go func() { pw.CloseWithError(tarTree(src, pw)) }()
					r = pr
				} else {
					f, err := os.Open(src)
					if err != nil {
						return err
					}
					defer f.Close()
					r = f
				}
				img, err = c.UploadImage(cmd.Context(), as, size, r, func(n int64) { bar.update("upload", "", n, size) })
			} else if image.IsURL(src) {
				if as == "" {
					return fmt.Errorf("--name is required for an image on an HTTP server")
				}
				req := &dsecv1.PullImageRequest{Ref: src, Name: as}
				img, err = c.PullImage(cmd.Context(), req, func(p *dsecv1.ImageProgress) { bar.update(p.Phase, p.Message, p.DoneBytes, p.TotalBytes) })
			} else {
				ref, perr := name.ParseReference(src)
				if perr != nil {
					return fmt.Errorf("%s is neither a local file nor an image reference: %v", src, perr)
				}
				req := &dsecv1.PullImageRequest{Ref: src, Name: as, Insecure: insecure, Auth: registryAuth(ref)}
				img, err = c.PullImage(cmd.Context(), req, func(p *dsecv1.ImageProgress) { bar.update(p.Phase, p.Message, p.DoneBytes, p.TotalBytes) })
			}
			bar.finish()
			if err != nil {
				return err
			}
			printImage(g, img)
			return nil
		},
	}
	cmd.Flags().StringVar(&as, "name", "", "store the image under this name")
	cmd.Flags().BoolVar(&insecure, "insecure", false, "allow a plain-HTTP registry")
	return cmd
}

// registryAuth is the user's docker config credentials for ref's
// registry, as docker uses them (nil: none; the node then uses its own).
func registryAuth(ref name.Reference) *dsecv1.RegistryAuth {
	a, err := authn.DefaultKeychain.Resolve(ref.Context())
	if err != nil || a == authn.Anonymous {
		return nil
	}
	cfg, err := a.Authorization()
	if err != nil {
		return nil
	}
	return &dsecv1.RegistryAuth{Username: cfg.Username, Password: cfg.Password, IdentityToken: cfg.IdentityToken, RegistryToken: cfg.RegistryToken}
}

func imageExportCmd(g *globals) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use:   "export NAME -o DIR|FILE.tar|-",
		Short: "Write an image as an OCI image layout of its layers' EROFS files: put the directory on any HTTP server or object store and `dsec image import https://host/prefix/ --name NAME` loads it on demand",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := g.client()
			switch {
			case out == "-":
				return c.ExportImage(cmd.Context(), args[0], os.Stdout)
			case strings.HasSuffix(out, ".tar"):
				f, err := os.Create(out)
				if err != nil {
					return err
				}
				if err := c.ExportImage(cmd.Context(), args[0], f); err != nil {
					f.Close()
					os.Remove(out)
					return err
				}
				return f.Close()
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return err
			}
			pr, pw := io.Pipe()
			done := make(chan error, 1)
			go func() { done <- image.UnpackLayout(pr, out) }()
			err := c.ExportImage(cmd.Context(), args[0], pw)
			pw.CloseWithError(err)
			if uerr := <-done; err == nil {
				err = uerr
			}
			if err == nil {
				fmt.Printf("%s: an OCI image layout (index.json, blobs/); serve it and import its URL\n", out)
			}
			return err
		},
	}
	cmd.Flags().StringVarP(&out, "output", "o", "", "a directory to write the layout into, a .tar file, or - for a tar on stdout")
	cmd.MarkFlagRequired("output")
	return cmd
}

func imagePushCmd(g *globals) *cobra.Command {
	var insecure, onDemand bool
	cmd := &cobra.Command{
		Use:   "push NAME REF",
		Short: "Push an image to a registry (credentials from your docker config), as an OCI image",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, err := name.ParseReference(args[1])
			if err != nil {
				return fmt.Errorf("%s is not an image reference: %v", args[1], err)
			}
			bar := newProgress("push " + args[0])
			req := &dsecv1.PushImageRequest{Name: args[0], Ref: args[1], Insecure: insecure, Auth: registryAuth(ref), OnDemand: onDemand}
			pushed := ""
			_, err = g.client().PushImage(cmd.Context(), req, func(p *dsecv1.ImageProgress) {
				if p.Phase == "done" {
					pushed = p.Message
					return
				}
				bar.update(p.Phase, "", p.DoneBytes, p.TotalBytes)
			})
			bar.finish()
			if err != nil {
				return err
			}
			fmt.Println(pushed)
			return nil
		},
	}
	cmd.Flags().BoolVar(&insecure, "insecure", false, "allow a plain-HTTP registry")
	cmd.Flags().BoolVar(&onDemand, "on-demand", false, "push the layers' EROFS files instead: dsec nodes that pull it load each layer's data from the registry as sandboxes read it")
	return cmd
}

// tarTree writes a directory (an OCI layout) as a tar stream.
func tarTree(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if !info.Mode().IsRegular() && !info.IsDir() {
			return nil
		}
		hdr, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func shortDigest(d string) string {
	d = strings.TrimPrefix(d, "sha256:")
	if len(d) > 12 {
		return d[:12]
	}
	return d
}

func imageLsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List images",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			imgs, err := g.client().ListImages(cmd.Context())
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, &dsecv1.ListImagesResponse{Images: imgs})
				return nil
			}
			tw := table("NAME", "DIGEST", "LAYERS", "SIZE", "SOURCE", "CREATED")
			for _, i := range imgs {
				layers := fmt.Sprint(len(i.Layers))
				if i.Vm != nil {
					layers = "vm disk"
				}
				source := i.Source
				if od := i.OnDemand; od != nil {
					source += fmt.Sprintf(", %s of %s here", humanBytes(od.CachedBytes), humanBytes(od.DataBytes))
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", i.Name, shortDigest(i.Digest), layers, humanBytes(i.SizeBytes), source, ago(i.CreatedAt.AsTime()))
			}
			return tw.Flush()
		},
	}
}

func imageRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME...",
		Short: "Delete images (running sandboxes keep their layers)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, n := range args {
				if err := g.client().DeleteImage(cmd.Context(), n); err != nil {
					return err
				}
				fmt.Println(n)
			}
			return nil
		},
	}
}

func imageBootstrapCmd(g *globals) *cobra.Command {
	var as string
	var force bool
	var pkgs []string
	cmd := &cobra.Command{
		Use:   "bootstrap busybox|debian|polyglot|base [--name NAME]",
		Short: "Build a base image offline: busybox from busybox-static, debian with debootstrap from the host's apt mirror, base (E2B's base template) and polyglot (every SandboxFusion language) as a layer on top of debian",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			bar := newProgress("bootstrap " + args[0])
			img, err := g.client().BootstrapImage(cmd.Context(), &dsecv1.BootstrapImageRequest{Recipe: args[0], Name: as, Force: force, Packages: pkgs},
				func(p *dsecv1.ImageProgress) { bar.update(p.Phase, p.Message, p.DoneBytes, p.TotalBytes) })
			bar.finish()
			if err != nil {
				return err
			}
			if g.json() {
				printJSON(os.Stdout, img)
			} else {
				fmt.Printf("%s %s (%s)\n", img.Name, shortDigest(img.Digest), humanBytes(img.SizeBytes))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&as, "name", "", "image name (default: the recipe)")
	cmd.Flags().BoolVar(&force, "force", false, "rebuild even if the image or its cached root filesystem exists")
	cmd.Flags().StringArrayVar(&pkgs, "package", nil, "extra Debian package for the debian and polyglot recipes, or base's own layer (repeatable)")
	return cmd
}

func imageBuildVMCmd(g *globals) *cobra.Command {
	var as string
	var force bool
	var pkgs []string
	var diskMB int64
	cmd := &cobra.Command{
		Use:   "build-vm debian [--name NAME]",
		Short: "Build a bootable VM image (kind vm) offline: Debian from the host's apt mirror, its kernel, systemd, GRUB and the agent's service",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			bar := newProgress("build-vm " + args[0])
			img, err := g.client().BootstrapImage(cmd.Context(), &dsecv1.BootstrapImageRequest{Recipe: args[0], Name: as, Force: force, Packages: pkgs, Vm: true, DiskMb: diskMB},
				func(p *dsecv1.ImageProgress) { bar.update(p.Phase, p.Message, p.DoneBytes, p.TotalBytes) })
			bar.finish()
			if err != nil {
				return err
			}
			printImage(g, img)
			return nil
		},
	}
	cmd.Flags().StringVar(&as, "name", "", "image name (default: RECIPE-vm)")
	cmd.Flags().BoolVar(&force, "force", false, "rebuild even if the image or its cached disk exists")
	cmd.Flags().StringArrayVar(&pkgs, "package", nil, "extra Debian package (repeatable)")
	cmd.Flags().Int64Var(&diskMB, "disk-mb", 0, "disk size in MiB (default 4096; sparse)")
	return cmd
}

func imageImportVMCmd(g *globals) *cobra.Command {
	var as string
	cmd := &cobra.Command{
		Use:   "import-vm FILE --name NAME",
		Short: "Import a bootable disk image (qcow2 or raw) that runs dsec-guest as a VM image (kind vm; see docs/substrates/vm.md)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if as == "" {
				return fmt.Errorf("--name is required")
			}
			f, err := os.Open(args[0])
			if err != nil {
				return err
			}
			defer f.Close()
			st, err := f.Stat()
			if err != nil {
				return err
			}
			bar := newProgress("import-vm " + args[0])
			img, err := g.client().UploadVMImage(cmd.Context(), as, st.Size(), f, func(n int64) { bar.update("upload", "", n, st.Size()) })
			bar.finish()
			if err != nil {
				return err
			}
			printImage(g, img)
			return nil
		},
	}
	cmd.Flags().StringVar(&as, "name", "", "store the image under this name")
	return cmd
}

// printImage prints a built or imported image.
func printImage(g *globals, img *dsecv1.Image) {
	if g.json() {
		printJSON(os.Stdout, img)
		return
	}
	if vm := img.GetVm(); vm != nil {
		boot := "firmware"
		if vm.DirectBoot {
			boot = "firmware or direct"
		}
		fmt.Printf("%s %s (VM image: %s disk, boots through %s, %s)\n", img.Name, shortDigest(img.Digest), humanBytes(vm.DiskBytes), boot, humanBytes(img.SizeBytes))
		return
	}
	fmt.Printf("%s %s (%d layers, %s)\n", img.Name, shortDigest(img.Digest), len(img.Layers), humanBytes(img.SizeBytes))
}

func sortStrings(s []string) { sort.Strings(s) }

func imageBuildCmd(g *globals) *cobra.Command {
	var file, as, target, network string
	var buildArgs []string
	var noCache, quiet bool
	var stepTimeout time.Duration
	cmd := &cobra.Command{
		Use:   "build [CONTEXT] --name NAME [-f Dockerfile]",
		Short: "Build an image from a Dockerfile: each RUN in a sandbox, each step a cached layer",
		Long: "Build an image from a Dockerfile. The context directory (default: none) is sent to the server,\n" +
			"minus what its .dockerignore excludes; RUN steps run in container sandboxes of your project,\n" +
			"and steps whose parent, text, arguments and copied files did not change come from the build cache.\n" +
			"Supported: FROM (images, stages, scratch), RUN, COPY (--from, --chown, --chmod), ADD of local files and\n" +
			"archives, ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE, SHELL; others are refused by name.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if as == "" {
				return fmt.Errorf("--name is required")
			}
			req := &dsecv1.BuildImageRequest{Name: as, Target: target, NoCache: noCache, Network: network, StepTimeoutS: int64(stepTimeout / time.Second), BuildArgs: map[string]string{}}
			for _, kv := range buildArgs {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					// As docker: --build-arg NAME takes the value from the environment.
					if v, ok = os.LookupEnv(k); !ok {
						continue
					}
				}
				req.BuildArgs[k] = v
			}
			if file == "" {
				if len(args) == 0 {
					return fmt.Errorf("give a context directory or -f Dockerfile")
				}
				file = filepath.Join(args[0], "Dockerfile")
			}
			var df []byte
			var err error
			if file == "-" {
				df, err = io.ReadAll(os.Stdin)
			} else {
				df, err = os.ReadFile(file)
			}
			if err != nil {
				return err
			}
			req.Dockerfile = string(df)
			c := g.client()
			if len(args) == 1 {
				pr, pw := io.Pipe()
				go func() {
					_, err := buildctx.Tar(args[0], pw)
					pw.CloseWithError(err)
				}()
				bar := newProgress("context " + args[0])
				bc, err := c.UploadBuildContext(cmd.Context(), pr, func(n int64) { bar.update("upload", humanBytes(n), 0, 0) })
				pr.CloseWithError(io.ErrClosedPipe)
				if err != nil {
					bar.finish()
					return err
				}
				bar.update("done", fmt.Sprintf("%d files, %s", bc.Files, humanBytes(bc.SizeBytes)), 0, 0)
				req.ContextDigest = bc.Digest
			}
			img, err := c.BuildImage(cmd.Context(), req, func(p *dsecv1.ImageProgress) {
				switch p.Phase {
				case "step", "build":
					fmt.Fprintln(os.Stderr, p.Message)
				case "output":
					if !quiet {
						os.Stderr.WriteString(p.Message)
					}
				}
			})
			if err != nil {
				return err
			}
			printImage(g, img)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "file", "f", "", "the Dockerfile (default: CONTEXT/Dockerfile; - reads standard input)")
	f.StringVar(&as, "name", "", "store the image under this name")
	f.StringArrayVar(&buildArgs, "build-arg", nil, "set a build argument: NAME=VALUE (or NAME, from the environment); repeatable")
	f.StringVar(&target, "target", "", "build this stage rather than the last")
	f.BoolVar(&noCache, "no-cache", false, "run every step, whatever the build cache holds")
	f.StringVar(&network, "network", "", "the RUN steps' network: none or egress (default: the server's default for sandboxes)")
	f.DurationVar(&stepTimeout, "step-timeout", 0, "bound each RUN step (default 1h)")
	f.BoolVarP(&quiet, "quiet", "q", false, "do not print the steps' output")
	return cmd
}

func imagePruneCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "prune",
		Short: "Remove what the nodes keep as a cache for your project: its build cache, unused copies of images loaded from other nodes (an operator's: every project's, and unused cached chunks)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := g.client().PruneImages(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Printf("removed %d cached build steps and %d image copies; freed %d MiB of layers and %d MiB of cached chunks\n",
				p.GetRemoved(), p.GetCopies(), p.GetLayerBytes()>>20, p.GetChunkBytes()>>20)
			return nil
		},
	}
}

func commitCmd(g *globals) *cobra.Command {
	var as string
	cmd := &cobra.Command{
		Use:   "commit SANDBOX --name NAME",
		Short: "Store a running container sandbox's files, environment, user and working directory as an image",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if as == "" {
				return fmt.Errorf("--name is required")
			}
			img, err := g.client().CommitSandbox(cmd.Context(), args[0], as)
			if err != nil {
				return err
			}
			printImage(g, img)
			return nil
		},
	}
	cmd.Flags().StringVar(&as, "name", "", "store the image under this name")
	return cmd
}
