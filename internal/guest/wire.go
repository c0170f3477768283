// Package guest speaks the node side of the protocol with dsec-guest, the
// agent that runs inside every container and VM sandbox.
//
// The protocol (api/dsec/guest/v1) runs one call per stream connection; each
// message is a protobuf preceded by its uvarint length. The agent itself is
// in package guest/agent; this package holds the framing both sides share
// and the Client the node uses.
package guest

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"google.golang.org/protobuf/proto"
)

// MaxMessage bounds one framed message. Data chunks are far smaller; the
// bound keeps a confused or hostile peer from making the other side allocate.
const MaxMessage = 8 << 20

// ChunkSize is the size of file and output data chunks.
const ChunkSize = 64 << 10

var errTooLarge = errors.New("guest message too large")

// Reader reads framed messages.
type Reader struct {
	br  *bufio.Reader
	buf []byte
}

// NewReader returns a Reader over r.
func NewReader(r io.Reader) *Reader { return &Reader{br: bufio.NewReaderSize(r, 64<<10)} }

// Raw returns the bytes after the messages read so far: what the reader
// buffered first, then the rest of the stream. A call whose connection
// carries a raw stream after its messages (dial_port) reads it here.
func (r *Reader) Raw() io.Reader { return r.br }

// Read reads one message into m.
func (r *Reader) Read(m proto.Message) error {
	n, err := binary.ReadUvarint(r.br)
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return io.EOF
		}
		return err
	}
	if n > MaxMessage {
		return errTooLarge
	}
	if cap(r.buf) < int(n) {
		r.buf = make([]byte, n)
	}
	b := r.buf[:n]
	if _, err := io.ReadFull(r.br, b); err != nil {
		if errors.Is(err, io.EOF) {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	if err := proto.Unmarshal(b, m); err != nil {
		return fmt.Errorf("decode guest message: %w", err)
	}
	return nil
}

// Writer writes framed messages. It is safe for concurrent use; each
// message is written with a single Write call.
type Writer struct {
	mu  sync.Mutex
	w   io.Writer
	buf []byte
}

// NewWriter returns a Writer over w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// Write writes one message.
func (w *Writer) Write(m proto.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	size := proto.Size(m)
	if size > MaxMessage {
		return errTooLarge
	}
	b := binary.AppendUvarint(w.buf[:0], uint64(size))
	b, err := proto.MarshalOptions{}.MarshalAppend(b, m)
	if err != nil {
		return err
	}
	if cap(b) <= 256<<10 {
		w.buf = b
	}
	_, err = w.w.Write(b)
	return err
}
