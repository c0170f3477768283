package loopfs

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/mountns"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		// Mounts stay in a namespace of the test's own.
		if err := mountns.Enter(); err != nil {
			panic(err)
		}
	}
	os.Exit(m.Run())
}

// Images of one shape are copies of one template: each is sparse, a file
// system of its own, and full at its own size.
func TestImagesOfAShapeAreSparseFileSystemsOfTheirOwn(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root (loop devices and mounts); make test runs as root")
	}
	if why := Available(); why != "" {
		t.Fatal(why)
	}
	dir := t.TempDir()
	var mnts []string
	for _, name := range []string{"a", "b"} {
		img := filepath.Join(dir, name+".img")
		if err := Make(img, 64, Options{}); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(img, &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != 64<<20 || st.Blocks*512 > 1<<20 {
			t.Errorf("%s: %d bytes long, %d on disk: want 64 MiB long, under 1 MiB on disk", name, st.Size, st.Blocks*512)
		}
		mnt := filepath.Join(dir, name)
		if err := AttachMount(img, mnt); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
		mnts = append(mnts, mnt)
	}
	if tmpls, _ := filepath.Glob(filepath.Join(dir, ".template-*")); len(tmpls) != 1 {
		t.Errorf("templates: %q, want one", tmpls)
	}
	if err := os.WriteFile(filepath.Join(mnts[0], "only-in-a"), []byte("a"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(mnts[1], "only-in-a")); err == nil {
		t.Errorf("a file written in one image shows in the other")
	}
	// Filling one leaves the other empty.
	f, err := os.Create(filepath.Join(mnts[0], "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var werr error
	for i := 0; i < 128 && werr == nil; i++ {
		_, werr = f.Write(buf)
	}
	f.Close()
	if werr == nil {
		t.Errorf("128 MiB went into a 64 MiB image")
	}
	var a, b unix.Statfs_t
	unix.Statfs(mnts[0], &a)
	unix.Statfs(mnts[1], &b)
	if a.Bfree > a.Blocks/10 || b.Bfree < b.Blocks*9/10 {
		t.Errorf("free blocks: filled %d of %d, other %d of %d", a.Bfree, a.Blocks, b.Bfree, b.Blocks)
	}
}
