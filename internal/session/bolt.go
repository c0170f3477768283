package session

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/opendsec/dsec/internal/errdefs"
)

var (
	bucket       = []byte("sessions")
	modelsBucket = []byte("models")
)

// BoltStore keeps sessions in an embedded bbolt file (single-host mode).
type BoltStore struct {
	db *bolt.DB
}

// OpenBolt opens (creating) the store at path.
func OpenBolt(path string) (*BoltStore, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return nil, fmt.Errorf("open %s: another dsec process is using it", path)
		}
		return nil, err
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(bucket); err != nil {
			return err
		}
		_, err := tx.CreateBucketIfNotExists(modelsBucket)
		return err
	}); err != nil {
		db.Close()
		return nil, err
	}
	return &BoltStore{db: db}, nil
}

// Close closes the file.
func (s *BoltStore) Close() error { return s.db.Close() }

func (s *BoltStore) GetSession(ctx context.Context, name string) (*Record, error) {
	var r *Record
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucket).Get([]byte(name))
		if v == nil {
			return errdefs.NotFound("session %q not found", name)
		}
		r = new(Record)
		return json.Unmarshal(v, r)
	})
	return r, err
}

func (s *BoltStore) PutSession(ctx context.Context, r *Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put([]byte(r.Key()), b) })
}

func (s *BoltStore) DeleteSession(ctx context.Context, name string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Delete([]byte(name)) })
}

func (s *BoltStore) ListSessions(ctx context.Context) ([]*Record, error) {
	var out []*Record
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
			var r Record
			if json.Unmarshal(v, &r) == nil {
				out = append(out, &r)
			}
			return nil
		})
	})
	return out, err
}

func (s *BoltStore) GetModels(ctx context.Context, key string) ([]byte, error) {
	var out []byte
	err := s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(modelsBucket).Get([]byte(key)); v != nil {
			out = append([]byte(nil), v...)
		}
		return nil
	})
	return out, err
}

func (s *BoltStore) PutModels(ctx context.Context, key string, b []byte) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		if b == nil {
			return tx.Bucket(modelsBucket).Delete([]byte(key))
		}
		return tx.Bucket(modelsBucket).Put([]byte(key), b)
	})
}
