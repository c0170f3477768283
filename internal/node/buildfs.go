package node

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/dockerfile"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
)

// The file side of builds: a stage's root as a private overlay of its
// layers, and COPY and ADD, which write the files they copy into it as a
// tar that image.ExtractTar unpacks resolving every name inside the root
// (a chroot's view: an image's absolute symlinks such as /bin -> /usr/bin
// lead where they lead inside it). Sources are read through file
// descriptors resolved inside their root (the build context or another
// stage) the same way: a symlink in the context never reaches the node's
// files.

// maxMountData is the kernel's limit on mount options (one page).
const maxMountData = 4095

// withRoot mounts layers (bottom first) as an overlay, writable with a
// fresh upper directory or read-only, and calls f with its root and upper
// directory ("" when read-only); it is unmounted after.
func (b *builder) withRoot(layers []string, writable bool, f func(root, upper string) error) error {
	release, err := b.n.images.Hold(layers)
	if err != nil {
		return err
	}
	defer release()
	dir, err := os.MkdirTemp(b.tmp, "root-")
	if err != nil {
		return errdefs.Internal(err, "create a build root")
	}
	defer os.RemoveAll(dir)
	var lowers []string
	for i := len(layers) - 1; i >= 0; i-- {
		lowers = append(lowers, b.n.images.ShortLayerPath(layers[i]))
	}
	// An overlay without an upper directory needs two lower ones; an
	// empty one below the rest changes nothing.
	empty, root, upper, work := filepath.Join(dir, "empty"), filepath.Join(dir, "root"), "", ""
	lowers = append(lowers, empty)
	for _, d := range []string{empty, root} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return errdefs.Internal(err, "create a build root")
		}
	}
	opts := "lowerdir=" + strings.Join(lowers, ":")
	if writable {
		upper, work = filepath.Join(dir, "upper"), filepath.Join(dir, "work")
		for _, d := range []string{upper, work} {
			if err := os.Mkdir(d, 0o755); err != nil {
				return errdefs.Internal(err, "create a build root")
			}
		}
		opts += ",upperdir=" + upper + ",workdir=" + work
	}
	if len(opts) > maxMountData {
		return errdefs.Invalid("the image has too many layers (%d) for one overlay mount", len(layers))
	}
	if err := unix.Mount("overlay", root, "overlay", unix.MS_NODEV|unix.MS_NOSUID, opts); err != nil {
		return errdefs.Internal(err, "mount a build root")
	}
	defer unix.Unmount(root, unix.MNT_DETACH)
	return f(root, upper)
}

// tarWriter writes the entries a step copies, as a tar for
// image.ExtractTar.
type tarWriter struct{ tw *tar.Writer }

func (t *tarWriter) dir(name string, mode os.FileMode, uid, gid int) error {
	return t.tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(path.Clean(name), "/") + "/", Mode: int64(mode & 0o7777), Uid: uid, Gid: gid, ModTime: time.Now()})
}

// writeTar unpacks what fill writes into root.
func writeTar(root string, fill func(*tarWriter) error) error {
	pr, pw := io.Pipe()
	go func() {
		tw := tar.NewWriter(pw)
		err := fill(&tarWriter{tw})
		if err == nil {
			err = tw.Close()
		}
		pw.CloseWithError(err)
	}()
	_, _, err := image.ExtractTar(pr, root)
	pr.CloseWithError(errors.New("extraction ended"))
	if err != nil {
		return classifyCopy(err)
	}
	return nil
}

// classifyCopy keeps a classified error (a bad source) and makes the
// rest, failures writing the root, an invalid step: a path of the image
// in the way (a file where a directory is needed) is the Dockerfile's
// doing.
func classifyCopy(err error) error {
	var e *errdefs.Error
	if errors.As(err, &e) {
		return e
	}
	var errno unix.Errno
	if errors.As(err, &errno) && (errno == unix.ENOTDIR || errno == unix.EISDIR || errno == unix.ENOTEMPTY || errno == unix.ELOOP || errno == unix.ENOSPC || errno == unix.EDQUOT) {
		return errdefs.Invalid("cannot write the copied files: %v", cleanPathErr(err))
	}
	return errdefs.Internal(err, "write the copied files")
}

// cleanPathErr keeps the entry name of an extraction error and drops host
// paths.
func cleanPathErr(err error) string {
	msg := err.Error()
	if i := strings.Index(msg, "layer entry "); i >= 0 {
		return msg[i+len("layer entry "):]
	}
	return filepath.Base(msg)
}

// entry is a file a COPY or ADD source holds.
type entry struct {
	rel      string // path under the source ("" for the source itself)
	typ      byte   // tar.TypeReg, TypeDir or TypeSymlink
	mode     os.FileMode
	size     int64
	mtime    time.Time
	linkname string
	// open opens a regular file's contents.
	open func() (io.ReadCloser, error)
}

// source is one resolved COPY or ADD source.
type source struct {
	name    string // the path as matched, under its root
	dir     bool
	entries []entry
}

// inRoot is how a build opens paths inside a root: every symlink,
// absolute or not, resolved as if root were /.
func inRoot(flags uint64) *unix.OpenHow {
	return &unix.OpenHow{Flags: flags | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
}

// readSources resolves patterns (glob patterns relative to root) to the
// entries they hold. what names the root in errors ("the build context",
// "stage x").
func readSources(rootDir string, patterns []string, what string) ([]*source, func(), error) {
	root, err := unix.Open(rootDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, errdefs.Internal(err, "open %s", what)
	}
	var fds []int
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
		unix.Close(root)
	}
	var out []*source
	for _, p := range patterns {
		names, err := glob(root, strings.Trim(path.Clean("/"+p), "/"))
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		if len(names) == 0 {
			closeAll()
			return nil, nil, errdefs.Invalid("%s: no file in %s matches", truncate(p, 200), what)
		}
		for _, name := range names {
			src, opened, err := readSource(root, name)
			fds = append(fds, opened...)
			if err != nil {
				closeAll()
				if errors.Is(err, unix.ENOENT) {
					return nil, nil, errdefs.Invalid("%s: no such file in %s", truncate(p, 200), what)
				}
				return nil, nil, errdefs.Internal(err, "read %s from %s", truncate(name, 200), what)
			}
			out = append(out, src)
		}
	}
	return out, closeAll, nil
}

func hasMeta(s string) bool { return strings.ContainsAny(s, `*?[\`) }

// glob expands pattern (cleaned, relative) under root, in lexical order.
func glob(root int, pattern string) ([]string, error) {
	if !hasMeta(pattern) {
		return []string{pattern}, nil
	}
	prefixes := []string{""}
	for _, comp := range strings.Split(pattern, "/") {
		var next []string
		for _, pre := range prefixes {
			if !hasMeta(comp) {
				next = append(next, path.Join(pre, comp))
				continue
			}
			if _, err := path.Match(comp, ""); err != nil {
				return nil, errdefs.Invalid("bad pattern %q", truncate(pattern, 200))
			}
			names, err := listDir(root, pre)
			if err != nil {
				continue // not a directory: nothing matches below it
			}
			for _, n := range names {
				if ok, _ := path.Match(comp, n); ok {
					next = append(next, path.Join(pre, n))
				}
			}
		}
		prefixes = next
	}
	return prefixes, nil
}

// listDir lists a directory under root, sorted.
func listDir(root int, rel string) ([]string, error) {
	fd, err := unix.Openat2(root, orDot(rel), inRoot(unix.O_RDONLY|unix.O_DIRECTORY))
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}

func orDot(s string) string {
	if s == "" {
		return "."
	}
	return s
}

// readSource lists what one source path holds: a file, or a directory's
// entries (symlinks below the source are kept as links, not followed).
// It returns the directory fds it keeps open for the entries' open.
func readSource(root int, name string) (*source, []int, error) {
	fd, err := unix.Openat2(root, orDot(name), inRoot(unix.O_PATH))
	if err != nil {
		return nil, nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, nil, err
	}
	src := &source{name: name}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		unix.Close(fd)
		src.entries = []entry{fileEntry("", &st, func() (io.ReadCloser, error) {
			fd, err := unix.Openat2(root, name, inRoot(unix.O_RDONLY))
			if err != nil {
				return nil, err
			}
			return os.NewFile(uintptr(fd), name), nil
		})}
		return src, nil, nil
	case unix.S_IFDIR:
		src.dir = true
		dfd, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return nil, nil, err
		}
		fds := []int{dfd}
		err = walkDir(dfd, "", &src.entries, &fds)
		return src, fds, err
	default:
		unix.Close(fd)
		return nil, nil, errdefs.Invalid("%s is neither a file nor a directory", truncate(name, 200))
	}
}

func fileEntry(rel string, st *unix.Stat_t, open func() (io.ReadCloser, error)) entry {
	return entry{rel: rel, typ: tar.TypeReg, mode: os.FileMode(st.Mode & 0o7777), size: st.Size, mtime: time.Unix(st.Mtim.Unix()), open: open}
}

// walkDir appends the entries below the directory dfd, in lexical order.
// dfd stays open (the entries' open uses it); the listing reads a copy.
func walkDir(dfd int, rel string, out *[]entry, fds *[]int) error {
	lfd, err := unix.Dup(dfd)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(lfd), rel)
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, name := range names {
		r := path.Join(rel, name)
		var st unix.Stat_t
		if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			*out = append(*out, fileEntry(r, &st, func() (io.ReadCloser, error) {
				fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
				if err != nil {
					return nil, err
				}
				return os.NewFile(uintptr(fd), name), nil
			}))
		case unix.S_IFDIR:
			*out = append(*out, entry{rel: r, typ: tar.TypeDir, mode: os.FileMode(st.Mode & 0o7777), mtime: time.Unix(st.Mtim.Unix())})
			cfd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			*fds = append(*fds, cfd)
			if err := walkDir(cfd, r, out, fds); err != nil {
				return err
			}
		case unix.S_IFLNK:
			buf := make([]byte, unix.PathMax)
			n, err := unix.Readlinkat(dfd, name, buf)
			if err != nil {
				return err
			}
			*out = append(*out, entry{rel: r, typ: tar.TypeSymlink, mode: 0o777, linkname: string(buf[:n]), mtime: time.Unix(st.Mtim.Unix())})
		}
		// Sockets, devices and FIFOs are not copied, as in Docker.
	}
	return nil
}

// digest is the content identity of sources, for the cache key: names,
// types, modes, link targets and contents (not times, which a fresh
// checkout changes).
func digest(srcs []*source) (string, error) {
	h := sha256.New()
	for _, s := range srcs {
		fmt.Fprintf(h, "source %q %v\n", s.name, s.dir)
		for _, e := range s.entries {
			fmt.Fprintf(h, "%q %c %o %d %q\n", e.rel, e.typ, e.mode, e.size, e.linkname)
			if e.typ == tar.TypeReg {
				if err := hashFile(h, e); err != nil {
					return "", err
				}
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func hashFile(h hash.Hash, e entry) error {
	r, err := e.open()
	if err != nil {
		return err
	}
	defer r.Close()
	_, err = io.Copy(h, r)
	return err
}

// copyFlags are a COPY or ADD step's options.
type copyFlags struct {
	from     string
	chown    string
	chmod    *os.FileMode
	uid, gid int
}

// copyStep runs COPY or ADD (of local files and archives, or of files of
// another stage or image with COPY --from).
func (b *builder) copyStep(ctx context.Context, stage int, s *buildState, step *dockerfile.Step) error {
	allowed := []string{"chown", "chmod", "link"}
	if step.Command == "COPY" {
		allowed = append(allowed, "from")
	}
	if err := onlyFlags(step, allowed...); err != nil {
		return err
	}
	if len(step.Heredocs) > 0 {
		return unsupported(step, step.Command+" of a here-document")
	}
	words, err := expandAll(step, step.Args, s.lookup)
	if err != nil {
		return err
	}
	if len(words) < 2 {
		return errdefs.Invalid("line %d: %s needs a source and a destination", step.Line, step.Command)
	}
	srcs, dest := words[:len(words)-1], words[len(words)-1]
	destDir := strings.HasSuffix(dest, "/")
	if !path.IsAbs(dest) {
		dest = path.Join("/", s.cfg.Workdir, dest)
	}
	dest = path.Clean(dest)
	if len(srcs) > 1 && !destDir {
		return errdefs.Invalid("line %d: %s of several sources needs a destination directory ending in /", step.Line, step.Command)
	}
	var f copyFlags
	if v, ok := step.Flags["chmod"]; ok {
		m, err := strconv.ParseUint(v, 8, 32)
		if err != nil || m > 0o7777 {
			return errdefs.Invalid("line %d: --chmod=%s: want octal permissions such as 755", step.Line, truncate(v, 32))
		}
		mode := os.FileMode(m)
		f.chmod = &mode
	}
	if v, ok := step.Flags["chown"]; ok {
		if f.chown, err = dockerfile.Expand(v, s.lookup); err != nil {
			return errdefs.Invalid("line %d: --chown: %s", step.Line, errdefs.Classify(err).Msg)
		}
	}
	for _, p := range srcs {
		if step.Command == "ADD" && (strings.Contains(p, "://") || strings.HasPrefix(p, "git@")) {
			return unsupported(step, "ADD "+truncate(p, 128)+" (a URL: fetch it in a RUN step)")
		}
	}
	// The sources' root: the context, another stage or an image.
	rootLayers, what, fromKey := []string(nil), "the build context", ""
	if v, ok := step.Flags["from"]; ok {
		from, err := dockerfile.Expand(v, s.lookup)
		if err != nil {
			return errdefs.Invalid("line %d: --from: %s", step.Line, errdefs.Classify(err).Msg)
		}
		if j, ok := b.stageRef(from, stage); ok {
			rootLayers, what, fromKey = b.stages[j].layers, "stage "+from, b.stages[j].key
		} else {
			img, err := b.n.images.Lookup(b.project, from)
			if err != nil || img.VM != nil || img.BuildCache != nil {
				return errdefs.NotFound("line %d: COPY --from=%s: no earlier stage or image of that name", step.Line, truncate(from, 128))
			}
			rootLayers, what, fromKey = img.Layers, "image "+from, img.Digest
		}
	} else if b.context == "" {
		return errdefs.Invalid("line %d: %s: the build has no context to copy from (give one: dsec image build [context])", step.Line, step.Command)
	}
	copyFrom := func(rootDir string) error {
		found, closeAll, err := readSources(rootDir, srcs, what)
		if err != nil {
			return stepErr(err, "line %d: %s", step.Line, step.Command)
		}
		defer closeAll()
		key := fromKey
		if key == "" {
			if key, err = digest(found); err != nil {
				return errdefs.Internal(err, "read the build context")
			}
		}
		return b.files(ctx, s, step, step.Command, []any{key, srcs, dest, destDir, f.chown, f.chmod}, func(root string) error {
			return b.writeCopy(root, step, found, dest, destDir, f)
		})
	}
	if fromKey != "" {
		return b.withRoot(rootLayers, false, func(rootDir, _ string) error { return copyFrom(rootDir) })
	}
	os.Chtimes(b.context, time.Now(), time.Now()) // in use: kept
	return copyFrom(b.context)
}

// writeCopy writes found into root at dest.
func (b *builder) writeCopy(root string, step *dockerfile.Step, found []*source, dest string, destDir bool, f copyFlags) error {
	uid, gid := 0, 0
	if f.chown != "" {
		var err error
		if uid, gid, err = resolveOwner(root, f.chown); err != nil {
			return errdefs.Invalid("line %d: --chown=%s: %s", step.Line, truncate(f.chown, 64), errdefs.Classify(err).Msg)
		}
	}
	isDir := func(p string) bool { return dirExists(root, p) }
	if !destDir && isDir(dest) {
		destDir = true
	}
	mode := func(m os.FileMode) os.FileMode {
		if f.chmod != nil {
			return *f.chmod
		}
		return m
	}
	return writeTar(root, func(t *tarWriter) error {
		for _, src := range found {
			base := dest
			switch {
			case src.dir:
				if !isDir(dest) {
					if err := t.dir(dest, mode(0o755), uid, gid); err != nil {
						return err
					}
				}
			case destDir:
				base = path.Join(dest, path.Base("/"+src.name))
			}
			for _, e := range src.entries {
				name := strings.TrimPrefix(path.Join(base, e.rel), "/")
				if step.Command == "ADD" && e.typ == tar.TypeReg && e.rel == "" {
					done, err := addArchive(t, e, dest, f, uid, gid)
					if err != nil {
						return stepErr(err, "line %d: ADD %s", step.Line, truncate(src.name, 200))
					}
					if done {
						continue
					}
				}
				hdr := &tar.Header{Typeflag: e.typ, Name: name, Mode: int64(mode(e.mode)), Uid: uid, Gid: gid, ModTime: e.mtime, Linkname: e.linkname, Size: e.size}
				switch e.typ {
				case tar.TypeDir:
					hdr.Name += "/"
				case tar.TypeSymlink:
					hdr.Mode = 0o777
				}
				if err := t.tw.WriteHeader(hdr); err != nil {
					return err
				}
				if e.typ == tar.TypeReg {
					if err := copyContents(t.tw, e); err != nil {
						return err
					}
				}
			}
		}
		return nil
	})
}

func copyContents(w io.Writer, e entry) error {
	r, err := e.open()
	if err != nil {
		return err
	}
	defer r.Close()
	n, err := io.Copy(w, io.LimitReader(r, e.size))
	if err == nil && n != e.size {
		err = errdefs.Invalid("%s changed while it was copied", truncate(e.rel, 200))
	}
	return err
}

// addArchive extracts e into dir dest if it is a tar archive (plain,
// gzip, bzip2 or zstd), as ADD does; done is false for any other file,
// which ADD copies as it is.
func addArchive(t *tarWriter, e entry, dest string, f copyFlags, uid, gid int) (done bool, err error) {
	r, err := e.open()
	if err != nil {
		return false, err
	}
	defer r.Close()
	br := bufio.NewReaderSize(r, 1024)
	head, _ := br.Peek(512)
	var tr io.Reader
	switch {
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return false, nil
		}
		defer zr.Close()
		tr = zr
	case bytes.HasPrefix(head, []byte("BZh")):
		tr = bzip2.NewReader(br)
	case bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			return false, nil
		}
		defer zr.Close()
		tr = zr
	case bytes.HasPrefix(head, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return false, errdefs.Unimplemented("xz archives are not unpacked by ADD here; use a .tar.gz, .tar.bz2 or .tar.zst")
	case len(head) >= 262 && string(head[257:262]) == "ustar":
		tr = br
	default:
		return false, nil
	}
	in := tar.NewReader(tr)
	for {
		hdr, err := in.Next()
		if err == io.EOF {
			return true, nil
		}
		if err != nil {
			return false, errdefs.Invalid("the archive is damaged: %v", err)
		}
		rel := strings.Trim(path.Clean("/"+hdr.Name), "/")
		if rel == "" {
			continue
		}
		out := *hdr
		out.Name = strings.TrimPrefix(path.Join(dest, rel), "/")
		if hdr.Typeflag == tar.TypeDir {
			out.Name += "/"
		}
		if hdr.Typeflag == tar.TypeLink {
			out.Linkname = strings.TrimPrefix(path.Join(dest, path.Clean("/"+hdr.Linkname)), "/")
		}
		if f.chown != "" {
			out.Uid, out.Gid = uid, gid
		}
		out.Uname, out.Gname = "", ""
		if err := t.tw.WriteHeader(&out); err != nil {
			return false, err
		}
		if hdr.Typeflag == tar.TypeReg || hdr.Typeflag == tar.TypeRegA {
			if _, err := io.Copy(t.tw, in); err != nil {
				return false, errdefs.Invalid("the archive is damaged: %v", err)
			}
		}
	}
}

// resolveOwner turns user[:group] into IDs, names looked up in root's
// /etc/passwd and /etc/group. A user without a group gets its own ID as
// the group's, as Docker does.
func resolveOwner(root, spec string) (uid, gid int, err error) {
	user, group, hasGroup := strings.Cut(spec, ":")
	if uid, err = lookupID(root, "/etc/passwd", user); err != nil {
		return 0, 0, err
	}
	gid = uid
	if hasGroup {
		if gid, err = lookupID(root, "/etc/group", group); err != nil {
			return 0, 0, err
		}
	}
	return uid, gid, nil
}

// lookupID resolves a user or group name (or number) in a passwd-style
// file of root.
func lookupID(root, file, name string) (int, error) {
	if id, err := strconv.Atoi(name); err == nil {
		if id < 0 || id > 1<<31-2 {
			return 0, errdefs.Invalid("ID %d out of range", id)
		}
		return id, nil
	}
	rootFd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(rootFd)
	fd, err := unix.Openat2(rootFd, strings.TrimPrefix(file, "/"), inRoot(unix.O_RDONLY))
	if err != nil {
		return 0, errdefs.Invalid("%q is not a number and the image has no %s", truncate(name, 64), file)
	}
	fh := os.NewFile(uintptr(fd), file)
	defer fh.Close()
	sc := bufio.NewScanner(io.LimitReader(fh, 16<<20))
	for sc.Scan() {
		fields := strings.Split(sc.Text(), ":")
		if len(fields) >= 3 && fields[0] == name {
			if id, err := strconv.Atoi(fields[2]); err == nil {
				return id, nil
			}
		}
	}
	return 0, errdefs.Invalid("no %q in the image's %s", truncate(name, 64), file)
}

// dirExists reports whether p is a directory in root (symlinks resolved
// inside it).
func dirExists(root, p string) bool {
	rootFd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(rootFd)
	fd, err := unix.Openat2(rootFd, orDot(strings.Trim(p, "/")), inRoot(unix.O_PATH|unix.O_DIRECTORY))
	if err == nil {
		unix.Close(fd)
	}
	return err == nil
}
