package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/tenant"
)

// E2B's volumes over dsec's (VolumeService, docs/volumes.md).
//
// The control plane: POST /volumes ({name}: a volume of the node's default
// size), GET /volumes, GET and DELETE /volumes/{volumeID}, with the API
// key; a volume's answer carries its token. The content API,
// /volumecontent/{volumeID}/dir|file|path, which the SDK sends to
// E2B_VOLUME_API_URL (else https://api.<E2B_DOMAIN>: this server), is
// authorized by that token alone (Authorization: Bearer), an HMAC of the
// volume's ID like the envd tokens: it acts on that volume only. volumeMounts
// at create ([{name, path}]) mount volumes read-write: E2B has no read-only
// mount, so a volume is one E2B sandbox's at a time.

// volumeJSON is E2B's Volume; with the token, VolumeAndToken.
type volumeJSON struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	Token    string `json:"token,omitempty"`
}

// volumeMountJSON is E2B's SandboxVolumeMount.
type volumeMountJSON struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// VolumeToken is the token of a volume's content API.
func (f *Facade) VolumeToken(id string) string { return f.token("volume", id) }

func (f *Facade) volumeJSON(v *dsecv1.Volume, withToken bool) volumeJSON {
	out := volumeJSON{VolumeID: v.GetId(), Name: v.GetName()}
	if withToken {
		out.Token = f.VolumeToken(v.GetId())
	}
	return out
}

// parseVolumeMounts reads a create's volumeMounts.
func parseVolumeMounts(raw json.RawMessage) ([]*dsecv1.VolumeMount, error) {
	if !present(raw) {
		return nil, nil
	}
	var in []volumeMountJSON
	if err := json.Unmarshal(raw, &in); err != nil {
		return nil, errdefs.Invalid("volumeMounts must be a list of {name, path}: %v", err)
	}
	out := make([]*dsecv1.VolumeMount, len(in))
	for i, m := range in {
		out[i] = &dsecv1.VolumeMount{Name: m.Name, Path: m.Path}
	}
	return out, nil
}

// volumeMountsJSON is a sandbox's volumeMounts as E2B lists them.
func volumeMountsJSON(spec *dsecv1.SandboxSpec) []volumeMountJSON {
	var out []volumeMountJSON
	for _, m := range spec.GetVolumes() {
		out = append(out, volumeMountJSON{Name: m.GetName(), Path: m.GetPath()})
	}
	return out
}

func (f *Facade) mountVolumes(handle func(string, http.Handler)) {
	api := func(pattern string, fn func(http.ResponseWriter, *http.Request)) {
		handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			caller, ok := f.auth(r.Header)
			if !ok {
				apiError(w, errdefs.Unauthenticated("missing or unknown API key: set E2B_API_KEY to a dsec API key"))
				return
			}
			fn(w, r.WithContext(tenant.With(r.Context(), caller)))
		}))
	}
	api("POST /volumes", f.createVolume)
	api("GET /volumes", f.listVolumes)
	api("GET /volumes/{id}", f.getVolume)
	api("DELETE /volumes/{id}", f.deleteVolume)
	content := func(pattern string, fn func(http.ResponseWriter, *http.Request, apiserver.Node, string)) {
		handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, n, id, err := f.volumeContent(r)
			if err != nil {
				apiError(w, err)
				return
			}
			fn(w, r.WithContext(ctx), n, id)
		}))
	}
	content("GET /volumecontent/{id}/dir", f.listVolumeDir)
	content("POST /volumecontent/{id}/dir", f.makeVolumeDir)
	content("GET /volumecontent/{id}/file", f.readVolumeFile)
	content("PUT /volumecontent/{id}/file", f.writeVolumeFile)
	content("GET /volumecontent/{id}/path", f.statVolumePath)
	content("PATCH /volumecontent/{id}/path", f.setVolumePathAttrs)
	content("DELETE /volumecontent/{id}/path", f.removeVolumePath)
}

// volumeContent authorizes a content call by the volume's token and finds
// the volume's node. It acts for the token's holder: on that volume only.
func (f *Facade) volumeContent(r *http.Request) (context.Context, apiserver.Node, string, error) {
	id := r.PathValue("id")
	token, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if _, err := sandboxid.VolumeNode(id); err != nil || token == "" || !equal(token, f.VolumeToken(id)) {
		return nil, nil, "", errdefs.Unauthenticated("missing or wrong volume token for volume %s (Authorization: Bearer <the volume's token>)", clip(id))
	}
	ctx := tokenHolder(r.Context())
	n, _, err := apiserver.FindVolume(ctx, f.r, id)
	if err != nil {
		return nil, nil, "", err
	}
	return ctx, n, id, nil
}

func (f *Facade) createVolume(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Name string `json:"name"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	if in.Name == "" {
		apiError(w, errdefs.Invalid("name is required"))
		return
	}
	v, err := apiserver.CreateVolume(r.Context(), f.r, &dsecv1.CreateVolumeRequest{Name: in.Name})
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, f.volumeJSON(v, true))
}

func (f *Facade) listVolumes(w http.ResponseWriter, r *http.Request) {
	vols, err := apiserver.ListVolumes(r.Context(), f.r)
	if err != nil {
		apiError(w, err)
		return
	}
	out := make([]volumeJSON, len(vols))
	for i, v := range vols {
		out[i] = f.volumeJSON(v, false)
	}
	writeJSON(w, http.StatusOK, out)
}

func (f *Facade) getVolume(w http.ResponseWriter, r *http.Request) {
	_, v, err := apiserver.FindVolume(r.Context(), f.r, r.PathValue("id"))
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, f.volumeJSON(v, true))
}

func (f *Facade) deleteVolume(w http.ResponseWriter, r *http.Request) {
	n, v, err := apiserver.FindVolume(r.Context(), f.r, r.PathValue("id"))
	if err == nil {
		_, err = apiserver.Do(r.Context(), n, &dsecv1.DeleteVolumeRequest{Volume: v.GetId()}, apiserver.Node.DeleteVolume)
	}
	if err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeEntryJSON is E2B's VolumeEntryStat.
type volumeEntryJSON struct {
	Name   string `json:"name"`
	Type   string `json:"type"`
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	Mode   uint32 `json:"mode"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	Atime  string `json:"atime"`
	Mtime  string `json:"mtime"`
	Ctime  string `json:"ctime"`
	Target string `json:"target,omitempty"`
}

var entryTypes = map[string]string{"file": "file", "dir": "directory", "symlink": "symlink"}

func volumeEntry(in *dsecv1.VolumeFileInfo) volumeEntryJSON {
	typ := entryTypes[in.GetType()]
	if typ == "" {
		typ = "unknown"
	}
	ts := func(t interface{ AsTime() time.Time }) string { return t.AsTime().UTC().Format(time.RFC3339Nano) }
	return volumeEntryJSON{
		Name: in.GetName(), Type: typ, Path: in.GetPath(), Size: in.GetSize(), Mode: in.GetMode(),
		UID: in.GetUid(), GID: in.GetGid(), Atime: ts(in.GetAtime()), Mtime: ts(in.GetMtime()), Ctime: ts(in.GetCtime()),
		Target: in.GetSymlinkTarget(),
	}
}

// owner reads the uid, gid and mode query parameters (decimal numbers).
func owner(r *http.Request) (mode, uid, gid *uint32, err error) {
	q := r.URL.Query()
	get := func(k string) (*uint32, error) {
		s := q.Get(k)
		if s == "" {
			return nil, nil
		}
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil {
			return nil, errdefs.Invalid("%s must be a non-negative integer", k)
		}
		v := uint32(n)
		return &v, nil
	}
	if mode, err = get("mode"); err != nil {
		return
	}
	if uid, err = get("uid"); err != nil {
		return
	}
	gid, err = get("gid")
	return
}

func volumePath(r *http.Request) (string, error) {
	p := r.URL.Query().Get("path")
	if p == "" {
		return "", errdefs.Invalid("path is required")
	}
	return p, nil
}

// nodeErr is a node's answer as an error of the facade.
func nodeErr(err error) error { return errwire.FromConnect(err) }

func (f *Facade) listVolumeDir(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	depth := 0
	if s := r.URL.Query().Get("depth"); s != "" {
		if depth, err = strconv.Atoi(s); err != nil {
			apiError(w, errdefs.Invalid("depth must be an integer"))
			return
		}
	}
	list, err := apiserver.Do(r.Context(), n, &dsecv1.ListVolumeDirRequest{Volume: id, Path: p, Depth: int32(depth)}, apiserver.Node.ListVolumeDir)
	if err != nil {
		apiError(w, err)
		return
	}
	out := make([]volumeEntryJSON, len(list.GetEntries()))
	for i, e := range list.GetEntries() {
		out[i] = volumeEntry(e)
	}
	writeJSON(w, http.StatusOK, out)
}

func (f *Facade) makeVolumeDir(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	mode, uid, gid, err := owner(r)
	if err != nil {
		apiError(w, err)
		return
	}
	req := &dsecv1.MakeVolumeDirRequest{Volume: id, Path: p, Parents: r.URL.Query().Get("force") == "true", Mode: mode, Uid: uid, Gid: gid}
	in, err := apiserver.Do(r.Context(), n, req, apiserver.Node.MakeVolumeDir)
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, volumeEntry(in))
}

// readVolumeFile answers the file's bytes, with its length.
func (f *Facade) readVolumeFile(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	started := false
	err = n.ReadVolumeFileChunks(r.Context(), &dsecv1.ReadVolumeFileRequest{Volume: id, Path: p}, func(m *dsecv1.ReadVolumeFileResponse) error {
		if in := m.GetInfo(); in != nil {
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Content-Length", strconv.FormatInt(in.GetSize(), 10))
			w.WriteHeader(http.StatusOK)
			started = true
			return nil
		}
		_, err := w.Write(m.GetData())
		return err
	})
	if err != nil && !started {
		apiError(w, nodeErr(err))
	}
}

func (f *Facade) writeVolumeFile(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	mode, uid, gid, err := owner(r)
	if err != nil {
		apiError(w, err)
		return
	}
	hdr := &dsecv1.WriteVolumeFileHeader{Volume: id, Path: p, Overwrite: r.URL.Query().Get("force") == "true", Mode: mode, Uid: uid, Gid: gid}
	resp, err := n.WriteVolumeFileFrom(r.Context(), hdr, r.Body)
	if err != nil {
		apiError(w, nodeErr(err))
		return
	}
	writeJSON(w, http.StatusCreated, volumeEntry(resp.Msg))
}

func (f *Facade) statVolumePath(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	in, err := apiserver.Do(r.Context(), n, &dsecv1.VolumePathRequest{Volume: id, Path: p}, apiserver.Node.StatVolumePath)
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, volumeEntry(in))
}

func (f *Facade) setVolumePathAttrs(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	var in struct {
		UID  *uint32 `json:"uid"`
		GID  *uint32 `json:"gid"`
		Mode *uint32 `json:"mode"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	out, err := apiserver.Do(r.Context(), n, &dsecv1.SetVolumePathAttrsRequest{Volume: id, Path: p, Mode: in.Mode, Uid: in.UID, Gid: in.GID}, apiserver.Node.SetVolumePathAttrs)
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, volumeEntry(out))
}

func (f *Facade) removeVolumePath(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p, err := volumePath(r)
	if err != nil {
		apiError(w, err)
		return
	}
	if _, err := apiserver.Do(r.Context(), n, &dsecv1.VolumePathRequest{Volume: id, Path: p}, apiserver.Node.RemoveVolumePath); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
