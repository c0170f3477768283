package cpio

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestCPIOIsReadByBusybox(t *testing.T) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("needs busybox (apt-get install busybox-static)")
	}
	var buf bytes.Buffer
	c := NewWriter(&buf)
	c.File("a/b/file.txt", 0o644, []byte("hello"))
	c.CharDev("dev/console", 0o600, 5, 1)
	c.Dir("empty", 0o755)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command(bb, "cpio", "-i", "-d")
	cmd.Dir = dir
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("busybox cpio: %v\n%s", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "a/b/file.txt")); err != nil || string(b) != "hello" {
		t.Fatalf("file: %q %v", b, err)
	}
	if st, err := os.Stat(filepath.Join(dir, "empty")); err != nil || !st.IsDir() {
		t.Fatalf("dir: %v", err)
	}
	if st, err := os.Lstat(filepath.Join(dir, "dev/console")); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		t.Fatalf("char device: %v %v", st, err)
	}
}
