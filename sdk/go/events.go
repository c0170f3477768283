package dsec

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// EventOptions choose the events of a subscription.
type EventOptions struct {
	// Labels is a label selector ("k=v,k2"), as List takes.
	Labels string
	// Types are the event types wanted (empty: all): created, paused,
	// resumed, snapshotted, forked, ended.
	Types []string
	// Project, for an operator's key, narrows to one project.
	Project string
}

// Events is a subscription to sandbox lifecycle events.
type Events struct {
	st *connect.ServerStreamForClient[dsecv1.Event]
}

// Subscribe opens a subscription to the lifecycle events of the caller's
// sandboxes. It returns once the subscription is in place: every event
// after that reaches it. Close it when done (or cancel ctx).
func (c *Client) Subscribe(ctx context.Context, o EventOptions) (*Events, error) {
	st, err := c.raw.Events.Subscribe(ctx, connect.NewRequest(&dsecv1.SubscribeRequest{LabelSelector: o.Labels, Types: o.Types, Project: o.Project}))
	if err != nil {
		return nil, asError(err)
	}
	if !st.Receive() { // the first event: a heartbeat once every node streams
		err := st.Err()
		st.Close()
		if err == nil {
			err = errors.New("event stream ended before it started")
		}
		return nil, asError(err)
	}
	return &Events{st: st}, nil
}

// Next returns the next event, waiting for it. A "dropped" event says the
// subscriber fell behind and lost Dropped events (0: an unknown number, a
// node's stream broke). Heartbeats are skipped. After Close, or when the
// subscription's context ends, it returns io.EOF or the context's error.
func (e *Events) Next() (*dsecv1.Event, error) {
	for e.st.Receive() {
		if ev := e.st.Msg(); ev.GetType() != "heartbeat" {
			return ev, nil
		}
	}
	if err := e.st.Err(); err != nil {
		return nil, asError(err)
	}
	return nil, io.EOF
}

// Close ends the subscription.
func (e *Events) Close() error { return e.st.Close() }

// WebhookOptions register a webhook.
type WebhookOptions struct {
	// URL receives each event as a signed POST (http or https).
	URL string
	// Secret keys the signature (Dsec-Signature: see docs/observability.md).
	Secret string
	Name   string
	// Labels and Types choose the events, as in EventOptions.
	Labels string
	Types  []string
	// Disabled registers it without delivering yet.
	Disabled bool
}

// CreateWebhook registers a URL that receives the lifecycle events of the
// caller's sandboxes (an operator's: every project's) until it is deleted.
func (c *Client) CreateWebhook(ctx context.Context, o WebhookOptions) (*dsecv1.Webhook, error) {
	r, err := c.raw.Webhooks.CreateWebhook(ctx, connect.NewRequest(&dsecv1.CreateWebhookRequest{
		Url: o.URL, Secret: o.Secret, Name: o.Name, LabelSelector: o.Labels, Types: o.Types, Disabled: o.Disabled,
	}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}

// Webhooks lists the caller's webhooks.
func (c *Client) Webhooks(ctx context.Context) ([]*dsecv1.Webhook, error) {
	r, err := c.raw.Webhooks.ListWebhooks(ctx, connect.NewRequest(&dsecv1.ListWebhooksRequest{}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg.Webhooks, nil
}

// EnableWebhook starts (enabled) or stops delivering to webhook id.
func (c *Client) EnableWebhook(ctx context.Context, id string, enabled bool) (*dsecv1.Webhook, error) {
	r, err := c.raw.Webhooks.UpdateWebhook(ctx, connect.NewRequest(&dsecv1.UpdateWebhookRequest{Id: id, Enabled: &enabled}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}

// DeleteWebhook removes webhook id. Where the server delivers (dsec
// serve, a cluster's leading replica) it returns once the deliveries have
// stopped; through another replica they stop within 2 s.
func (c *Client) DeleteWebhook(ctx context.Context, id string) error {
	_, err := c.raw.Webhooks.DeleteWebhook(ctx, connect.NewRequest(&dsecv1.DeleteWebhookRequest{Id: id}))
	return asError(err)
}
