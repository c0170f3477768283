package trajectory

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

func entry(out string) *dsecv1.LogEntry {
	return &dsecv1.LogEntry{Op: "exec", At: timestamppb.New(Now()), Argv: []string{"echo", out}, Result: &dsecv1.ExecResult{Stdout: []byte(out)}}
}

func TestExactlyOnce(t *testing.T) {
	s, _ := Open(t.TempDir())
	l, err := s.Log("sb1")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("a first call runs and is logged", func(t *testing.T) {
		replay, done, err := l.Claim("r1", "fp1", nil)
		if err != nil || replay != nil {
			t.Fatalf("claim: %v %v", replay, err)
		}
		e, err := done(entry("one"))
		if err != nil || e.Seq != 1 {
			t.Fatalf("append: %v seq %d", err, e.GetSeq())
		}
	})
	t.Run("a repeat is answered from the log", func(t *testing.T) {
		replay, done, err := l.Claim("r1", "fp1", nil)
		if err != nil || done != nil || string(replay.GetResult().GetStdout()) != "one" || replay.Seq != 1 {
			t.Fatalf("replay: %v %v", replay, err)
		}
	})
	t.Run("a reused id with another request conflicts", func(t *testing.T) {
		_, _, err := l.Claim("r1", "other", nil)
		if !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("got %v", err)
		}
		// Told apart from other conflicts, on either side of the wire.
		if !Reused(err) || !Reused(errwire.ToConnect(err)) || Reused(errdefs.Conflict("another conflict")) || Reused(nil) {
			t.Fatalf("Reused(%v) on and off the wire", err)
		}
	})
	t.Run("concurrent duplicates run once", func(t *testing.T) {
		var runs atomic.Int32
		var wg sync.WaitGroup
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				replay, done, err := l.Claim("r2", "fp2", nil)
				if err != nil {
					t.Error(err)
					return
				}
				if replay == nil {
					runs.Add(1)
					done(entry("two"))
				}
			}()
		}
		wg.Wait()
		if runs.Load() != 1 {
			t.Fatalf("ran %d times", runs.Load())
		}
	})
	t.Run("the log survives reopening and a torn tail", func(t *testing.T) {
		l.Append(entry("three"))
		s.Close()
		f, _ := os.OpenFile(filepath.Join(s.dir, "logs", "sb1.jsonl"), os.O_APPEND|os.O_WRONLY, 0)
		f.Write([]byte(`{"seq":"4","op":"ex`)) // a crash mid-write
		f.Close()
		s2, _ := Open(s.dir)
		l2, err := s2.Log("sb1")
		if err != nil {
			t.Fatal(err)
		}
		if l2.Len() != 3 {
			t.Fatalf("len %d after reopening", l2.Len())
		}
		replay, _, err := l2.Claim("r2", "fp2", nil)
		if err != nil || string(replay.GetResult().GetStdout()) != "two" {
			t.Fatalf("replay after reopening: %v %v", replay, err)
		}
		e, err := l2.Append(entry("four"))
		if err != nil || e.Seq != 4 {
			t.Fatalf("append after reopening: seq %d %v", e.GetSeq(), err)
		}
		all, next, _ := l2.Read(0, 0)
		if len(all) != 4 || next != 5 {
			t.Fatalf("read %d entries, next %d", len(all), next)
		}
		page, next, _ := l2.Read(2, 2)
		if len(page) != 2 || page[0].Seq != 2 || next != 4 {
			t.Fatalf("page %v next %d", page, next)
		}
	})
}

func TestBlobs(t *testing.T) {
	s, _ := Open(t.TempDir())
	d := s.PutBlob([]byte("content"))
	f, err := s.OpenBlob(d)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	s.GCBlobs() // no log references it
	if _, err := s.OpenBlob(d); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("unreferenced blob kept: %v", err)
	}
}

func TestReadFromTheMiddleAndWaitForMore(t *testing.T) {
	dir := t.TempDir()
	s, _ := Open(dir)
	l, err := s.Log("sb1")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		if _, err := l.Append(entry(string(rune('a' + i%26)))); err != nil {
			t.Fatal(err)
		}
	}
	check := func(l *Log, from uint64, limit, want int, wantNext uint64) {
		t.Helper()
		got, next, err := l.Read(from, limit)
		if err != nil || len(got) != want || next != wantNext {
			t.Fatalf("read from %d limit %d: %d entries, next %d, %v; want %d, next %d", from, limit, len(got), next, err, want, wantNext)
		}
		for i, e := range got {
			if e.Seq != max(from, 1)+uint64(i) {
				t.Fatalf("read from %d: entry %d has seq %d", from, i, e.Seq)
			}
		}
	}
	check(l, 0, 0, 50, 51)
	check(l, 37, 0, 14, 51)
	check(l, 37, 5, 5, 42)
	check(l, 51, 0, 0, 51)
	// A log opened again (a restarted node) reads from the middle too.
	s.Forget("sb1")
	l2, err := s.Log("sb1")
	if err != nil {
		t.Fatal(err)
	}
	check(l2, 49, 0, 2, 51)

	changed := l2.Changed()
	select {
	case <-changed:
		t.Fatal("changed before anything was appended")
	default:
	}
	if _, err := l2.Append(entry("z")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	default:
		t.Fatal("an append did not wake the waiter")
	}
	check(l2, 51, 0, 1, 52)
	changed = l2.Changed()
	s.Forget("sb1")
	select {
	case <-changed:
	default:
		t.Fatal("closing the log did not wake the waiter")
	}
	if _, err := os.Stat(filepath.Join(dir, "logs", "sb1.jsonl")); err != nil {
		t.Fatal(err)
	}
}

// With a sync window, an appended entry is in the file when Append returns
// (another process reads it; a kill of the writer loses none) and on disk
// once the window has passed, or at Sync or close.
func TestSyncWindow(t *testing.T) {
	t.Run("an entry waits for the window's sync, and Sync and close make it durable", func(t *testing.T) {
		dir := t.TempDir()
		s, _ := Open(dir)
		s.SetSyncWindow(time.Hour)
		l, err := s.Log("sb1")
		if err != nil {
			t.Fatal(err)
		}
		e, err := l.Append(entry("a"))
		if err != nil {
			t.Fatal(err)
		}
		if l.Synced() > e.Seq {
			t.Fatalf("synced to %d within an hour's window", l.Synced())
		}
		onDisk := l.SyncedTo(e.Seq)
		select {
		case <-onDisk:
			t.Fatal("SyncedTo fired before any sync")
		default:
		}
		other, _ := Open(dir)
		ol, _ := other.Log("sb1")
		if got, _, err := ol.Read(0, 0); err != nil || len(got) != 1 || string(got[0].Result.Stdout) != "a" {
			t.Fatalf("another reader of the file: %v %v", got, err)
		}
		if err := s.Sync(); err != nil || l.Synced() != e.Seq+1 {
			t.Fatalf("after Sync: synced to %d (%v), want %d", l.Synced(), err, e.Seq+1)
		}
		select {
		case <-onDisk:
		default:
			t.Fatal("SyncedTo did not fire at the sync")
		}
		e2, _ := l.Append(entry("b"))
		if l.Synced() > e2.Seq {
			t.Fatal("the second entry was synced at once")
		}
		s.Forget("sb1")
		if l.Synced() != e2.Seq+1 {
			t.Fatalf("closed with entries not synced: %d, want %d", l.Synced(), e2.Seq+1)
		}
	})
	t.Run("the window's end syncs what it took", func(t *testing.T) {
		s, _ := Open(t.TempDir())
		s.SetSyncWindow(time.Millisecond)
		l, _ := s.Log("sb1")
		var last *dsecv1.LogEntry
		for range 20 {
			last, _ = l.Append(entry("x"))
		}
		select {
		case <-l.SyncedTo(last.Seq):
		case <-time.After(10 * time.Second):
			t.Fatalf("synced to %d 10 s after a 1 ms window, want %d", l.Synced(), last.Seq+1)
		}
		if l.Synced() <= last.Seq {
			t.Fatalf("SyncedTo(%d) fired with the log synced to %d", last.Seq, l.Synced())
		}
	})
	t.Run("without a window every entry is synced before Append returns", func(t *testing.T) {
		s, _ := Open(t.TempDir())
		l, _ := s.Log("sb1")
		for range 3 {
			if e, _ := l.Append(entry("x")); l.Synced() != e.Seq+1 {
				t.Fatalf("synced to %d after entry %d", l.Synced(), e.Seq)
			}
		}
	})
	t.Run("a writer killed right after its answer loses no answered entry", func(t *testing.T) {
		dir := t.TempDir()
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), "TRAJECTORY_WRITER="+dir)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// The writer prints each sequence number once Append returned it,
		// then waits to be killed, its window far from over.
		var answered []string
		sc := bufio.NewScanner(out)
		for sc.Scan() && sc.Text() != "done" {
			answered = append(answered, sc.Text())
		}
		cmd.Process.Kill()
		cmd.Wait()
		if len(answered) != 50 {
			t.Fatalf("the writer answered %d entries: %v", len(answered), answered)
		}
		s, _ := Open(dir)
		l, _ := s.Log("sb1")
		got, _, err := l.Read(0, 0)
		if err != nil || len(got) != len(answered) {
			t.Fatalf("%d entries after the kill (%v), %d answered", len(got), err, len(answered))
		}
		for i, e := range got {
			if strconv.FormatUint(e.Seq, 10) != answered[i] {
				t.Fatalf("entry %d is seq %d, answered %s", i, e.Seq, answered[i])
			}
		}
	})
}

// TestMain runs the package's tests, or TestSyncWindow's writer process.
func TestMain(m *testing.M) {
	if dir := os.Getenv("TRAJECTORY_WRITER"); dir != "" {
		if err := writer(dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// writer appends 50 entries with an hour's sync window, printing each
// sequence number once Append returned it, then "done", and waits to be
// killed.
func writer(dir string) error {
	s, _ := Open(dir)
	s.SetSyncWindow(time.Hour)
	l, err := s.Log("sb1")
	if err != nil {
		return err
	}
	for range 50 {
		e, err := l.Append(entry("x"))
		if err != nil {
			return err
		}
		fmt.Println(e.Seq)
	}
	fmt.Println("done")
	select {}
}
