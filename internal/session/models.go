package session

import (
	"context"
	"net/url"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// A session's model upstreams (the model gateway's registry, see
// internal/gateway) are kept beside its record, under the same key, so a
// heartbeat written by another replica never overwrites them.

// maxUpstreams bounds a session's (or a project's) upstreams.
const maxUpstreams = 16

// projectKey is where a project's own upstreams are kept, for every
// sandbox of it: '@' is in no session's or project's name, so it meets no
// session's key.
func projectKey(project string) string { return "@project/" + tenant.OrDefault(project) }

// SetModels replaces the model upstreams and limits of a session of the
// caller's project (it must exist and not be closed), or with no session
// the project's own. The answer holds no credential.
func (m *Manager) SetModels(ctx context.Context, req *dsecv1.SetModelUpstreamsRequest) (*dsecv1.ModelUpstreams, error) {
	cfg := &dsecv1.ModelUpstreams{Session: req.GetSession(), Upstreams: req.GetUpstreams(), Limits: req.GetLimits()}
	if err := validModels(cfg); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	key := projectKey(tenant.Project(ctx))
	if req.GetSession() != "" {
		r, err := m.get(ctx, req.GetSession())
		if err != nil {
			return nil, err
		}
		if r.State == Closed {
			return nil, errdefs.NotFound("session %q is closed", r.Name)
		}
		key = r.Key()
	}
	b, err := protojson.Marshal(cfg)
	if err != nil {
		return nil, errdefs.Internal(err, "encode model upstreams")
	}
	if err := m.store.PutModels(ctx, key, b); err != nil {
		return nil, err
	}
	return redacted(cfg), nil
}

// GetModels returns a session's model upstreams (with no session, the
// project's own), without credentials.
func (m *Manager) GetModels(ctx context.Context, name string) (*dsecv1.ModelUpstreams, error) {
	key := projectKey(tenant.Project(ctx))
	if name != "" {
		r, err := m.get(ctx, name)
		if err != nil {
			return nil, err
		}
		key = r.Key()
	}
	cfg, err := readModels(ctx, m.store, key)
	if err != nil {
		return nil, err
	}
	if cfg == nil {
		cfg = &dsecv1.ModelUpstreams{}
	}
	cfg.Session = name
	return redacted(cfg), nil
}

// Models reads the model upstreams a sandbox of project in session name
// ("" for none) reaches, credentials included (for the gateway only): the
// session's first, then the project's; the session's limits if it set
// any, else the project's. nil when neither registered any.
func Models(ctx context.Context, store Store, project, name string) (*dsecv1.ModelUpstreams, error) {
	var own *dsecv1.ModelUpstreams
	if name != "" {
		var err error
		if own, err = readModels(ctx, store, Key(project, name)); err != nil {
			return nil, err
		}
	}
	shared, err := readModels(ctx, store, projectKey(project))
	if err != nil || shared == nil {
		return own, err
	}
	if own == nil {
		shared.Session = name
		return shared, nil
	}
	own.Upstreams = append(own.Upstreams, shared.Upstreams...)
	if own.Limits == nil {
		own.Limits = shared.Limits
	}
	return own, nil
}

func readModels(ctx context.Context, store Store, key string) (*dsecv1.ModelUpstreams, error) {
	b, err := store.GetModels(ctx, key)
	if err != nil || b == nil {
		return nil, err
	}
	cfg := new(dsecv1.ModelUpstreams)
	if err := protojson.Unmarshal(b, cfg); err != nil {
		return nil, errdefs.Internal(err, "decode model upstreams %s", key)
	}
	return cfg, nil
}

func redacted(cfg *dsecv1.ModelUpstreams) *dsecv1.ModelUpstreams {
	out := proto.Clone(cfg).(*dsecv1.ModelUpstreams)
	for _, u := range out.Upstreams {
		u.HasApiKey = u.ApiKey != ""
		u.ApiKey = ""
	}
	return out
}

func validModels(cfg *dsecv1.ModelUpstreams) error {
	if len(cfg.Upstreams) > maxUpstreams {
		return errdefs.Invalid("at most %d upstreams", maxUpstreams)
	}
	seen := map[string]bool{}
	for _, u := range cfg.Upstreams {
		if !nameRe.MatchString(u.Name) {
			return errdefs.Invalid("upstream name %q must be 1 to 63 letters, digits, '.', '_' or '-'", u.Name)
		}
		if seen[u.Name] {
			return errdefs.Invalid("upstream %q is named twice", u.Name)
		}
		seen[u.Name] = true
		p, err := url.Parse(u.BaseUrl)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" || p.User != nil || p.RawQuery != "" || p.Fragment != "" || p.ForceQuery {
			return errdefs.Invalid("upstream %q: base_url %q must be an http or https URL without credentials (give api_key), query or fragment", u.Name, u.BaseUrl)
		}
		if u.Api != "" && u.Api != "openai" && u.Api != "anthropic" {
			return errdefs.Invalid("upstream %q: api must be openai or anthropic", u.Name)
		}
		if u.TimeoutS < 0 || u.TimeoutS > 3600 || u.IdleTimeoutS < 0 || u.IdleTimeoutS > 3600 {
			return errdefs.Invalid("upstream %q: timeouts must be between 0 and 3600 seconds", u.Name)
		}
		if len(u.Models) > 256 {
			return errdefs.Invalid("upstream %q: at most 256 models", u.Name)
		}
		u.HasApiKey = false
	}
	if l := cfg.Limits; l != nil && (l.MaxConcurrent < 0 || l.TokensPerMinute < 0 || l.TokenBudget < 0 || l.PerSandboxConcurrent < 0) {
		return errdefs.Invalid("limits must not be negative")
	}
	return nil
}
