package session

import (
	"context"
	"net/url"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// A session's model upstreams (the model gateway's registry, see
// internal/gateway) are kept beside its record, under the same key, so a
// heartbeat written by another replica never overwrites them.

// maxUpstreams bounds a session's upstreams.
const maxUpstreams = 16

// SetModels replaces the model upstreams and limits of a session of the
// caller's project. The session must exist and not be closed. The answer
// holds no credential.
func (m *Manager) SetModels(ctx context.Context, req *dsecv1.SetModelUpstreamsRequest) (*dsecv1.ModelUpstreams, error) {
	cfg := &dsecv1.ModelUpstreams{Session: req.GetSession(), Upstreams: req.GetUpstreams(), Limits: req.GetLimits()}
	if err := validModels(cfg); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.get(ctx, req.GetSession())
	if err != nil {
		return nil, err
	}
	if r.State == Closed {
		return nil, errdefs.NotFound("session %q is closed", r.Name)
	}
	b, err := protojson.Marshal(cfg)
	if err != nil {
		return nil, errdefs.Internal(err, "encode model upstreams")
	}
	if err := m.store.PutModels(ctx, r.Key(), b); err != nil {
		return nil, err
	}
	return redacted(cfg), nil
}

// GetModels returns a session's model upstreams, without credentials.
func (m *Manager) GetModels(ctx context.Context, name string) (*dsecv1.ModelUpstreams, error) {
	r, err := m.get(ctx, name)
	if err != nil {
		return nil, err
	}
	cfg, err := Models(ctx, m.store, r.Project, r.Name)
	if err != nil {
		return nil, err
	}
	if cfg == nil {
		cfg = &dsecv1.ModelUpstreams{Session: r.Name}
	}
	return redacted(cfg), nil
}

// Models reads the model upstreams of project's session name from store,
// credentials included (for the gateway only): nil when it registered
// none or does not exist.
func Models(ctx context.Context, store Store, project, name string) (*dsecv1.ModelUpstreams, error) {
	if name == "" {
		return nil, nil
	}
	b, err := store.GetModels(ctx, Key(project, name))
	if err != nil || b == nil {
		return nil, err
	}
	cfg := new(dsecv1.ModelUpstreams)
	if err := protojson.Unmarshal(b, cfg); err != nil {
		return nil, errdefs.Internal(err, "decode model upstreams of session %q", name)
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
