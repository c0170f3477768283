package node

import (
	"context"
	"fmt"
	"io"
	"path"
	"sort"
	"strings"
	"time"

	"connectrpc.com/connect"
	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/trajectory"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// sandboxPath checks a path from a caller and makes it one the agent
// takes: absolute, or starting with "~" (the call user's home, which only
// the agent knows, from the sandbox's /etc/passwd). Other relative paths
// are relative to the sandbox's working directory, else to the user's
// home: where a command without cwd starts (relPath). Resolving the path
// is the agent's work: inside the sandbox's root, as the call's user
// (fileUser), so ".." and symlinks cannot lead outside the sandbox or to
// files that user may not touch.
func sandboxPath(c *ctr, p string) (string, error) {
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
	return relPath(c.workdir, p), nil
}

// relPath makes a non-empty path of a file call or a cwd absolute, except
// that "~" paths are left for the agent, and paths relative to the home
// become "~/..." (the sandbox has no working directory of its own).
func relPath(workdir, p string) string {
	switch {
	case path.IsAbs(p):
		return path.Clean(p)
	case strings.HasPrefix(p, "~"):
		return p // the agent expands "~" and "~/", and refuses "~name"
	case workdir != "":
		return path.Join(workdir, p)
	default:
		return "~/" + path.Clean(p)
	}
}

// fileUser is the user a file call acts as inside the sandbox: the
// request's, else the sandbox's (spec.User, defaulted to the image's at
// create), else root ("").
func fileUser(c *ctr, requested string) string {
	if requested != "" {
		return requested
	}
	return c.user
}

func fileInfo(i *guestv1.FileInfo) *dsecv1.FileInfo {
	if i == nil {
		return nil
	}
	return &dsecv1.FileInfo{
		Path: i.Path, Name: i.Name, Type: i.Type, Size: i.Size, Mode: i.Mode,
		Mtime: timestamppb.New(time.UnixMilli(i.MtimeUnixMs)), SymlinkTarget: i.SymlinkTarget,
		Owner: i.Owner, Group: i.Group, Metadata: i.Metadata, Target: fileInfo(i.Target),
	}
}

// ReadFile streams a file: info first, then data chunks.
func (n *Node) ReadFile(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) (err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	p, err := sandboxPath(c, req.GetPath())
	if err != nil {
		return err
	}
	if req.GetOffset() < 0 || req.GetMaxBytes() < 0 {
		return errdefs.Invalid("offset and max_bytes must not be negative")
	}
	fg, err := c.files()
	if err != nil {
		return err
	}
	f, err := fg.ReadFile(ctx, &guestv1.ReadFile{Path: p, Offset: req.GetOffset(), Limit: req.GetMaxBytes(), User: fileUser(c, req.GetUser())})
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
func (n *Node) WriteFile(ctx context.Context, hdr *dsecv1.WriteFileHeader, r io.Reader) (_ *dsecv1.FileInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(hdr.GetSandboxId()), time.Now(), &err)
	s, c, err := n.ctrIn(ctx, hdr.GetSandboxId(), hdr.GetContainer())
	if err != nil {
		return nil, err
	}
	p, err := sandboxPath(c, hdr.GetPath())
	if err != nil {
		return nil, err
	}
	if hdr.GetMode() > 0o7777 {
		return nil, errdefs.Invalid("mode %o is not a permission mode", hdr.GetMode())
	}
	md := hdr.GetMetadata()
	if err := guest.ValidateMetadata(md); err != nil {
		return nil, errdefs.Invalid("%v", err)
	}
	user := fileUser(c, hdr.GetUser())
	m := mutation{
		entry:       &dsecv1.LogEntry{Op: "write_file", Container: c.name, Path: p, Mode: hdr.GetMode(), User: user, Metadata: md},
		requestID:   hdr.GetRequestId(),
		fingerprint: append([]string{"write_file", p, fmt.Sprint(hdr.GetMode()), fmt.Sprint(hdr.GetAppend()), user}, metadataPairs(md)...),
	}
	var info *guestv1.FileInfo
	_, replay, err := n.logged(ctx, s, m, func(e *dsecv1.LogEntry) error {
		fg, err := c.files()
		if err != nil {
			return err
		}
		blob := n.logs.NewBlob()
		info, err = fg.WriteFile(ctx, &guestv1.WriteFile{Path: p, Mode: hdr.GetMode(), Append: hdr.GetAppend(), User: user, Mkdirs: true, Metadata: md}, io.TeeReader(&touchReader{r: r, s: s}, blob))
		e.ContentDigest, _ = blob.Commit()
		if err != nil {
			return err
		}
		e.Size = info.Size
		return nil
	})
	switch {
	case err != nil:
		return nil, n.callFailed(s, err)
	case replay != nil:
		// Drain the upload: the same content must come again.
		blob := n.logs.NewBlob()
		io.Copy(blob, r)
		if digest, _ := blob.Commit(); digest != replay.ContentDigest {
			return nil, errdefs.Conflict("%v: %s (different content)", trajectory.ErrReused, hdr.GetRequestId())
		}
		return &dsecv1.FileInfo{Path: replay.Path, Name: path.Base(replay.Path), Type: "file", Size: replay.Size, Mode: replay.Mode, Replayed: true}, nil
	}
	return fileInfo(info), nil
}

// metadataPairs lists metadata as sorted "key=value" strings.
func metadataPairs(md map[string]string) []string {
	out := make([]string, 0, len(md))
	for k, v := range md {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
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
func (n *Node) Stat(ctx context.Context, req *dsecv1.StatRequest) (_ *dsecv1.FileInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, p, err := n.pathIn(ctx, req.GetSandboxId(), req.GetContainer(), req.GetPath())
	if err != nil {
		return nil, err
	}
	fg, err := c.files()
	if err != nil {
		return nil, err
	}
	info, err := fg.Stat(ctx, &guestv1.Path{Path: p, User: fileUser(c, req.GetUser())})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// MakeDir creates a directory and its parents, and logs it.
func (n *Node) MakeDir(ctx context.Context, req *dsecv1.MakeDirRequest) (_ *dsecv1.FileInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, p, err := n.pathIn(ctx, req.GetSandboxId(), req.GetContainer(), req.GetPath())
	if err != nil {
		return nil, err
	}
	user := fileUser(c, req.GetUser())
	var info *guestv1.FileInfo
	_, _, err = n.logged(ctx, s, mutation{entry: &dsecv1.LogEntry{Op: "make_dir", Container: c.name, Path: p, User: user}}, func(*dsecv1.LogEntry) (err error) {
		fg, err := c.files()
		if err != nil {
			return err
		}
		info, err = fg.MakeDir(ctx, &guestv1.MakeDir{Path: p, User: user})
		return err
	})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// Rename moves a file or directory, and logs it.
func (n *Node) Rename(ctx context.Context, req *dsecv1.RenameRequest) (_ *dsecv1.FileInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, from, err := n.pathIn(ctx, req.GetSandboxId(), req.GetContainer(), req.GetFrom())
	if err != nil {
		return nil, err
	}
	to, err := sandboxPath(c, req.GetTo())
	if err != nil {
		return nil, err
	}
	user := fileUser(c, req.GetUser())
	var info *guestv1.FileInfo
	_, _, err = n.logged(ctx, s, mutation{entry: &dsecv1.LogEntry{Op: "rename", Container: c.name, Path: from, To: to, User: user}}, func(*dsecv1.LogEntry) (err error) {
		fg, err := c.files()
		if err != nil {
			return err
		}
		info, err = fg.Rename(ctx, &guestv1.Rename{From: from, To: to, User: user})
		return err
	})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// ChangeMode sets a path's permission bits, and logs it.
func (n *Node) ChangeMode(ctx context.Context, req *dsecv1.ChangeModeRequest) (_ *dsecv1.FileInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, p, err := n.pathIn(ctx, req.GetSandboxId(), req.GetContainer(), req.GetPath())
	if err != nil {
		return nil, err
	}
	if req.GetMode()&^0o7777 != 0 {
		return nil, errdefs.Invalid("mode %#o has bits beyond 07777", req.GetMode())
	}
	user := fileUser(c, req.GetUser())
	var info *guestv1.FileInfo
	_, _, err = n.logged(ctx, s, mutation{entry: &dsecv1.LogEntry{Op: "change_mode", Container: c.name, Path: p, Mode: req.GetMode(), User: user}}, func(*dsecv1.LogEntry) (err error) {
		fg, err := c.files()
		if err != nil {
			return err
		}
		info, err = fg.ChangeMode(ctx, &guestv1.ChangeMode{Path: p, Mode: req.GetMode(), User: user})
		return err
	})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return fileInfo(info), nil
}

// Remove removes a file or a tree, and logs it.
func (n *Node) Remove(ctx context.Context, req *dsecv1.RemoveRequest) (err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, p, err := n.pathIn(ctx, req.GetSandboxId(), req.GetContainer(), req.GetPath())
	if err != nil {
		return err
	}
	user := fileUser(c, req.GetUser())
	_, _, err = n.logged(ctx, s, mutation{entry: &dsecv1.LogEntry{Op: "remove", Container: c.name, Path: p, Recursive: req.GetRecursive(), User: user}}, func(*dsecv1.LogEntry) error {
		fg, err := c.files()
		if err != nil {
			return err
		}
		return fg.Remove(ctx, &guestv1.Remove{Path: p, Recursive: req.GetRecursive(), User: user})
	})
	if err != nil {
		return n.callFailed(s, err)
	}
	return nil
}

// ListDir lists a directory.
func (n *Node) ListDir(ctx context.Context, req *dsecv1.ListDirRequest) (_ *dsecv1.ListDirResponse, err error) {
	defer n.m.Observe(ctx, metrics.OpFile, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return nil, err
	}
	p, err := sandboxPath(c, req.GetPath())
	if err != nil {
		return nil, err
	}
	if req.GetDepth() < 0 || req.GetDepth() > 64 {
		return nil, errdefs.Invalid("depth must be between 0 and 64")
	}
	fg, err := c.files()
	if err != nil {
		return nil, err
	}
	ents, err := fg.ListDir(ctx, &guestv1.ListDir{Path: p, Depth: req.GetDepth(), User: fileUser(c, req.GetUser())})
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	out := &dsecv1.ListDirResponse{}
	for _, e := range ents {
		out.Entries = append(out.Entries, fileInfo(e))
	}
	return out, nil
}

// pathIn returns a live sandbox and a path of the caller's made absolute
// in it (see sandboxPath).
func (n *Node) pathIn(ctx context.Context, id, container, p string) (*sandbox, *ctr, string, error) {
	s, c, err := n.ctrIn(ctx, id, container)
	if err != nil {
		return nil, nil, "", err
	}
	p, err = sandboxPath(c, p)
	if err != nil {
		return nil, nil, "", err
	}
	return s, c, p, nil
}

// ctrIn returns a live sandbox and its container the call names.
func (n *Node) ctrIn(ctx context.Context, id, container string) (*sandbox, *ctr, error) {
	s, err := n.live(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	c, err := s.ctrOf(container)
	if err != nil {
		return nil, nil, err
	}
	return s, c, nil
}

// WatchDir streams changes under a directory until ctx ends: "started" once
// the watch is in place, then one event per change, keepalives on quiet
// streams and "overflow" when the kernel dropped events.
func (n *Node) WatchDir(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	p, err := sandboxPath(c, req.GetPath())
	if err != nil {
		return err
	}
	fg, err := c.files()
	if err != nil {
		return err
	}
	w, err := fg.Watch(ctx, &guestv1.Watch{Path: p, Recursive: req.GetRecursive(), User: fileUser(c, req.GetUser()), IncludeInfo: req.GetIncludeInfo()})
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
				ev = &dsecv1.WatchDirEvent{Event: &dsecv1.WatchDirEvent_Change{Change: &dsecv1.FsEvent{Name: m.e.Name, Op: m.e.Op, Info: fileInfo(m.e.Info)}}}
			}
		}
		if err := send(ev); err != nil {
			return err
		}
	}
}

// fileReplays replays the file verbs' log entries (Replay): each is
// the verb again, with the recorded arguments, on the replay sandbox.
var fileReplays = map[string]func(ctx context.Context, n *Node, id string, e *dsecv1.LogEntry) error{
	"make_dir": func(ctx context.Context, n *Node, id string, e *dsecv1.LogEntry) error {
		_, err := n.MakeDir(ctx, &dsecv1.MakeDirRequest{SandboxId: id, Path: e.Path, User: e.User})
		return err
	},
	"remove": func(ctx context.Context, n *Node, id string, e *dsecv1.LogEntry) error {
		return n.Remove(ctx, &dsecv1.RemoveRequest{SandboxId: id, Path: e.Path, Recursive: e.Recursive, User: e.User})
	},
	"rename": func(ctx context.Context, n *Node, id string, e *dsecv1.LogEntry) error {
		_, err := n.Rename(ctx, &dsecv1.RenameRequest{SandboxId: id, From: e.Path, To: e.To, User: e.User})
		return err
	},
	"change_mode": func(ctx context.Context, n *Node, id string, e *dsecv1.LogEntry) error {
		_, err := n.ChangeMode(ctx, &dsecv1.ChangeModeRequest{SandboxId: id, Path: e.Path, Mode: e.Mode, User: e.User})
		return err
	},
}

// FilesystemService's unary verbs, as the node's Connect handler (its
// streams are in service.go).

func (s *Service) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return answer(s.n.Stat(ctx, req.Msg))
}

func (s *Service) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return answer(s.n.ListDir(ctx, req.Msg))
}

func (s *Service) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return answer(s.n.MakeDir(ctx, req.Msg))
}

func (s *Service) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return done[dsecv1.RemoveResponse](s.n.Remove(ctx, req.Msg))
}

func (s *Service) Rename(ctx context.Context, req *connect.Request[dsecv1.RenameRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return answer(s.n.Rename(ctx, req.Msg))
}

func (s *Service) ChangeMode(ctx context.Context, req *connect.Request[dsecv1.ChangeModeRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return answer(s.n.ChangeMode(ctx, req.Msg))
}
