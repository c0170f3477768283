package node

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/tenant"
)

// heartbeatEvery is how long an event stream stays silent before a
// heartbeat event (a variable for tests).
var heartbeatEvery = 15 * time.Second

// Events is the node's event hub (webhooks subscribe to it).
func (n *Node) Events() *events.Hub { return n.events }

// publish tells subscribers about s, now in state at: an event of typ,
// adjusted by set.
func (n *Node) publish(s *sandbox, typ string, at state, set func(*dsecv1.Event)) {
	if n.events.Subscribers() == 0 {
		return // nobody listens: build nothing
	}
	ev := &dsecv1.Event{
		Type: typ, SandboxId: s.id, Node: n.cfg.Name, Project: s.project, Kind: s.spec.GetKind(),
		Labels: maps.Clone(s.spec.GetLabels()), At: timestamppb.Now(), State: at.String(),
	}
	if set != nil {
		set(ev)
	}
	n.events.Publish(ev)
}

// EventFilter is what a subscription of ctx's caller asking req may see:
// its own project's sandboxes (an operator: every project's, or req's
// project), with labels matching req's selector, of req's types.
func EventFilter(ctx context.Context, req *dsecv1.SubscribeRequest) (func(*dsecv1.Event) bool, error) {
	sel, err := ParseSelector(req.GetLabelSelector())
	if err != nil {
		return nil, err
	}
	caller := tenant.From(ctx)
	project := caller.Project
	if caller.Admin {
		project = req.GetProject()
	} else if p := req.GetProject(); p != "" && p != project {
		return nil, errdefs.PermissionDenied("project %q is not the caller's", p)
	}
	types := req.GetTypes()
	for _, t := range types {
		if !slices.Contains([]string{events.Created, events.Paused, events.Resumed, events.Snapshotted, events.Forked, events.Ended}, t) {
			return nil, errdefs.Invalid("event type %q (want created, paused, resumed, snapshotted, forked or ended)", t)
		}
	}
	return func(ev *dsecv1.Event) bool {
		return (project == "" || ev.Project == project) && sel.Matches(ev.Labels) &&
			(len(types) == 0 || slices.Contains(types, ev.Type))
	}, nil
}

// Subscribe streams the node's events the caller may see until ctx ends:
// first a heartbeat (the subscription is in place), then the events, with
// a heartbeat after each quiet heartbeatEvery unless heartbeats is false
// (the control plane merging nodes' streams sends its own).
func (n *Node) Subscribe(ctx context.Context, req *dsecv1.SubscribeRequest, send func(*dsecv1.Event) error, heartbeats bool) error {
	match, err := EventFilter(ctx, req)
	if err != nil {
		return err
	}
	sub := n.events.Subscribe(match, 0)
	defer sub.Close()
	// The first event is a heartbeat: once it arrives, every later event
	// reaches the caller.
	if err := send(&dsecv1.Event{Type: events.Heartbeat, Node: n.cfg.Name, At: timestamppb.Now()}); err != nil {
		return err
	}
	for {
		wait, cancel := context.WithTimeout(ctx, heartbeatEvery)
		ev, err := sub.Next(wait)
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && heartbeats:
			ev = &dsecv1.Event{Type: events.Heartbeat, Node: n.cfg.Name, At: timestamppb.Now()}
		case err != nil:
			continue
		}
		if err := send(ev); err != nil {
			return err
		}
	}
}

// Webhook posts the node's events matching Selector and Types (empty:
// all) to URL, signed with Secret (see events.Webhook).
type Webhook struct {
	URL      string
	Secret   []byte
	Selector string
	Types    []string
}

// webhooks checks the webhooks and returns what starts delivering to
// them until the node closes.
func (n *Node) webhooks(hooks []Webhook) (start func(), _ error) {
	operator := tenant.With(context.Background(), tenant.Caller{Project: tenant.DefaultProject, Admin: true})
	type hook struct {
		w     *events.Webhook
		match func(*dsecv1.Event) bool
	}
	var ready []hook
	for _, h := range hooks {
		if !strings.HasPrefix(h.URL, "http://") && !strings.HasPrefix(h.URL, "https://") {
			return nil, errdefs.Invalid("webhook %q: want an http:// or https:// URL", h.URL)
		}
		if len(h.Secret) == 0 {
			return nil, errdefs.Invalid("webhook %s: a secret is required (deliveries are signed with it)", h.URL)
		}
		match, err := EventFilter(operator, &dsecv1.SubscribeRequest{LabelSelector: h.Selector, Types: h.Types})
		if err != nil {
			return nil, fmt.Errorf("webhook %s: %w", h.URL, err)
		}
		ready = append(ready, hook{&events.Webhook{URL: h.URL, Secret: h.Secret, Count: n.m.Webhook}, match})
	}
	return func() {
		if len(ready) == 0 {
			return
		}
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-n.stop; cancel() }()
		for _, h := range ready {
			// Subscribed before New returns: no event of the node's is missed.
			go h.w.Run(ctx, n.events.Subscribe(h.match, 0), n.log.With(slog.String("webhook", h.w.URL)))
		}
	}, nil
}
