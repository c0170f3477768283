package apiserver

import (
	"context"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// Event types the merge itself sends (the node's events package names
// the rest).
const (
	eventHeartbeat = "heartbeat"
	eventDropped   = "dropped"
)

// Timings of a merged event stream (variables for tests).
var (
	// heartbeatEvery is the silence after which a heartbeat is sent.
	heartbeatEvery = 15 * time.Second
	// nodesEvery is how often the merge looks for nodes it does not
	// stream from (a node that joined, or one whose stream broke).
	nodesEvery = 5 * time.Second
)

type eventService struct{ r Router }

func (s eventService) Subscribe(ctx context.Context, req *connect.Request[dsecv1.SubscribeRequest], st *connect.ServerStream[dsecv1.Event]) error {
	return errwire.ToConnect(Subscribe(ctx, s.r, req.Msg, st.Send))
}

// Subscribe streams the events of every node r reaches, merged, to send
// until ctx ends: first a heartbeat once every node's stream is in place,
// then the events (each node's in its order), a heartbeat after each
// quiet heartbeatEvery. A node whose stream breaks (it restarted or was
// lost) is streamed from again when it answers; the gap is announced by a
// dropped event naming it, with dropped 0: how many were lost is unknown.
// A request a node refuses (a bad selector, another project) fails the
// call.
func Subscribe(ctx context.Context, r Router, req *dsecv1.SubscribeRequest, send func(*dsecv1.Event) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := &merge{ctx: ctx, req: req, out: make(chan *dsecv1.Event, 256), live: map[string]bool{}, refused: make(chan error, 1)}
	// The first round: every node's first heartbeat (or refusal) before
	// the caller's.
	if err := m.join(r.Nodes(ctx)); err != nil {
		return err
	}
	if err := send(&dsecv1.Event{Type: eventHeartbeat, At: timestamppb.Now()}); err != nil {
		return err
	}
	quiet := time.NewTimer(heartbeatEvery)
	defer quiet.Stop()
	look := time.NewTicker(nodesEvery)
	defer look.Stop()
	for {
		select {
		case ev := <-m.out:
			if err := send(ev); err != nil {
				return err
			}
			quiet.Reset(heartbeatEvery)
		case <-quiet.C:
			if err := send(&dsecv1.Event{Type: eventHeartbeat, At: timestamppb.Now()}); err != nil {
				return err
			}
			quiet.Reset(heartbeatEvery)
		case <-look.C:
			go m.join(r.Nodes(ctx)) // joins in the background: never holds the stream
		case err := <-m.refused:
			return err
		case <-ctx.Done():
			return nil
		}
	}
}

// merge is one caller's merged stream.
type merge struct {
	ctx     context.Context
	req     *dsecv1.SubscribeRequest
	out     chan *dsecv1.Event
	refused chan error // a node refused the request itself

	mu   sync.Mutex
	live map[string]bool // nodes streaming
}

// join starts streaming from the nodes not streaming yet and waits until
// each has sent its first heartbeat or failed. It returns the refusal of
// a request a node refused (invalid, permission denied).
func (m *merge) join(nodes []Node) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes))
	for _, n := range nodes {
		m.mu.Lock()
		if m.live[n.Name()] {
			m.mu.Unlock()
			continue
		}
		m.live[n.Name()] = true
		m.mu.Unlock()
		wg.Add(1)
		go func() {
			first := true
			err := n.Events(m.ctx, m.req, func(ev *dsecv1.Event) error {
				if first {
					first = false
					wg.Done()
					return nil
				}
				select {
				case m.out <- ev:
					return nil
				case <-m.ctx.Done():
					return m.ctx.Err()
				}
			}, false)
			err = errwire.FromConnect(err)
			refusal := m.ctx.Err() == nil && (errdefs.Is(err, errdefs.KindInvalid) || errdefs.Is(err, errdefs.KindPermissionDenied))
			if refusal {
				errs <- err
				select {
				case m.refused <- err:
				default:
				}
			}
			broke := !first
			if first {
				wg.Done()
			}
			m.mu.Lock()
			delete(m.live, n.Name())
			m.mu.Unlock()
			if broke && !refusal && m.ctx.Err() == nil {
				// The stream was in place and broke: its events since are lost.
				select {
				case m.out <- &dsecv1.Event{Type: eventDropped, Node: n.Name(), At: timestamppb.Now()}:
				case <-m.ctx.Done():
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}
