package hostlimits

import (
	"os"
	"path/filepath"
	"testing"
)

func TestTuneRaisesWhatIsBelowItsFloorAndNothingElse(t *testing.T) {
	root := t.TempDir()
	write := func(name, v string) {
		p := filepath.Join(root, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("kernel/pid_max", "32768")
	write("kernel/threads-max", "9999999")
	// A limit that cannot be written (here: a directory in its place).
	os.MkdirAll(filepath.Join(root, "fs/inotify/max_user_instances"), 0o755)
	limits := []Sysctl{
		{Name: "kernel.pid_max", Want: 4194304},
		{Name: "kernel.threads-max", Want: 1048576},
		{Name: "fs.inotify.max_user_instances", Want: 8192},
		{Name: "net.netfilter.nf_conntrack_max", Want: 1048576}, // not on this "kernel"
	}
	changes := Tune(root, limits)
	got := map[string]Change{}
	for _, c := range changes {
		got[c.Name] = c
	}
	if c := got["kernel.pid_max"]; c.Was != 32768 || c.Now != 4194304 || c.Err != nil {
		t.Errorf("pid_max: %+v", c)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "kernel/pid_max")); string(b) != "4194304" {
		t.Errorf("pid_max file holds %q", b)
	}
	if _, ok := got["kernel.threads-max"]; ok {
		t.Errorf("a limit above its floor was touched")
	}
	if c, ok := got["fs.inotify.max_user_instances"]; ok {
		t.Errorf("an unreadable limit was reported: %+v", c)
	}
	if _, ok := got["net.netfilter.nf_conntrack_max"]; ok {
		t.Errorf("a limit the kernel lacks was reported")
	}
}

func TestTuneReportsALimitItCannotRaise(t *testing.T) {
	root := t.TempDir()
	p := filepath.Join(root, "kernel/pid_max")
	os.MkdirAll(filepath.Dir(p), 0o755)
	// A file that reads as a number and refuses writes, root's included.
	if err := os.Symlink("/proc/self/stat", p); err != nil {
		t.Fatal(err)
	}
	changes := Tune(root, []Sysctl{{Name: "kernel.pid_max", Want: 1 << 40}})
	if len(changes) != 1 {
		t.Fatalf("changes: %+v", changes)
	}
	if c := changes[0]; c.Err == nil || c.Now != c.Was {
		t.Errorf("an unwritable limit reported as %+v", c)
	}
}
