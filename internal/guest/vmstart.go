package guest

import (
	"encoding/binary"
	"time"
)

// StartPayload is what the node sends a VM's agent at the start of every
// channel session (portmux's start payload): its clock and fresh
// randomness. A VM restored from a memory snapshot, or resumed, has a
// stale clock and its snapshot's random state; the agent fixes both
// before it serves any call.
func StartPayload(now time.Time, seed []byte) []byte {
	b := make([]byte, 8, 8+len(seed))
	binary.BigEndian.PutUint64(b, uint64(now.UnixMilli()))
	return append(b, seed...)
}

// ParseStartPayload decodes a StartPayload.
func ParseStartPayload(p []byte) (now time.Time, seed []byte, ok bool) {
	if len(p) < 8 {
		return time.Time{}, nil, false
	}
	return time.UnixMilli(int64(binary.BigEndian.Uint64(p[:8]))), p[8:], true
}
