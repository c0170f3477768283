package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
)

// The node's embedded store (bbolt in the data directory) is the source of
// truth for its sandboxes: a restarted node re-adopts what it finds here.
var (
	bucketSandboxes  = []byte("sandboxes")
	bucketTombstones = []byte("tombstones")
	bucketIdem       = []byte("idempotency")
	// bucketFences holds idempotency keys this node refused and the
	// cluster placed elsewhere (key → when, RFC 3339): no create with one
	// may complete here afterwards.
	bucketFences = []byte("fences")
)

// record is a sandbox as persisted.
type record struct {
	ID       string    `json:"id"`
	Kind     string    `json:"kind"`
	Image    string    `json:"image"`
	Spec     []byte    `json:"spec"` // protojson of dsecv1.SandboxSpec
	Layers   []string  `json:"layers"`
	Created  time.Time `json:"created"`
	Expires  time.Time `json:"expires"`
	State    string    `json:"state"`
	Reason   string    `json:"reason,omitempty"`
	Driver   []byte    `json:"driver,omitempty"`
	Network  []byte    `json:"network,omitempty"`
	IdemKey  string    `json:"idem_key,omitempty"`
	Deleted  time.Time `json:"deleted,omitempty"`
	Infra    bool      `json:"infra,omitempty"` // the end was the platform's doing
	Cause    string    `json:"cause,omitempty"` // the end's class (end.cause)
	Hostname string    `json:"hostname,omitempty"`
	Project  string    `json:"project,omitempty"`
	// NetPolicy is the sandbox's network (protojson of dsecv1.Network)
	// since a SetNetworkPolicy; without one, the spec's.
	NetPolicy []byte `json:"net_policy,omitempty"`
	// TimedOut marks a sandbox paused at its TTL (see sandbox.timedOut).
	TimedOut bool `json:"timed_out,omitempty"`
	// Stopped marks a sandbox paused filesystem-only (see sandbox.stopped).
	Stopped bool `json:"stopped,omitempty"`
}

type store struct {
	db *bolt.DB
}

func openStore(path string) (*store, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return nil, fmt.Errorf("open %s: another dsec process is using this data directory", path)
		}
		return nil, fmt.Errorf("open node store: %w", err)
	}
	// Batch coalesces concurrent writers into one fsync'd transaction; a
	// short window keeps a lone writer from waiting the 10 ms default.
	db.MaxBatchDelay = time.Millisecond
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketTombstones, bucketIdem, bucketFences} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &store{db: db}, nil
}

func (s *store) close() error { return s.db.Close() }

// put writes a live sandbox record (and its idempotency key), coalescing
// concurrent writers into one transaction.
func (s *store) put(r *record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return s.db.Batch(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).Put([]byte(r.ID), b); err != nil {
			return err
		}
		if r.IdemKey != "" {
			return tx.Bucket(bucketIdem).Put([]byte(r.IdemKey), []byte(r.ID))
		}
		return nil
	})
}

// bury replaces a live record with a tombstone.
func (s *store) bury(r *record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return s.db.Batch(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).Delete([]byte(r.ID)); err != nil {
			return err
		}
		return tx.Bucket(bucketTombstones).Put([]byte(r.ID), b)
	})
}

func (s *store) live() ([]*record, error) {
	var out []*record
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return nil // an unreadable record cannot be adopted; it is swept
			}
			out = append(out, &r)
			return nil
		})
	})
	return out, err
}

func (s *store) tombstone(id string) (*record, bool) {
	var r *record
	s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketTombstones).Get([]byte(id)); v != nil {
			r = new(record)
			if json.Unmarshal(v, r) != nil {
				r = nil
			}
		}
		return nil
	})
	return r, r != nil
}

func (s *store) idem(key string) (string, bool) {
	id, _ := s.idemOrFence(key)
	return id, id != ""
}

// idemOrFence returns the sandbox an idempotency key created, or whether
// the key is fenced on this node.
func (s *store) idemOrFence(key string) (id string, fenced bool) {
	s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketIdem).Get([]byte(key)); v != nil {
			id = string(v)
		}
		fenced = tx.Bucket(bucketFences).Get([]byte(key)) != nil
		return nil
	})
	return id, fenced
}

// fence records that no create with key may complete on this node.
func (s *store) fence(key string, at time.Time) error {
	return s.db.Batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketFences).Put([]byte(key), []byte(at.UTC().Format(time.RFC3339)))
	})
}

// purge removes tombstones and idempotency keys of sandboxes deleted
// before cutoff, and returns their IDs.
func (s *store) purge(cutoff time.Time) ([]string, error) {
	var ids []string
	err := s.db.Update(func(tx *bolt.Tx) error {
		tb := tx.Bucket(bucketTombstones)
		ib := tx.Bucket(bucketIdem)
		var dead [][]byte
		var keys [][]byte
		tb.ForEach(func(k, v []byte) error {
			var r record
			if json.Unmarshal(v, &r) != nil || r.Deleted.Before(cutoff) {
				dead = append(dead, append([]byte(nil), k...))
				if r.IdemKey != "" {
					keys = append(keys, []byte(r.IdemKey))
				}
			}
			return nil
		})
		for _, k := range dead {
			tb.Delete(k)
			ids = append(ids, string(k))
		}
		for _, k := range keys {
			ib.Delete(k)
		}
		// Fences last as long as the keys of deleted sandboxes: longer than
		// a client retries a create.
		fb := tx.Bucket(bucketFences)
		var old [][]byte
		fb.ForEach(func(k, v []byte) error {
			if at, err := time.Parse(time.RFC3339, string(v)); err != nil || at.Before(cutoff) {
				old = append(old, append([]byte(nil), k...))
			}
			return nil
		})
		for _, k := range old {
			fb.Delete(k)
		}
		return nil
	})
	return ids, err
}
