package node

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
)

// sandbox is one sandbox of the node, from its start until its end.
type sandbox struct {
	id      string
	spec    *dsecv1.SandboxSpec
	created time.Time
	image   string
	layers  []string
	// lazy is set when a layer of it is loaded on demand (its data read
	// through the blob server), found once at create or re-adoption so
	// that execs ask the image store nothing otherwise.
	lazy    bool
	net     *network.Attachment
	dir     string
	idemKey string
	project string // the project that created it (quotas count by it)
	// volumes are the sandbox's volume mounts as its driver got them (set
	// while it starts; empty after a re-adoption).
	volumes []substrate.VolumeMount

	// inst is set once, before the sandbox goes live: every sandbox in the
	// table's live set has one.
	inst substrate.Instance

	// lastActive is the unix nano time of the last API call.
	lastActive atomic.Int64
	oomKills   atomic.Int64
	pidsHits   atomic.Int64
	history    history // samples of its use (history.go)

	mu    sync.Mutex
	state state
	// ending is why a sandbox being torn down ends, and endedAt when: its
	// view shows them (as its tombstone will) from the moment it is
	// deleting.
	ending  *end
	endedAt time.Time
	expires time.Time
	// timedOut marks a sandbox paused at its TTL (on_timeout "pause"):
	// expires is then the end of its paused_ttl, and a resume gives it a
	// fresh TTL.
	timedOut bool
	// runStart is when the sandbox's current run started (it went live or
	// was last resumed), runEnd when it stopped (paused; zero while it
	// runs): the run paused and ended events report.
	runStart, runEnd time.Time
	// stopped marks a sandbox paused filesystem-only: its instance is
	// stopped (substrate.Stopper), and resuming it boots it.
	stopped bool
	rec     *record
	// network is the sandbox's network since a SetNetworkPolicy (nil:
	// spec.network), credentials' values included.
	network *dsecv1.Network
	// gwStop ends the model gateway's listener (gateway.go); gwKick has
	// it opened again now (a resume).
	gwStop func()
	gwKick chan struct{}

	// gw is the sandbox's model gateway (nil: none), set before it goes
	// live.
	gw *gateway.Sandbox
}

func (s *sandbox) touch() { s.lastActive.Store(time.Now().UnixNano()) }

// guestCan is can for a container's agent (substrate.ProcessGuest,
// FileGuest).
func guestCan[T any](c *ctr, cannot string) (T, error) {
	v, ok := c.guest.(T)
	if !ok {
		return v, errdefs.Unimplemented("kind %q %s", c.s.spec.Kind, cannot)
	}
	return v, nil
}

// can returns s's instance as the optional interface T (substrate.Pauser,
// Snapshotter, MachineSnapshotter, Screen), or an Unimplemented error:
// "kind <kind> <cannot>".
func can[T any](s *sandbox, cannot string) (T, error) {
	v, ok := s.inst.(T)
	if !ok {
		return v, errdefs.Unimplemented("kind %q %s", s.spec.Kind, cannot)
	}
	return v, nil
}

// state is where a sandbox is in its life. Every change goes through
// moveLocked, which allows only the moves below (runc's containerState,
// in a table):
//
//	running  → paused, deleting
//	paused   → running, deleting
//	deleting → deleted, failed    the end, kept in a tombstone
//
// and, only when its instance would not die, a deleting sandbox back to
// where it was (undeleteLocked). A sandbox starts running (a pooled one
// too); deleted and failed are final. Deleted is an end the user asked
// for, failed one the platform caused (crash, TTL, eviction, a failed
// re-adoption).
type state uint8

const (
	stateRunning state = iota + 1
	statePaused
	stateDeleting
	stateDeleted
	stateFailed
)

var stateNames = [...]string{stateRunning: "running", statePaused: "paused", stateDeleting: "deleting", stateDeleted: "deleted", stateFailed: "failed"}

// String is the state's name as the store keeps it.
func (st state) String() string {
	if int(st) < len(stateNames) && stateNames[st] != "" {
		return stateNames[st]
	}
	return fmt.Sprintf("state(%d)", uint8(st))
}

// public is the state as the API shows it: a sandbox being deleted is
// deleted already.
func (st state) public() string {
	if st == stateDeleting {
		return stateDeleted.String()
	}
	return st.String()
}

// parseState reads a state the store kept; unknown names read as 0.
func parseState(name string) state {
	for st, n := range stateNames {
		if n == name && n != "" {
			return state(st)
		}
	}
	return 0
}

var moves = map[state][]state{
	stateRunning:  {statePaused, stateDeleting},
	statePaused:   {stateRunning, stateDeleting},
	stateDeleting: {stateDeleted, stateFailed},
}

// ending reports whether a sandbox in st is being or has been deleted.
func (st state) ending() bool { return st >= stateDeleting }

// endingLocked is nil while s is not ending, else what a call on it
// answers: why it ends when that is known (gone if it was the platform's
// doing, not found otherwise, as its tombstone will answer), else not
// found.
func (s *sandbox) endingLocked() error {
	switch e := s.ending; {
	case !s.state.ending():
		return nil
	case e == nil:
		return errdefs.NotFound("sandbox %s is being deleted", s.id)
	case e.infra:
		return errdefs.Gone("sandbox %s is gone: %s", s.id, e.reason)
	default:
		return errdefs.NotFound("sandbox %s is being deleted: %s", s.id, e.reason)
	}
}

// isEnding is endingLocked for a caller not holding s.mu.
func (s *sandbox) isEnding() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.endingLocked()
}

// mayLocked returns nil if s may move to `to`: endingLocked's answer if s
// is ending, internal otherwise.
func (s *sandbox) mayLocked(to state) error {
	for _, ok := range moves[s.state] {
		if ok == to {
			return nil
		}
	}
	if s.state.ending() && !to.ending() {
		return s.endingLocked()
	}
	return errdefs.Internal(fmt.Errorf("%s to %s", s.state, to), "sandbox %s cannot change state", s.id)
}

// moveLocked moves s to `to` if the table allows it.
func (s *sandbox) moveLocked(to state) error {
	if err := s.mayLocked(to); err != nil {
		return err
	}
	s.state = to
	return nil
}

// undeleteLocked moves a deleting sandbox back to prev, where it was
// before: its release could not destroy its instance, which runs on.
func (s *sandbox) undeleteLocked(prev state) {
	if s.state == stateDeleting && (prev == stateRunning || prev == statePaused) {
		s.state = prev
	}
}

// currentState is s's state now.
func (s *sandbox) currentState() state {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state
}

// record is the sandbox as the store keeps it.
func (s *sandbox) record() *record {
	specJSON, _ := protojson.Marshal(s.spec)
	s.mu.Lock()
	defer s.mu.Unlock()
	r := &record{
		ID: s.id, Kind: s.spec.Kind, Image: s.image, Spec: specJSON, Layers: s.layers,
		Created: s.created, Expires: s.expires, State: s.state.String(), Network: attachmentJSON(s.net), IdemKey: s.idemKey,
		Project: s.project, NetPolicy: networkRecord(s.network), TimedOut: s.timedOut, Stopped: s.stopped,
	}
	if s.inst != nil {
		r.Driver = s.inst.State()
	}
	return r
}

// runLocked is s's run that stops at end (its pause, if it is paused) as
// events report it. s.mu is held.
func (s *sandbox) runLocked(end time.Time) *dsecv1.EventRun {
	if !s.runEnd.IsZero() {
		end = s.runEnd
	}
	start := s.runStart
	if start.IsZero() {
		start = s.created
	}
	return &dsecv1.EventRun{
		StartedAt: timestamppb.New(start), Cpu: s.spec.GetResources().GetCpu(), MemoryMb: s.spec.GetResources().GetMemoryMb(),
		DurationMs: max(end.Sub(start), 0).Milliseconds(),
	}
}
