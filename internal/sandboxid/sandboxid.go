// Package sandboxid is the format of sandbox, snapshot and volume IDs, the
// one place both the node agent (which mints them) and the control plane
// (which routes by them) read it from.
//
// A sandbox ID is "<16 lowercase base32 chars>-<node>", a snapshot ID
// "snap-<16 lowercase base32 chars>-<node>" and a volume ID
// "vol-<16 lowercase base32 chars>-<node>", where <node> is the owning
// node's name, a lowercase DNS label of at most 40 characters. Any
// apiserver replica routes a call by the ID alone: the control plane keeps
// no per-sandbox state.
package sandboxid

import (
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"regexp"
	"strings"

	"github.com/opendsec/dsec/internal/errdefs"
)

// SnapshotPrefix starts every snapshot ID, VolumePrefix every volume ID.
const (
	SnapshotPrefix = "snap-"
	VolumePrefix   = "vol-"
)

var nodeRe = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)

var enc = base32.StdEncoding.WithPadding(base32.NoPadding)

// ValidNode reports whether name can name a node.
func ValidNode(name string) error {
	if !nodeRe.MatchString(name) {
		return fmt.Errorf("node name %q must be a lowercase DNS label of at most 40 characters", clip(name))
	}
	return nil
}

// New returns a fresh sandbox ID of node.
func New(node string) string { return random() + "-" + node }

// NewSnapshot returns a fresh snapshot ID of node.
func NewSnapshot(node string) string { return SnapshotPrefix + New(node) }

// NewVolume returns a fresh volume ID of node.
func NewVolume(node string) string { return VolumePrefix + New(node) }

func random() string {
	var b [10]byte
	rand.Read(b[:])
	return strings.ToLower(enc.EncodeToString(b[:]))
}

// Node returns the node a sandbox ID names. A malformed ID is an invalid
// (caller) error.
func Node(id string) (string, error) {
	r, node, ok := strings.Cut(id, "-")
	if !ok || len(r) != 16 || ValidNode(node) != nil {
		return "", errdefs.Invalid("malformed sandbox id %q", clip(id))
	}
	for _, c := range r {
		if !(c >= 'a' && c <= 'z' || c >= '2' && c <= '7') {
			return "", errdefs.Invalid("malformed sandbox id %q", clip(id))
		}
	}
	return node, nil
}

// SnapshotNode returns the node a snapshot ID names.
func SnapshotNode(id string) (string, error) {
	rest, ok := strings.CutPrefix(id, SnapshotPrefix)
	if !ok {
		return "", errdefs.Invalid("malformed snapshot id %q", clip(id))
	}
	node, err := Node(rest)
	if err != nil {
		return "", errdefs.Invalid("malformed snapshot id %q", clip(id))
	}
	return node, nil
}

// VolumeNode returns the node a volume ID names.
func VolumeNode(id string) (string, error) {
	rest, ok := strings.CutPrefix(id, VolumePrefix)
	if !ok {
		return "", errdefs.Invalid("malformed volume id %q", clip(id))
	}
	node, err := Node(rest)
	if err != nil {
		return "", errdefs.Invalid("malformed volume id %q", clip(id))
	}
	return node, nil
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
