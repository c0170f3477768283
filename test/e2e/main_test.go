package e2e

import (
	"os"
	"testing"

	"github.com/opendsec/dsec/internal/dsectest"
)

// shared owns servers that several tests use; it is closed after all tests.
var shared = dsectest.Program()

func TestMain(m *testing.M) {
	code := m.Run()
	shared.CloseWith(code)
	os.Exit(code)
}
