package node

import (
	"context"
	"fmt"
	"io"
	"path"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/trajectory"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// sandboxPath makes a path from a caller absolute: relative paths are
// relative to the sandbox's working directory. Resolving it is the agent's
// work: inside the sandbox's root, as the call's user (fileUser), so ".."
// and symlinks cannot lead outside the sandbox or to files that user may
// not touch.
func sandboxPath(s *sandbox, p string) (string, error) {
	if p == "" {
		return "", errdefs.Invalid("path is required")
	}
	if len(p) > 4096 {
		return "", errdefs.Invalid("path longer than 4096 bytes")
	}
	for i := 0; i < len(p); i++ {
		if p[i] == 0 {
			return "", errdefs.Invalid("path contains a NUL byte")
		}
	}
	if !path.IsAbs(p) {
		p = path.Join(orRoot(s.spec.Workdir), p)
	}
	return path.Clean(p), nil
}

// fileUser is the user a file call acts as inside the sandbox: the
// request's, else the sandbox's (spec.User, defaulted to the image's at
// create), else root ("").
func fileUser(s *sandbox, requested string) string {
	if requested != "" {
		return requested
	}
	return s.spec.User
}

func fileInfo(i *guestv1.FileInfo) *dsecv1.FileInfo {
	if i == nil {
		return nil
	}
	return &dsecv1.FileInfo{
		Path: i.Path, Name: i.Name, Type: i.Type, Size: i.Size, Mode: i.Mode,
		Mtime: timestamppb.New(time.UnixMilli(i.MtimeUnixMs)), SymlinkTarget: i.SymlinkTarget,
		Owner: i.Owner, Group: i.Group,
	}
}

// ReadFile streams a file: info first, then data chunks.
func (n *Node) ReadFile(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error {
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return err
	}
	p, err := sandboxPath(s, req.GetPath())
	if err != nil {
		return err
	}
	if req.GetOffset() < 0 || req.GetMaxBytes() < 0 {
		return errdefs.Invalid("offset and max_bytes must not be negative")
	}
	f, err := s.inst.Guest().ReadFile(ctx, &guestv1.ReadFile{Path: p, Offset: req.GetOffset(), Limit: req.GetMaxBytes(), User: fileUser(s, req.GetUser())})
	if err != nil {
		return n.callFailed(s, err)
	}
	defer f.Close()
	if f.Info.GetType() == "dir" {
		// Refused before anything is sent: an error after the info would
		// reach plain HTTP callers as a short answer.
		return errdefs.Invalid("%s is a directory (use ListDir)", req.GetPath())
	}
	if err := send(&dsecv1.ReadFileResponse{Msg: &dsecv1.ReadFileResponse_Info{Info: fileInfo(f.Info)}}); err != nil {
		return err
	}
	for {
		b, err := f.Chunk()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return n.callFailed(s, err)
		}
		if err := send(&dsecv1.ReadFileResponse{Msg: &dsecv1.ReadFileResponse_Data{Data: b}}); err != nil {
			return err
		}
	}
}

// WriteFile writes r into a file and logs it (with its content, for
// replay). With a request ID a repeat is answered from the log; its data
// must be the same.
func (n *Node) WriteFile(ctx context.Context, hdr *dsecv1.WriteFileHeader, r io.Reader) (*dsecv1.FileInfo, error) {
	s, err := n.live(ctx, hdr.GetSandboxId())
	if err != nil {
		return nil, err
	}
	p, err := sandboxPath(s, hdr.GetPath())
	if err != nil {
		return nil, err
	}
	if hdr.GetMode() > 0o7777 {
		return nil, errdefs.Invalid("mode %o is not a permission mode", hdr.GetMode())
	}
	if len(hdr.GetRequestId()) > maxRequestID {
		return nil, errdefs.Invalid("request_id longer than %d bytes", maxRequestID)
	}
	user := fileUser(s, hdr.GetUser())
	start := time.Now()
	var done func(*dsecv1.LogEntry) (*dsecv1.LogEntry, error)
	if rid := hdr.GetRequestId(); rid != "" {
		log, err := n.logs.Log(s.id)
		if err != nil {
			return nil, errdefs.Internal(err, "open trajectory log")
		}
		fp := trajectory.Fingerprint("write_file", p, fmt.Sprint(hdr.GetMode()), fmt.Sprint(hdr.GetAppend()), user)
		replay, d, err := log.Claim(rid, fp, ctx.Done())
		if err != nil {
			return nil, err
		}
		if replay != nil {
			// Drain the upload: the same content must come again.
			blob := n.logs.NewBlob()
			io.Copy(blob, r)
			digest, _ := blob.Commit()
			if digest != replay.ContentDigest {
				return nil, errdefs.Conflict("%v: %s (different content)", trajectory.ErrReused, rid)
			}
			return &dsecv1.FileInfo{Path: replay.Path, Name: path.Base(replay.Path), Type: "file", Size: replay.Size, Mode: replay.Mode, Replayed: true}, nil
		}
		done = d
	}
	blob := n.logs.NewBlob()
	info, err := s.inst.Guest().WriteFile(ctx, &guestv1.WriteFile{Path: p, Mode: hdr.GetMode(), Append: hdr.GetAppend(), User: user, Mkdirs: true}, io.TeeReader(&touchReader{r: r, s: s}, blob))
	digest, _ := blob.Commit()
	e := &dsecv1.LogEntry{Op: "write_file", Path: p, Mode: hdr.GetMode(), User: user, ContentDigest: digest}
	if err != nil {
		if done != nil {
			done(nil)
		}
		n.logMutation(s, e, start, err)
		return nil, n.callFailed(s, err)
	}
	e.Size = info.Size
	if done != nil {
		e.At = timestamppb.New(start.UTC())
		e.DurationMs = time.Since(start).Milliseconds()
		if _, err := done(e); err != nil {
			return nil, errdefs.Internal(err, "record the call in the trajectory log")
		}
	} else {
		n.logMutation(s, e, start, nil)
	}
	return fileInfo(info), nil
}

// touchReader keeps a long upload from counting as idle.
type touchReader struct {
	r    io.Reader
	s    *sandbox
	last time.Time
}

func (t *touchReader) Read(p []byte) (int, error) {
	if time.Since(t.last) > time.Second {
		t.last = time.Now()
		t.s.touch()
	}
	return t.r.Read(p)
}

// Stat returns a file's info.
func (n *Node) Stat(ctx context.Context, req *dsecv1.StatRequest) (*dsecv1.FileInfo, error) {
	return n.fileCall(ctx, req.GetSandboxId(), req.GetPath(), func(s *sandbox, g guestCall, p string) (*guestv1.FileInfo, error) {
		return g.Stat(ctx, &guestv1.Path{Path: p, User: fileUser(s, req.GetUser())})
	})
}

// MakeDir creates a directory and its parents.
func (n *Node) MakeDir(ctx context.Context, req *dsecv1.MakeDirRequest) (*dsecv1.FileInfo, error) {
	return n.fileCall(ctx, req.GetSandboxId(), req.GetPath(), func(s *sandbox, g guestCall, p string) (*guestv1.FileInfo, error) {
		start := time.Now()
		user := fileUser(s, req.GetUser())
		info, err := g.MakeDir(ctx, &guestv1.MakeDir{Path: p, User: user})
		n.logMutation(s, &dsecv1.LogEntry{Op: "make_dir", Path: p, User: user}, start, err)
		return info, err
	})
}

// Rename moves a file or directory.
func (n *Node) Rename(ctx context.Context, req *dsecv1.RenameRequest) (*dsecv1.FileInfo, error) {
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	from, err := sandboxPath(s, req.GetFrom())
	if err != nil {
		return nil, err
	}
	to, err := sandboxPath(s, req.GetTo())
	if err != nil {
		return nil, err
	}
	start := time.Now()
	user := fileUser(s, req.GetUser())
	info, err := s.inst.Guest().Rename(ctx, &guestv1.Rename{From: from, To: to, User: user})
	n.logMutation(s, &dsecv1.LogEntry{Op: "rename", Path: from, To: to, User: user}, start, err)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// Remove removes a file or a tree.
func (n *Node) Remove(ctx context.Context, req *dsecv1.RemoveRequest) error {
	_, err := n.fileCall(ctx, req.GetSandboxId(), req.GetPath(), func(s *sandbox, g guestCall, p string) (*guestv1.FileInfo, error) {
		start := time.Now()
		user := fileUser(s, req.GetUser())
		err := g.Remove(ctx, &guestv1.Remove{Path: p, Recursive: req.GetRecursive(), User: user})
		n.logMutation(s, &dsecv1.LogEntry{Op: "remove", Path: p, Recursive: req.GetRecursive(), User: user}, start, err)
		return nil, err
	})
	return err
}

// ListDir lists a directory.
func (n *Node) ListDir(ctx context.Context, req *dsecv1.ListDirRequest) (*dsecv1.ListDirResponse, error) {
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	p, err := sandboxPath(s, req.GetPath())
	if err != nil {
		return nil, err
	}
	if req.GetDepth() < 0 || req.GetDepth() > 64 {
		return nil, errdefs.Invalid("depth must be between 0 and 64")
	}
	ents, err := s.inst.Guest().ListDir(ctx, &guestv1.ListDir{Path: p, Depth: req.GetDepth(), User: fileUser(s, req.GetUser())})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	out := &dsecv1.ListDirResponse{}
	for _, e := range ents {
		out.Entries = append(out.Entries, fileInfo(e))
	}
	return out, nil
}

type guestCall interface {
	Stat(ctx context.Context, p *guestv1.Path) (*guestv1.FileInfo, error)
	MakeDir(ctx context.Context, m *guestv1.MakeDir) (*guestv1.FileInfo, error)
	Remove(ctx context.Context, r *guestv1.Remove) error
}

var _ guestCall = (*guest.Client)(nil)

func (n *Node) fileCall(ctx context.Context, id, p string, f func(*sandbox, guestCall, string) (*guestv1.FileInfo, error)) (*dsecv1.FileInfo, error) {
	s, err := n.live(ctx, id)
	if err != nil {
		return nil, err
	}
	p, err = sandboxPath(s, p)
	if err != nil {
		return nil, err
	}
	info, err := f(s, s.inst.Guest(), p)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// WatchDir streams changes under a directory until ctx ends: "started" once
// the watch is in place, then one event per change, keepalives on quiet
// streams and "overflow" when the kernel dropped events.
func (n *Node) WatchDir(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error {
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return err
	}
	p, err := sandboxPath(s, req.GetPath())
	if err != nil {
		return err
	}
	w, err := s.inst.Guest().Watch(ctx, &guestv1.Watch{Path: p, Recursive: req.GetRecursive(), User: fileUser(s, req.GetUser())})
	if err != nil {
		return n.callFailed(s, err)
	}
	defer w.Close()
	if err := send(&dsecv1.WatchDirEvent{Event: &dsecv1.WatchDirEvent_Started{Started: true}}); err != nil {
		return err
	}
	type msg struct {
		e   *guestv1.FsEvent
		err error
	}
	ch := make(chan msg, 64)
	go func() {
		for {
			e, err := w.Recv()
			select {
			case ch <- msg{e, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	tick := time.NewTicker(keepaliveGap)
	defer tick.Stop()
	for {
		var ev *dsecv1.WatchDirEvent
		select {
		case <-ctx.Done():
			return errdefs.Classify(ctx.Err())
		case <-tick.C:
			s.touch()
			ev = &dsecv1.WatchDirEvent{Event: &dsecv1.WatchDirEvent_Keepalive{Keepalive: true}}
		case m := <-ch:
			if m.err != nil {
				return n.callFailed(s, m.err)
			}
			if m.e.Overflow {
				ev = &dsecv1.WatchDirEvent{Event: &dsecv1.WatchDirEvent_Overflow{Overflow: true}}
			} else {
				ev = &dsecv1.WatchDirEvent{Event: &dsecv1.WatchDirEvent_Change{Change: &dsecv1.FsEvent{Name: m.e.Name, Op: m.e.Op}}}
			}
		}
		if err := send(ev); err != nil {
			return err
		}
	}
}
