package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// Delivery formats of a registered webhook.
const (
	FormatDsec = "dsec" // the Event's JSON, Dsec-Signature
	FormatE2B  = "e2b"  // E2B's payload and headers (package e2b)
)

// Hook is a webhook registered through the API: what the server keeps
// (secret included) and delivers to while it is enabled.
type Hook struct {
	ID      string `json:"id"`
	Project string `json:"project"`
	// Admin: registered by an operator, it receives every project's
	// events (Project is then the operator's).
	Admin         bool      `json:"admin,omitempty"`
	Name          string    `json:"name,omitempty"`
	URL           string    `json:"url"`
	Secret        []byte    `json:"secret"`
	Enabled       bool      `json:"enabled"`
	LabelSelector string    `json:"label_selector,omitempty"`
	Types         []string  `json:"types,omitempty"`
	Format        string    `json:"format"`
	CreatedAt     time.Time `json:"created_at"`
	// Shown are the event names it was registered with, in its format's
	// terms, where they differ from Types (E2B's sandbox.lifecycle.*).
	Shown []string `json:"shown,omitempty"`
}

// Proto is h as the API shows it: without its secret.
func (h *Hook) Proto() *dsecv1.Webhook {
	return &dsecv1.Webhook{Id: h.ID, Project: h.Project, Name: h.Name, Url: h.URL, Enabled: h.Enabled,
		LabelSelector: h.LabelSelector, Types: h.Types, CreatedAt: timestamppb.New(h.CreatedAt), Format: h.Format}
}

// Same reports whether a delivery started for h still delivers what h
// asks for (everything but its name).
func (h *Hook) Same(o *Hook) bool {
	if h.URL != o.URL || string(h.Secret) != string(o.Secret) || h.Enabled != o.Enabled || h.LabelSelector != o.LabelSelector ||
		h.Format != o.Format || h.Project != o.Project || h.Admin != o.Admin {
		return false
	}
	return slices.Equal(h.Types, o.Types) && slices.Equal(h.Shown, o.Shown)
}

// MaxHooks bounds the webhooks of one project.
const MaxHooks = 32

// CheckHook refuses a registration that cannot be delivered.
func CheckHook(h *Hook) error {
	u, err := url.Parse(h.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return errdefs.Invalid("webhook URL %q: want an http:// or https:// URL", h.URL)
	}
	if len(h.Secret) == 0 {
		return errdefs.Invalid("a webhook needs a secret: deliveries are signed with it")
	}
	if len(h.Secret) > 1024 || len(h.Name) > 256 || len(h.URL) > 2048 {
		return errdefs.Invalid("webhook secret, name or URL too long (1024, 256, 2048 bytes)")
	}
	return nil
}

// HookStore keeps registrations: a file of the data directory under
// `dsec serve` (FileHooks), etcd in a cluster.
type HookStore interface {
	PutHook(ctx context.Context, h *Hook) error
	// DeleteHook removes id (not_found if there is none).
	DeleteHook(ctx context.Context, id string) error
	// Hooks lists every registration, ordered by ID.
	Hooks(ctx context.Context) ([]*Hook, error)
}

// FileHooks keeps registrations in one JSON file (mode 0600: it holds
// their secrets), rewritten whole on each change.
type FileHooks struct {
	path string
	mu   sync.Mutex
}

// NewFileHooks keeps registrations in path.
func NewFileHooks(path string) *FileHooks { return &FileHooks{path: path} }

func (f *FileHooks) read() (map[string]*Hook, error) {
	b, err := os.ReadFile(f.path)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]*Hook{}, nil
	}
	if err != nil {
		return nil, err
	}
	m := map[string]*Hook{}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", f.path, err)
	}
	return m, nil
}

func (f *FileHooks) write(m map[string]*Hook) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(f.path), ".webhooks-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp.Name(), f.path)
}

// PutHook implements HookStore.
func (f *FileHooks) PutHook(_ context.Context, h *Hook) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.read()
	if err != nil {
		return err
	}
	m[h.ID] = h
	return f.write(m)
}

// DeleteHook implements HookStore.
func (f *FileHooks) DeleteHook(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.read()
	if err != nil {
		return err
	}
	if _, ok := m[id]; !ok {
		return errdefs.NotFound("webhook %s not found", id)
	}
	delete(m, id)
	return f.write(m)
}

// Hooks implements HookStore.
func (f *FileHooks) Hooks(context.Context) ([]*Hook, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.read()
	if err != nil {
		return nil, err
	}
	out := make([]*Hook, 0, len(m))
	for _, h := range m {
		out = append(out, h)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// Format is how a webhook's deliveries look.
type Format interface {
	// Encode is ev's body and the event type it is announced as; ok false
	// leaves ev out (an event the format has no name for).
	Encode(ev *dsecv1.Event) (typ string, body []byte, ok bool, err error)
	// Sign sets the headers of one try: the delivery's ID (the same on
	// each retry) and the signature of body with secret.
	Sign(h http.Header, secret []byte, delivery string, body []byte)
}

// dsecFormat is the native format: the Event's JSON, signed as Sign says.
type dsecFormat struct{}

func (dsecFormat) Encode(ev *dsecv1.Event) (string, []byte, bool, error) {
	b, err := protojson.Marshal(ev)
	return ev.Type, b, true, err
}

func (dsecFormat) Sign(h http.Header, secret []byte, delivery string, body []byte) {
	ts := time.Now().Unix()
	h.Set(HeaderDelivery, delivery)
	h.Set(HeaderTimestamp, fmt.Sprint(ts))
	h.Set(HeaderSignature, Sign(secret, ts, body))
}
