// Package cpio writes "newc" cpio archives, the format of a Linux
// initramfs: the microvm substrate's boot archive and the VM image
// builder's.
package cpio

import (
	"fmt"
	"io"
	"os"
	"path"
	"strings"
)

// Writer writes a "newc" cpio archive.
type Writer struct {
	w    io.Writer
	ino  uint32
	dirs map[string]bool
	err  error
}

// NewWriter returns a writer over w.
func NewWriter(w io.Writer) *Writer {
	return &Writer{w: w, ino: 1, dirs: map[string]bool{".": true, "/": true}}
}

func (c *Writer) header(name string, mode uint32, size int, nlink uint32, rdevMajor, rdevMinor uint32) {
	if c.err != nil {
		return
	}
	name = strings.TrimPrefix(name, "/")
	c.ino++
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	c.write([]byte(hdr + name + "\x00"))
	c.pad(len(hdr) + len(name) + 1)
}

func (c *Writer) write(b []byte) {
	if c.err == nil {
		_, c.err = c.w.Write(b)
	}
}

func (c *Writer) pad(n int) {
	if r := n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// Dir adds a directory and its missing parents.
func (c *Writer) Dir(name string, perm uint32) {
	name = path.Clean("/" + name)
	if c.dirs[name] {
		return
	}
	c.Dir(path.Dir(name), 0o755)
	c.dirs[name] = true
	c.header(name, 0o040000|perm, 0, 2, 0, 0)
}

// File adds a regular file with the given content.
func (c *Writer) File(name string, perm uint32, data []byte) {
	c.Dir(path.Dir(path.Clean("/"+name)), 0o755)
	c.header(name, 0o100000|perm, len(data), 1, 0, 0)
	c.write(data)
	c.pad(len(data))
}

// FileFrom adds a regular file read from src.
func (c *Writer) FileFrom(name string, perm uint32, src string) {
	b, err := os.ReadFile(src)
	if err != nil {
		if c.err == nil {
			c.err = err
		}
		return
	}
	c.File(name, perm, b)
}

// CharDev adds a character device node.
func (c *Writer) CharDev(name string, perm, major, minor uint32) {
	c.Dir(path.Dir(path.Clean("/"+name)), 0o755)
	c.header(name, 0o020000|perm, 0, 1, major, minor)
}

// Close writes the trailer and returns the first error.
func (c *Writer) Close() error {
	c.header("TRAILER!!!", 0, 0, 1, 0, 0)
	return c.err
}
