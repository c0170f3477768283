package apiserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/tenant"
)

// hooksEvery is how often Hooks rereads the registrations (a change made
// through this server applies at once; one made through another replica
// of a cluster within this).
var hooksEvery = 2 * time.Second

// Hooks keeps the webhooks registered through the API and delivers their
// events: each enabled registration follows the merged event stream of
// every node (Subscribe), as its project (an operator's: every project),
// into a webhook that posts, signs and retries (events.Webhook). In a
// cluster one replica runs the deliveries (Run while it leads); every
// replica serves the registrations.
type Hooks struct {
	store   events.HookStore
	r       Router
	log     *slog.Logger
	count   func(result string)
	formats map[string]func(*events.Hook) events.Format
	changed chan struct{}

	// running: this server runs the deliveries (Run), so a registration
	// made here can wait for its delivery to be in place.
	running atomic.Bool
	mu      sync.Mutex
	live    map[string]chan struct{} // closed once a hook's stream is in place
	ready   chan struct{}            // closed once Run's first deliveries are in place
	readied sync.Once
	passed  chan struct{} // closed at the end of each pass of Run's over the registrations
}

// NewHooks keeps registrations in store and delivers through r; count is
// told each delivery's result.
func NewHooks(store events.HookStore, r Router, log *slog.Logger, count func(string)) *Hooks {
	return &Hooks{store: store, r: r, log: log, count: count, formats: map[string]func(*events.Hook) events.Format{},
		changed: make(chan struct{}, 1), live: map[string]chan struct{}{}, ready: make(chan struct{}), passed: make(chan struct{})}
}

// AddFormat adds a delivery format to the native one (the E2B facade's):
// of returns a registration's (before Run).
func (h *Hooks) AddFormat(name string, of func(*events.Hook) events.Format) { h.formats[name] = of }

// Changed says a registration changed through this server: Run applies
// it now rather than at its next reread.
func (h *Hooks) Changed() {
	select {
	case h.changed <- struct{}{}:
	default:
	}
}

// newHook makes h a registration of the caller's with a new ID, checked.
func newHook(ctx context.Context, h *events.Hook) error {
	var id [8]byte
	rand.Read(id[:])
	c := tenant.From(ctx)
	h.ID, h.Project, h.Admin, h.CreatedAt = "wh-"+hex.EncodeToString(id[:]), c.Project, c.Admin, time.Now().UTC()
	if h.Format == "" {
		h.Format = events.FormatDsec
	}
	return events.CheckHook(h)
}

// Register stores a new registration of the caller's, within the
// per-project bound.
func (h *Hooks) Register(ctx context.Context, hk *events.Hook) error {
	if err := newHook(ctx, hk); err != nil {
		return err
	}
	all, err := h.store.Hooks(ctx)
	if err != nil {
		return err
	}
	n := 0
	for _, o := range all {
		if o.Project == hk.Project {
			n++
		}
	}
	if n >= events.MaxHooks {
		return errdefs.Invalid("project %s has %d webhooks, the most it may have: delete one first", hk.Project, n)
	}
	if err := h.store.PutHook(ctx, hk); err != nil {
		return err
	}
	h.apply(ctx, hk)
	return nil
}

// Ready is closed once Run has put in place the deliveries of the
// registrations it found at its start (or given up on them after
// liveWait): a server that waits for it before it serves misses no event
// of a registration made before a restart.
func (h *Hooks) Ready() <-chan struct{} { return h.ready }

// liveWait bounds how long a registration waits for its delivery.
const liveWait = 10 * time.Second

// apply has Run apply a change to hk now and, where this server runs the
// deliveries and hk is enabled, waits until its event stream is in place
// (every node's), so every event after the call reaches it; disabled, it
// waits until its delivery has stopped (settle). Elsewhere (a
// replica of a cluster that does not lead) the leader applies it within
// hooksEvery.
func (h *Hooks) apply(ctx context.Context, hk *events.Hook) {
	var ch chan struct{}
	if h.running.Load() && hk.Enabled {
		ch = make(chan struct{})
		h.mu.Lock()
		h.live[hk.ID] = ch
		h.mu.Unlock()
	}
	if ch == nil {
		h.settle(ctx)
		return
	}
	h.Changed()
	select {
	case <-ch:
		return
	case <-time.After(liveWait):
		h.log.Warn("a webhook's delivery is not in place yet; its first events may be missed", slog.String("webhook", hk.ID))
	case <-ctx.Done():
	}
	h.mu.Lock()
	if h.live[hk.ID] == ch {
		delete(h.live, hk.ID)
	}
	h.mu.Unlock()
}

// inPlace says hk's stream is in place: whoever waits for it goes on.
func (h *Hooks) inPlace(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ch := h.live[id]; ch != nil {
		close(ch)
		delete(h.live, id)
	}
}

// Find returns the caller's registration id (another project's is not
// found, as one that does not exist).
func (h *Hooks) Find(ctx context.Context, id string) (*events.Hook, error) {
	all, err := h.store.Hooks(ctx)
	if err != nil {
		return nil, err
	}
	for _, hk := range all {
		if hk.ID == id && tenant.Reaches(ctx, hk.Project) {
			return hk, nil
		}
	}
	return nil, errdefs.NotFound("webhook %s not found", id)
}

// Mine lists the caller's registrations (an operator's: all).
func (h *Hooks) Mine(ctx context.Context) ([]*events.Hook, error) {
	all, err := h.store.Hooks(ctx)
	if err != nil {
		return nil, err
	}
	var out []*events.Hook
	for _, hk := range all {
		if tenant.Reaches(ctx, hk.Project) {
			out = append(out, hk)
		}
	}
	return out, nil
}

// Update stores hk, a changed copy of the registration old (found with
// Find).
func (h *Hooks) Update(ctx context.Context, old, hk *events.Hook) error {
	if err := events.CheckHook(hk); err != nil {
		return err
	}
	if err := h.store.PutHook(ctx, hk); err != nil {
		return err
	}
	if hk.Same(old) {
		h.Changed() // its delivery goes on as it was
		return nil
	}
	h.apply(ctx, hk)
	return nil
}

// Remove deletes the caller's registration id.
func (h *Hooks) Remove(ctx context.Context, id string) error {
	if _, err := h.Find(ctx, id); err != nil {
		return err
	}
	if err := h.store.DeleteHook(ctx, id); err != nil {
		return err
	}
	h.settle(ctx)
	return nil
}

// settle has Run apply a change now and, where this server runs the
// deliveries, waits until it has: a disabled or deleted registration's
// delivery has stopped when the call returns. The pass under way may have
// read the registrations before the change; the one after it has not.
func (h *Hooks) settle(ctx context.Context) {
	if !h.running.Load() {
		h.Changed()
		return
	}
	timeout := time.After(liveWait)
	for range 2 {
		h.mu.Lock()
		passed := h.passed
		h.mu.Unlock()
		h.Changed()
		select {
		case <-passed:
		case <-timeout:
			return
		case <-ctx.Done():
			return
		}
	}
}

// Run delivers until ctx ends: it rereads the registrations every
// hooksEvery (and after a change through this server) and starts, restarts
// and stops deliveries to match.
func (h *Hooks) Run(ctx context.Context) {
	h.running.Store(true)
	defer h.running.Store(false)
	type delivery struct {
		hook   *events.Hook
		cancel context.CancelFunc
		done   chan struct{}
	}
	active := map[string]*delivery{}
	stop := func(d *delivery) {
		d.cancel()
		<-d.done
	}
	defer func() {
		for _, d := range active {
			stop(d)
		}
	}()
	t := time.NewTicker(hooksEvery)
	defer t.Stop()
	failing := false
	// Ready: once the first round's deliveries are in place, or after
	// liveWait whatever happened (the store unreadable, a node silent).
	firstRound := true
	giveUpCtx, giveUpCancel := context.WithTimeout(ctx, liveWait)
	defer giveUpCancel()
	giveUp := giveUpCtx.Done()
	go func() {
		<-giveUp
		h.readied.Do(func() { close(h.ready) })
	}()
	for {
		all, err := h.store.Hooks(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			if !failing {
				h.log.Warn("cannot read the registered webhooks; deliveries go on as they were", slog.Any("error", err))
			}
			failing = true
		case err == nil:
			failing = false
			want := map[string]*events.Hook{}
			for _, hk := range all {
				if hk.Enabled {
					want[hk.ID] = hk
				}
			}
			for id, d := range active {
				if hk, ok := want[id]; !ok || !hk.Same(d.hook) {
					stop(d)
					delete(active, id)
				}
			}
			var first []chan struct{} // the first round's deliveries, for Ready
			for id, hk := range want {
				if active[id] != nil {
					continue
				}
				if firstRound {
					ch := make(chan struct{})
					h.mu.Lock()
					h.live[id] = ch
					h.mu.Unlock()
					first = append(first, ch)
				}
				dctx, cancel := context.WithCancel(ctx)
				d := &delivery{hook: hk, cancel: cancel, done: make(chan struct{})}
				active[id] = d
				go func() {
					defer close(d.done)
					h.deliver(dctx, hk)
				}()
			}
			if firstRound {
				firstRound = false
				go func() {
					for _, ch := range first {
						select {
						case <-ch:
						case <-giveUp:
							return
						}
					}
					h.readied.Do(func() { close(h.ready) })
				}()
			}
		}
		h.mu.Lock()
		close(h.passed)
		h.passed = make(chan struct{})
		h.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-h.changed:
		}
	}
}

// deliver follows hk's events until ctx ends. The stream's events go
// into a bounded buffer the webhook drains, so a slow receiver never holds
// the stream (it loses what does not fit, counted).
func (h *Hooks) deliver(ctx context.Context, hk *events.Hook) {
	log := h.log.With(slog.String("webhook", hk.ID), slog.String("url", hk.URL))
	var format events.Format // the webhook's default: FormatDsec
	if hk.Format != events.FormatDsec {
		of := h.formats[hk.Format]
		if of == nil {
			log.Warn("webhook not delivered: this server has no such format", slog.String("format", hk.Format))
			return
		}
		format = of(hk)
	}
	hub := events.NewHub()
	w := &events.Webhook{URL: hk.URL, Secret: hk.Secret, Count: h.count, Format: format}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		w.Run(ctx, hub.Subscribe(nil, 0), log)
	}()
	defer wg.Wait()
	as := tenant.With(ctx, tenant.Caller{Project: hk.Project, Admin: hk.Admin})
	req := &dsecv1.SubscribeRequest{LabelSelector: hk.LabelSelector, Types: hk.Types}
	for ctx.Err() == nil {
		err := Subscribe(as, h.r, req, func(ev *dsecv1.Event) error {
			if ev.Type != eventHeartbeat {
				hub.Publish(ev)
			} else {
				h.inPlace(hk.ID) // the first: every node's stream is in place
			}
			return nil
		})
		if ctx.Err() != nil {
			return
		}
		log.Warn("webhook's event stream ended; following it again", slog.Any("error", err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// errChecked ends check's subscription at its first event.
var errChecked = errors.New("checked")

// check refuses a filter the nodes would refuse (a malformed selector, an
// unknown event type): it subscribes as the caller, as a delivery will,
// until the first heartbeat.
func (h *Hooks) check(ctx context.Context, selector string, types []string) error {
	err := Subscribe(ctx, h.r, &dsecv1.SubscribeRequest{LabelSelector: selector, Types: types}, func(*dsecv1.Event) error { return errChecked })
	if err == errChecked {
		return nil
	}
	return err
}

// webhookService is the WebhookService.
type webhookService struct{ h *Hooks }

func (s webhookService) CreateWebhook(ctx context.Context, req *connect.Request[dsecv1.CreateWebhookRequest]) (*connect.Response[dsecv1.Webhook], error) {
	m := req.Msg
	if err := s.h.check(ctx, m.GetLabelSelector(), m.GetTypes()); err != nil {
		return nil, errwire.ToConnect(err)
	}
	hk := &events.Hook{Name: m.GetName(), URL: m.GetUrl(), Secret: []byte(m.GetSecret()), Enabled: !m.GetDisabled(),
		LabelSelector: m.GetLabelSelector(), Types: m.GetTypes(), Format: events.FormatDsec}
	if err := s.h.Register(ctx, hk); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(hk.Proto()), nil
}

func (s webhookService) ListWebhooks(ctx context.Context, _ *connect.Request[dsecv1.ListWebhooksRequest]) (*connect.Response[dsecv1.ListWebhooksResponse], error) {
	hs, err := s.h.Mine(ctx)
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	out := &dsecv1.ListWebhooksResponse{}
	for _, hk := range hs {
		out.Webhooks = append(out.Webhooks, hk.Proto())
	}
	return connect.NewResponse(out), nil
}

func (s webhookService) GetWebhook(ctx context.Context, req *connect.Request[dsecv1.GetWebhookRequest]) (*connect.Response[dsecv1.Webhook], error) {
	hk, err := s.h.Find(ctx, req.Msg.GetId())
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(hk.Proto()), nil
}

func (s webhookService) UpdateWebhook(ctx context.Context, req *connect.Request[dsecv1.UpdateWebhookRequest]) (*connect.Response[dsecv1.Webhook], error) {
	m := req.Msg
	hk, err := s.h.Find(ctx, m.GetId())
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	c := *hk
	if m.Name != nil {
		c.Name = m.GetName()
	}
	if m.Url != nil {
		c.URL = m.GetUrl()
	}
	if m.Secret != nil {
		c.Secret = []byte(m.GetSecret())
	}
	if m.Enabled != nil {
		c.Enabled = m.GetEnabled()
	}
	if m.LabelSelector != nil {
		c.LabelSelector = m.GetLabelSelector()
	}
	if m.GetSetTypes() {
		c.Types = m.GetTypes()
	}
	if err := s.h.check(ctx, c.LabelSelector, c.Types); err != nil {
		return nil, errwire.ToConnect(err)
	}
	if err := s.h.Update(ctx, hk, &c); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(c.Proto()), nil
}

func (s webhookService) DeleteWebhook(ctx context.Context, req *connect.Request[dsecv1.DeleteWebhookRequest]) (*connect.Response[dsecv1.DeleteWebhookResponse], error) {
	if err := s.h.Remove(ctx, req.Msg.GetId()); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.DeleteWebhookResponse{}), nil
}
