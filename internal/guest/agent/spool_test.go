package agent

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"testing"
)

func TestTailSpoolKeepsTheLastBytesInOrder(t *testing.T) {
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	for _, where := range []struct {
		name string
		dir  *os.File
	}{{"in a spool file", dir}, {"in memory", nil}} {
		for _, tc := range []struct {
			max, total int
		}{{100, 0}, {100, 99}, {100, 100}, {100, 101}, {100, 1000}, {4096, 100000}, {1, 10}} {
			t.Run(fmt.Sprintf("%s, %d bytes through a tail of %d", where.name, tc.total, tc.max), func(t *testing.T) {
				data := make([]byte, tc.total)
				rand.Read(data)
				sp := newTailSpool(where.dir, int64(tc.max))
				if where.dir != nil && sp.f == nil {
					t.Fatal("no spool file was made")
				}
				dropped := false
				for rest := data; len(rest) > 0; {
					k := min(len(rest), 1+rand.Intn(3*tc.max))
					dropped = sp.add(rest[:k])
					rest = rest[k:]
				}
				var got []byte
				sp.each(7, func(b []byte) {
					if len(b) > 7 {
						t.Fatalf("a chunk of %d bytes, more than 7", len(b))
					}
					got = append(got, b...)
				})
				want := data[max(0, len(data)-tc.max):]
				if !bytes.Equal(got, want) {
					t.Fatalf("kept %d bytes, want the last %d", len(got), len(want))
				}
				if dropped != (tc.total > tc.max) {
					t.Fatalf("dropped %v after %d bytes through %d", dropped, tc.total, tc.max)
				}
			})
		}
	}
}

func TestTailsShareABudgetAndGiveItBack(t *testing.T) {
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	big := newTailSpool(dir, spoolBudget-10)
	short := newTailSpool(dir, 100)
	if short.max != 10 {
		t.Fatalf("the second tail keeps %d bytes, want the 10 left of the budget", short.max)
	}
	data := bytes.Repeat([]byte("x"), 50)
	if !short.add(data) {
		t.Error("50 bytes through a tail cut to 10 are not reported as dropped")
	}
	var got []byte
	short.each(64, func(b []byte) { got = append(got, b...) })
	if len(got) != 10 {
		t.Errorf("the short tail kept %d bytes, want 10", len(got))
	}
	big.close()
	big.close()
	if again := newTailSpool(dir, spoolBudget); again.max != spoolBudget {
		t.Errorf("after both tails closed a new one gets %d bytes, want the whole budget", again.max)
	} else {
		again.close()
	}
}
