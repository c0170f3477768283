// Package buildctx packs a Docker build context: the tar stream that
// `dsec image build` sends to the server, filtered by the context's
// .dockerignore file.
package buildctx

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Stats counts what Tar sent and what it left out.
type Stats struct {
	Files    int   // regular files sent
	Dirs     int   // directories sent, not counting the root
	Symlinks int   // symlinks sent, as links
	Skipped  int   // sockets, devices and fifos, which a tar of a context does not carry
	Bytes    int64 // content bytes of the regular files sent
}

// Tar writes the build context dir to w as an uncompressed tar archive.
//
// Entries are named relative to dir with forward slashes and no leading
// "./"; directories end in "/". The walk is depth first and each
// directory's entries are visited in lexical order, so the same tree always
// gives the same archive. Regular files, directories and symlinks are sent;
// a symlink is stored as a link and never followed (dir itself may be one).
// Other file types are left out and counted in Stats.Skipped. Headers keep
// the mode bits (setuid, setgid and sticky included), numeric uid and gid
// with no user or group names, and the mtime truncated to the second.
//
// Paths excluded by dir/.dockerignore (see Ignore) are not sent. An excluded
// directory is not descended into unless an exception pattern could match
// something beneath it; then its included descendants are sent, preceded by
// the entries of their excluded parent directories. The .dockerignore file
// and the Dockerfile are sent like any other file unless excluded.
//
// A malformed .dockerignore is an errdefs.Invalid error. Other errors name
// the context path that failed; on any error w holds a partial archive.
func Tar(dir string, w io.Writer) (Stats, error) {
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return Stats{}, fmt.Errorf("open build context: %w", err)
	}
	if fi, err := os.Stat(root); err != nil {
		return Stats{}, fmt.Errorf("open build context: %w", err)
	} else if !fi.IsDir() {
		return Stats{}, errdefs.Invalid("build context %s is not a directory", dir)
	}
	ig, err := readIgnore(root)
	if err != nil {
		return Stats{}, err
	}
	p := &packer{root: root, ig: ig, tw: tar.NewWriter(w)}
	if err := filepath.WalkDir(root, p.visit); err != nil {
		return p.stats, err
	}
	if err := p.tw.Close(); err != nil {
		return p.stats, fmt.Errorf("write build context: %w", err)
	}
	return p.stats, nil
}

// readIgnore parses root/.dockerignore; a missing file excludes nothing.
func readIgnore(root string) (*Ignore, error) {
	f, err := os.Open(filepath.Join(root, ".dockerignore"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open .dockerignore: %w", err)
	}
	defer f.Close()
	return ParseIgnore(f)
}

// packer is the state of one Tar walk.
type packer struct {
	root  string
	ig    *Ignore
	tw    *tar.Writer
	stats Stats
	// pending holds the excluded directories being walked for their
	// exceptions, outermost first; they are written before the first
	// included path beneath them.
	pending []entry
}

type entry struct {
	rel, full string
	info      fs.FileInfo
}

func (p *packer) visit(full string, d fs.DirEntry, err error) error {
	if err != nil {
		return fmt.Errorf("walk build context: %w", err)
	}
	if full == p.root {
		return nil
	}
	rel, err := filepath.Rel(p.root, full)
	if err != nil {
		return err
	}
	rel = filepath.ToSlash(rel)
	for n := len(p.pending); n > 0 && !strings.HasPrefix(rel, p.pending[n-1].rel+"/"); n-- {
		p.pending = p.pending[:n-1]
	}
	excluded := p.ig.Excluded(rel, d.IsDir())
	if excluded && !d.IsDir() {
		return nil
	}
	if excluded && !p.ig.mayIncludeBelow(rel) {
		return filepath.SkipDir
	}
	info, err := d.Info()
	if err != nil {
		return fmt.Errorf("stat %s: %w", rel, err)
	}
	e := entry{rel: rel, full: full, info: info}
	if excluded {
		p.pending = append(p.pending, e)
		return nil
	}
	for _, pe := range p.pending {
		if err := p.add(pe); err != nil {
			return err
		}
	}
	p.pending = p.pending[:0]
	return p.add(e)
}

// add writes one entry, or counts it as skipped if tar should not carry it.
func (p *packer) add(e entry) error {
	mode := e.info.Mode()
	var link string
	switch {
	case mode.IsRegular(), mode.IsDir():
	case mode&fs.ModeSymlink != 0:
		var err error
		if link, err = os.Readlink(e.full); err != nil {
			return fmt.Errorf("read link %s: %w", e.rel, err)
		}
	default:
		p.stats.Skipped++
		return nil
	}
	hdr, err := tar.FileInfoHeader(e.info, link)
	if err != nil {
		return fmt.Errorf("tar header for %s: %w", e.rel, err)
	}
	hdr.Name = e.rel
	if mode.IsDir() {
		hdr.Name += "/"
	}
	hdr.Uname, hdr.Gname = "", ""
	hdr.ModTime = hdr.ModTime.Truncate(time.Second)
	hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
	if err := p.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("write %s: %w", e.rel, err)
	}
	switch {
	case mode.IsDir():
		p.stats.Dirs++
	case mode&fs.ModeSymlink != 0:
		p.stats.Symlinks++
	default:
		if err := p.copyFile(e, hdr.Size); err != nil {
			return err
		}
		p.stats.Files++
		p.stats.Bytes += hdr.Size
	}
	return nil
}

// copyFile writes the first size bytes of the file; a file that shrank since
// it was examined is an error.
func (p *packer) copyFile(e entry, size int64) error {
	f, err := os.Open(e.full)
	if err != nil {
		return fmt.Errorf("open %s: %w", e.rel, err)
	}
	defer f.Close()
	if _, err := io.CopyN(p.tw, f, size); err != nil {
		return fmt.Errorf("copy %s: %w", e.rel, err)
	}
	return nil
}
