package node

import (
	"log/slog"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

// startClose is a driver with a life of its own (substrate.Starter,
// Closer) that records when the node starts and closes it.
type startClose struct {
	*substratetest.Fake
	name   string
	events *[]string
}

func (d *startClose) Start() { *d.events = append(*d.events, "start "+d.name) }
func (d *startClose) Close() { *d.events = append(*d.events, "close "+d.name) }

// layered is a startClose built on the container kind.
type layered struct{ *startClose }

func (layered) BuiltOn() substrate.Kind { return substrate.KindContainer }

func TestTheNodeStartsItsDriversAndClosesThoseBuiltOnOthersFirst(t *testing.T) {
	dir := t.TempDir()
	images, err := image.Open(filepath.Join(dir, "images"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	nm, err := network.New(network.Config{NoEgress: true}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	var events []string
	drivers := map[substrate.Kind]substrate.Driver{
		substrate.KindContainer: &startClose{substratetest.NewFake(substrate.KindContainer), "container", &events},
		substrate.KindFunction:  layered{&startClose{substratetest.NewFake(substrate.KindFunction), "function", &events}},
		substrate.KindMicroVM:   substratetest.NewFake(substrate.KindMicroVM), // neither
	}
	n, err := New(Config{Name: "test", DataDir: filepath.Join(dir, "data")}, slog.Default(), images, nm, drivers)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 2 {
		t.Fatalf("after New: %q, want both drivers started", events)
	}
	events = events[:0]
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if want := []string{"close function", "close container"}; !reflect.DeepEqual(events, want) {
		t.Fatalf("Close closed %q, want %q", events, want)
	}
}
