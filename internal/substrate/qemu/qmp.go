package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// QMP is a client of a QEMU monitor socket (QMP). Commands run one at a
// time; it is safe for concurrent use.
type QMP struct {
	conn *net.UnixConn

	mu    sync.Mutex // one command in flight
	resps chan qmpMsg
	done  chan struct{}
	err   error
}

type qmpMsg struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	Event string `json:"event"`
	// QMP is set on the greeting.
	QMP json.RawMessage `json:"QMP"`
}

// QMPError is an error QEMU answered a command with.
type QMPError struct {
	Command, Class, Desc string
}

func (e *QMPError) Error() string { return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc) }

// DialQMP connects to the monitor socket at path and negotiates
// capabilities. It retries until ctx ends, as QEMU creates the socket
// while it starts.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var d net.Dialer
	var c net.Conn
	var err error
	for {
		c, err = d.DialContext(ctx, "unix", path)
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("connect to the QEMU monitor: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	q := &QMP{conn: c.(*net.UnixConn), resps: make(chan qmpMsg, 1), done: make(chan struct{})}
	greeting := make(chan error, 1)
	go q.read(greeting)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	select {
	case err := <-greeting:
		if err != nil {
			c.Close()
			return nil, err
		}
	case <-ctx.Done():
		c.Close()
		return nil, fmt.Errorf("QEMU monitor greeting: %w", ctx.Err())
	}
	if err := q.Execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		c.Close()
		return nil, err
	}
	return q, nil
}

func (q *QMP) read(greeting chan<- error) {
	defer close(q.done)
	sc := bufio.NewScanner(q.conn)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	first := true
	for sc.Scan() {
		var m qmpMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			continue
		}
		// An event can come before the greeting (one QEMU emitted while
		// accepting the connection); only the greeting opens the session,
		// and only answers answer commands.
		if m.QMP != nil {
			if first {
				first = false
				greeting <- nil
			}
			continue
		}
		if m.Event != "" || first {
			continue
		}
		select {
		case q.resps <- m:
		default:
		}
	}
	q.err = sc.Err()
	if first {
		greeting <- fmt.Errorf("QEMU monitor closed before its greeting: %v", sc.Err())
	}
}

// Execute runs a command and decodes its return value into out (if not
// nil). ctx bounds the wait for the answer.
func (q *QMP) Execute(ctx context.Context, cmd string, args, out any) error {
	return q.execute(ctx, cmd, args, out, nil)
}

// SendFD passes f to QEMU under name (the getfd command), for commands
// that take "fd:name".
func (q *QMP) SendFD(ctx context.Context, name string, f *os.File) error {
	return q.execute(ctx, "getfd", map[string]any{"fdname": name}, nil, f)
}

func (q *QMP) execute(ctx context.Context, cmd string, args, out any, f *os.File) error {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	var oob []byte
	if f != nil {
		oob = unix.UnixRights(int(f.Fd()))
	}
	if _, _, err := q.conn.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	select {
	case m := <-q.resps:
		if m.Error != nil {
			return &QMPError{Command: cmd, Class: m.Error.Class, Desc: m.Error.Desc}
		}
		if out != nil {
			return json.Unmarshal(m.Return, out)
		}
		return nil
	case <-q.done:
		return fmt.Errorf("qmp %s: the monitor connection closed (QEMU exited?)", cmd)
	case <-ctx.Done():
		// The answer may still come; a later command must not take it.
		q.conn.Close()
		return fmt.Errorf("qmp %s: %w", cmd, ctx.Err())
	}
}

// Close closes the connection.
func (q *QMP) Close() error { return q.conn.Close() }

// Status is the VM's run state ("running", "paused", "inmigrate",
// "postmigrate", ...).
func (q *QMP) Status(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	err := q.Execute(ctx, "query-status", nil, &st)
	return st.Status, err
}
