// Package volume keeps a node's volumes: named file systems of a project
// that outlive sandboxes and the node's restarts. Each is an ext4 image of
// its own size in the node's data directory (internal/loopfs: a writer
// past the size gets ENOSPC and nothing outside the image is touched),
// with a journal (its content is meant to last), mounted in the node's
// mount namespace for as long as the node runs. Sandboxes bind it
// (the container substrate id-maps it into each one's user namespace, so
// ownership on disk is as sandboxes see it: 0 is their root), and the
// content calls (content.go) read and write it from the host, confined to
// its root.
//
// A Manager also keeps who mounts each volume: read-only by any number of
// sandboxes, read-write by one at a time. Holds live in memory: the node
// takes them again for the sandboxes it re-adopts after a restart.
//
// Tenancy is the caller's business (the node checks a volume's Project
// against its caller, as for every object); names are unique within a
// project.
package volume

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/loopfs"
	"github.com/opendsec/dsec/internal/sandboxid"
)

// Limits.
const (
	// MinMB is the smallest volume.
	MinMB = 16
	// maxLabels bounds a volume's labels.
	maxLabels = 64
	// bytesPerInode sizes a volume's inodes: one per 16 KiB, as sandbox
	// disks.
	bytesPerInode = 16 << 10
)

// Config configures a Manager. The zero value works once Node is set.
type Config struct {
	// Node is the node's name, which volume IDs carry (required).
	Node string
	// DefaultMB is a volume's size when a create gives none (default
	// 1024); MaxMB the largest (default 100 GiB).
	DefaultMB, MaxMB int64
	// MaxPerProject bounds a project's volumes on the node (default 256).
	MaxPerProject int
}

func (c *Config) defaults() {
	if c.DefaultMB == 0 {
		c.DefaultMB = 1024
	}
	if c.MaxMB == 0 {
		c.MaxMB = 100 << 10
	}
	if c.MaxPerProject == 0 {
		c.MaxPerProject = 256
	}
}

// Volume is one volume as the node keeps it.
type Volume struct {
	ID      string            `json:"id"`
	Name    string            `json:"name"`
	Project string            `json:"project"`
	SizeMB  int64             `json:"size_mb"`
	Labels  map[string]string `json:"labels,omitempty"`
	Created time.Time         `json:"created"`
}

// Holders are the sandboxes that mount a volume.
type Holders struct {
	// Writer mounts it read-write ("" for none).
	Writer string
	// Readers mount it read-only, sorted.
	Readers []string
}

// holds is a volume's holders, as kept.
type holds struct {
	writer  string
	readers map[string]bool
}

// Manager keeps the volumes of one node in a directory: <id>.img (the
// image), <id>.json (the record) and mnt/<id> (where it is mounted). Its
// methods are safe for concurrent use.
type Manager struct {
	cfg Config
	dir string
	log *slog.Logger
	// unavailable says why volumes cannot be made or mounted here ("" if
	// they can).
	unavailable string

	mu    sync.Mutex
	vols  map[string]*Volume // by ID
	names map[string]string  // project + "\x00" + name → ID ("" while being made)
	held  map[string]*holds  // by volume ID
}

var nameRe = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

// ValidName reports whether name can name a volume: 1 to 63 letters,
// digits, '.', '_' or '-', starting and ending with a letter or digit, and
// not of a volume ID's form.
func ValidName(name string) error {
	if !nameRe.MatchString(name) || IsID(name) {
		return errdefs.Invalid("volume name %q must be 1 to 63 letters, digits, '.', '_' or '-', starting and ending with a letter or digit", clip(name))
	}
	return nil
}

// IsID reports whether s has a volume ID's form.
func IsID(s string) bool {
	_, err := sandboxid.VolumeNode(s)
	return err == nil
}

// Open opens the volumes kept in dir and mounts each (through the loop
// device it is still attached to, after a restart while sandboxes mounted
// it). On a host without loop devices or mkfs.ext4 it opens what is kept,
// and every create, mount and content call is unavailable with the reason.
func Open(dir string, cfg Config, log *slog.Logger) (*Manager, error) {
	cfg.defaults()
	if err := sandboxid.ValidNode(cfg.Node); err != nil {
		return nil, err
	}
	m := &Manager{cfg: cfg, dir: dir, log: log, vols: map[string]*Volume{}, names: map[string]string{}, held: map[string]*holds{}}
	if err := os.MkdirAll(filepath.Join(dir, "mnt"), 0o700); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		m.unavailable = "volumes need root"
	} else {
		m.unavailable = loopfs.Available()
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var loops loopfs.Loops
	if m.unavailable == "" {
		loops = loopfs.Attached()
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		v, err := m.readRecord(id)
		if err != nil {
			log.Error("unreadable volume record", slog.String("volume_id", id), slog.Any("error", err))
			continue
		}
		if _, err := os.Stat(m.image(id)); err != nil {
			log.Error("a volume's image is gone; forgetting the volume", slog.String("volume_id", id), slog.Any("error", err))
			os.Remove(m.record(id))
			continue
		}
		if m.unavailable == "" {
			if err := m.mount(v.ID, loops); err != nil {
				log.Error("mount a volume", slog.String("volume_id", id), slog.Any("error", err))
			}
		}
		m.vols[v.ID] = v
		m.names[nameKey(v.Project, v.Name)] = v.ID
	}
	// Images without a record are creates a crash interrupted.
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".img"); ok && m.vols[id] == nil {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
	return m, nil
}

// Unavailable says why volumes cannot be used on this node ("" if they
// can).
func (m *Manager) Unavailable() string { return m.unavailable }

func (m *Manager) image(id string) string  { return filepath.Join(m.dir, id+".img") }
func (m *Manager) record(id string) string { return filepath.Join(m.dir, id+".json") }

// Source is the directory the volume's file system is mounted at: its
// root.
func (m *Manager) Source(id string) string { return filepath.Join(m.dir, "mnt", id) }

func nameKey(project, name string) string { return project + "\x00" + name }

// mounted reports whether the volume's file system is mounted at its
// source.
func (m *Manager) mounted(id string) bool {
	var st unix.Statfs_t
	if unix.Statfs(m.Source(id), &st) != nil || st.Type != unix.EXT4_SUPER_MAGIC {
		return false
	}
	// The mnt directory is on the data directory's file system, which may
	// be ext4 too: the source is a mount only on another device.
	var a, b unix.Stat_t
	return unix.Stat(m.Source(id), &a) == nil && unix.Stat(filepath.Join(m.dir, "mnt"), &b) == nil && a.Dev != b.Dev
}

// mount mounts a volume's image at its source: through the loop device
// the image is attached to, if it is, else through a new one.
func (m *Manager) mount(id string, loops loopfs.Loops) error {
	if m.mounted(id) {
		return nil
	}
	if dev := loops.Of(m.image(id)); dev != "" {
		return loopfs.Mount(dev, m.Source(id))
	}
	return loopfs.AttachMount(m.image(id), m.Source(id))
}

func (m *Manager) readRecord(id string) (*Volume, error) {
	b, err := os.ReadFile(m.record(id))
	if err != nil {
		return nil, err
	}
	v := &Volume{}
	if err := json.Unmarshal(b, v); err != nil {
		return nil, err
	}
	if v.ID != id {
		return nil, fmt.Errorf("record names volume %q", v.ID)
	}
	return v, nil
}

// writeRecord writes a volume's record durably (a temporary file renamed
// over it, the directory synced).
func (m *Manager) writeRecord(v *Volume) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := m.record(v.ID) + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, m.record(v.ID))
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return syncDir(m.dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Create makes an empty volume of project: its image (sizeMB, 0 for the
// default), mounted, and its record. A name the project uses already is a
// conflict; a bad name, size or labels are invalid. On error nothing is
// left.
func (m *Manager) Create(project, name string, sizeMB int64, labels map[string]string) (_ *Volume, err error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	if sizeMB == 0 {
		sizeMB = m.cfg.DefaultMB
	}
	if sizeMB < MinMB || sizeMB > m.cfg.MaxMB {
		return nil, errdefs.Invalid("size_mb %d out of range [%d, %d]", sizeMB, MinMB, m.cfg.MaxMB)
	}
	if len(labels) > maxLabels {
		return nil, errdefs.Invalid("at most %d labels", maxLabels)
	}
	for k, v := range labels {
		if len(k) > 253 || len(v) > 1024 || k == "" {
			return nil, errdefs.Invalid("label %q: keys are 1 to 253 bytes, values at most 1024", clip(k))
		}
	}
	if m.unavailable != "" {
		return nil, errdefs.Unavailable("volumes are unavailable on node %s: %s", m.cfg.Node, m.unavailable)
	}
	key := nameKey(project, name)
	m.mu.Lock()
	if _, taken := m.names[key]; taken {
		m.mu.Unlock()
		return nil, errdefs.Conflict("volume %q exists", name)
	}
	n := 0
	for _, v := range m.vols {
		if v.Project == project {
			n++
		}
	}
	if n >= m.cfg.MaxPerProject {
		m.mu.Unlock()
		return nil, errdefs.Invalid("a project has at most %d volumes on node %s", m.cfg.MaxPerProject, m.cfg.Node)
	}
	m.names[key] = "" // reserved while it is made
	m.mu.Unlock()
	v := &Volume{
		ID: sandboxid.NewVolume(m.cfg.Node), Name: name, Project: project, SizeMB: sizeMB,
		Labels: labels, Created: time.Now().UTC(),
	}
	defer func() {
		if err != nil {
			m.mu.Lock()
			delete(m.names, key)
			m.mu.Unlock()
			m.remove(v.ID)
		}
	}()
	if err := loopfs.Make(m.image(v.ID), sizeMB, loopfs.Options{BytesPerInode: bytesPerInode, Journal: true}); err != nil {
		return nil, errdefs.Internal(err, "make volume %q", name)
	}
	if err := loopfs.AttachMount(m.image(v.ID), m.Source(v.ID)); err != nil {
		return nil, errdefs.Internal(err, "mount volume %q", name)
	}
	// An empty root every user of a sandbox may write (its root is the
	// sandboxes' root: 0 on disk).
	os.Remove(filepath.Join(m.Source(v.ID), "lost+found"))
	if err := os.Chmod(m.Source(v.ID), 0o777); err != nil {
		return nil, errdefs.Internal(err, "make volume %q", name)
	}
	if err := m.writeRecord(v); err != nil {
		return nil, errdefs.Internal(err, "record volume %q", name)
	}
	m.mu.Lock()
	m.vols[v.ID] = v
	m.names[key] = v.ID
	m.mu.Unlock()
	m.log.Info("volume created", slog.String("volume_id", v.ID), slog.String("project", project), slog.Int64("size_mb", sizeMB))
	return copyOf(v), nil
}

// remove unmounts a volume and removes its record and image; the loop
// device detaches itself once no mount uses it.
func (m *Manager) remove(id string) {
	os.Remove(m.record(id))
	syncDir(m.dir)
	if err := unix.Unmount(m.Source(id), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		m.log.Warn("unmount a volume", slog.String("volume_id", id), slog.Any("error", err))
	}
	os.Remove(m.Source(id))
	os.Remove(m.image(id))
}

func copyOf(v *Volume) *Volume {
	c := *v
	if v.Labels != nil {
		c.Labels = make(map[string]string, len(v.Labels))
		for k, x := range v.Labels {
			c.Labels[k] = x
		}
	}
	return &c
}

// Get returns the volume with id, or nil.
func (m *Manager) Get(id string) *Volume {
	m.mu.Lock()
	defer m.mu.Unlock()
	if v := m.vols[id]; v != nil {
		return copyOf(v)
	}
	return nil
}

// ByName returns project's volume name, or nil.
func (m *Manager) ByName(project, name string) *Volume {
	m.mu.Lock()
	defer m.mu.Unlock()
	if v := m.vols[m.names[nameKey(project, name)]]; v != nil {
		return copyOf(v)
	}
	return nil
}

// List returns every volume, oldest first.
func (m *Manager) List() []*Volume {
	m.mu.Lock()
	out := make([]*Volume, 0, len(m.vols))
	for _, v := range m.vols {
		out = append(out, copyOf(v))
	}
	m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// Delete deletes a volume and its content. A volume a sandbox holds is a
// conflict naming the sandbox; an unknown one is not found.
func (m *Manager) Delete(id string) error {
	m.mu.Lock()
	v := m.vols[id]
	if v == nil {
		m.mu.Unlock()
		return errdefs.NotFound("volume %q not found", clip(id))
	}
	if h := m.held[id]; h != nil {
		by := h.writer
		if by == "" {
			for r := range h.readers {
				by = r
				break
			}
		}
		m.mu.Unlock()
		return errdefs.Conflict("volume %q is mounted by sandbox %s; delete the sandboxes that mount it first", v.Name, by)
	}
	delete(m.vols, id)
	delete(m.names, nameKey(v.Project, v.Name))
	m.mu.Unlock()
	m.remove(id)
	m.log.Info("volume deleted", slog.String("volume_id", id))
	return nil
}

// Hold records that sandbox mounts volume id, read-only or read-write. A
// read-write hold while another sandbox holds the volume read-write is a
// conflict naming that sandbox; a volume being deleted (or unknown) is not
// found. Holding again what the sandbox holds is a no-op.
func (m *Manager) Hold(id, sandbox string, readOnly bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	v := m.vols[id]
	if v == nil {
		return errdefs.NotFound("volume %q not found", clip(id))
	}
	h := m.held[id]
	if h == nil {
		h = &holds{readers: map[string]bool{}}
	}
	if readOnly {
		h.readers[sandbox] = true
	} else {
		if h.writer != "" && h.writer != sandbox {
			return errdefs.Conflict("volume %q is mounted read-write by sandbox %s: a volume has one read-write mount at a time (mount it read-only to share it)", v.Name, h.writer)
		}
		h.writer = sandbox
	}
	m.held[id] = h
	return nil
}

// Release drops every hold of sandbox. It is idempotent.
func (m *Manager) Release(sandbox string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, h := range m.held {
		if h.writer == sandbox {
			h.writer = ""
		}
		delete(h.readers, sandbox)
		if h.writer == "" && len(h.readers) == 0 {
			delete(m.held, id)
		}
	}
}

// HoldersOf returns the sandboxes that hold volume id.
func (m *Manager) HoldersOf(id string) Holders {
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.held[id]
	if h == nil {
		return Holders{}
	}
	out := Holders{Writer: h.writer}
	for r := range h.readers {
		out.Readers = append(out.Readers, r)
	}
	sort.Strings(out.Readers)
	return out
}

// Ready returns the source of volume id for a sandbox to mount: its file
// system's root, mounted (again, if it is not).
func (m *Manager) Ready(id string) (string, error) {
	if m.unavailable != "" {
		return "", errdefs.Unavailable("volumes are unavailable on node %s: %s", m.cfg.Node, m.unavailable)
	}
	if m.Get(id) == nil {
		return "", errdefs.NotFound("volume %q not found", clip(id))
	}
	if !m.mounted(id) {
		if err := m.mount(id, loopfs.Attached()); err != nil {
			return "", errdefs.Internal(err, "mount volume %s", id)
		}
	}
	return m.Source(id), nil
}

// Used is the bytes volume id's file system holds (0 if unknown).
func (m *Manager) Used(id string) int64 {
	var st unix.Statfs_t
	if !m.mounted(id) || unix.Statfs(m.Source(id), &st) != nil {
		return 0
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// Close unmounts every volume of the manager's mount namespace (sandboxes
// keep theirs). Records and images stay for the next Open.
func (m *Manager) Close() {
	ents, _ := os.ReadDir(filepath.Join(m.dir, "mnt"))
	for _, e := range ents {
		p := filepath.Join(m.dir, "mnt", e.Name())
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, fs.ErrNotExist) {
			m.log.Warn("unmount a volume", slog.String("volume_id", e.Name()), slog.Any("error", err))
		}
	}
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
