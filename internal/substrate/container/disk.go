package container

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/opendsec/dsec/internal/loopfs"
	"golang.org/x/sys/unix"
)

// Disk limits.
//
// Each sandbox's writable layer (the overlay's upper and work directories)
// is on a file system of its own: a sparse ext4 image (no journal: the
// layer does not outlive the host) attached to a loop device and mounted
// in the node's mount namespace. Its size is the sandbox's disk_mb, its
// inodes one per 16 KiB: a writer past either gets ENOSPC, `df` inside (a
// statfs of the overlay asks its upper directory's file system) shows the
// sandbox's size and use, and nothing outside the image is touched. Blocks
// the sandbox frees go back to the host (the mount discards, the loop
// device punches holes in the image).
//
// Making one costs mkfs and a mount, 27–53 ms here, so a few file systems
// of the default size are made ahead (diskPool), and a deleted sandbox's
// is emptied and handed to the next create when it held little. Project
// quotas on one shared file system would cost two system calls, but this
// kernel has no quota formats for ext4 (CONFIG_QFMT_V2) nor XFS quotas.
//
// A node restarted while sandboxes run finds each one's loop device by its
// image (a second loop device over the same image would be a second file
// system over the same blocks) and mounts it again.

const (
	// minDiskMB is the smallest disk a sandbox may ask for.
	minDiskMB = 16
	// bytesPerInode sizes a sandbox's inode count from its disk size.
	bytesPerInode = 16 << 10
	// diskPoolSize is how many default-size file systems are made ahead;
	// deleted sandboxes' go back to the pool up to diskPoolMax (so a
	// steady stream of creates and deletes makes none).
	diskPoolSize = 2
	diskPoolMax  = 4
	// recycleInodes: a deleted sandbox's file system holding fewer files
	// is emptied and reused; one holding more is deleted (emptying it
	// could take longer than making one).
	recycleInodes = 2048
)

// sandboxDisk is one sandbox file system.
type sandboxDisk struct {
	Name   string `json:"name"`
	SizeMB int64  `json:"size_mb"`
	img    string
	dir    string // mountpoint
}

// diskPool makes, hands out and removes sandbox file systems. Methods are
// safe for concurrent use.
type diskPool struct {
	imgDir    string // images: StateDir/disks
	mntDir    string // mountpoints: RunDir/disks
	defaultMB int64
	log       *slog.Logger
	kick      chan struct{}
	// loops are the host's loop devices as found at start (for
	// re-adoption).
	loops loopfs.Loops

	mu     sync.Mutex
	closed bool
	ready  []*sandboxDisk
	// busy are the names of disks a sandbox or the pool holds.
	busy map[string]bool
}

func openDiskPool(imgDir, mntDir string, defaultMB int64, log *slog.Logger) (*diskPool, error) {
	if why := loopfs.Available(); why != "" {
		return nil, errors.New(why)
	}
	for _, d := range []string{imgDir, mntDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	p := &diskPool{imgDir: imgDir, mntDir: mntDir, defaultMB: defaultMB, log: log,
		kick: make(chan struct{}, 1), loops: loopfs.Attached(), busy: map[string]bool{}}
	// One made now: a host that cannot make them says so at start.
	sd, err := p.make(defaultMB)
	if err != nil {
		return nil, err
	}
	p.ready = append(p.ready, sd)
	go p.fill()
	p.refill()
	return p, nil
}

// take returns an empty file system of sizeMB, mounted. Call refill once
// the create is done.
func (p *diskPool) take(sizeMB int64) (*sandboxDisk, error) {
	if sizeMB == p.defaultMB {
		p.mu.Lock()
		var sd *sandboxDisk
		if n := len(p.ready); n > 0 {
			sd, p.ready = p.ready[n-1], p.ready[:n-1]
		}
		p.mu.Unlock()
		if sd != nil {
			return sd, nil
		}
	}
	return p.make(sizeMB)
}

// refill makes the pool full again, in the background.
func (p *diskPool) refill() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// fill keeps diskPoolSize file systems ready, for the node's life.
func (p *diskPool) fill() {
	for range p.kick {
		for {
			p.mu.Lock()
			n, closed := len(p.ready), p.closed
			p.mu.Unlock()
			if n >= diskPoolSize || closed {
				break
			}
			sd, err := p.make(p.defaultMB)
			if err != nil {
				p.log.Warn("make a sandbox file system ahead", slog.Any("error", err))
				break
			}
			p.mu.Lock()
			if closed = p.closed; !closed {
				p.ready = append(p.ready, sd)
			}
			p.mu.Unlock()
			if closed {
				p.delete(sd)
			}
		}
	}
}

func (p *diskPool) paths(name string) (img, dir string) {
	return filepath.Join(p.imgDir, name+".img"), filepath.Join(p.mntDir, name)
}

// make makes, attaches and mounts a file system of sizeMB. On error
// nothing is left.
func (p *diskPool) make(sizeMB int64) (_ *sandboxDisk, err error) {
	var b [6]byte
	rand.Read(b[:])
	sd := &sandboxDisk{Name: hex.EncodeToString(b[:]), SizeMB: sizeMB}
	sd.img, sd.dir = p.paths(sd.Name)
	p.mu.Lock()
	p.busy[sd.Name] = true
	p.mu.Unlock()
	defer func() {
		if err != nil {
			p.delete(sd)
		}
	}()
	if err := loopfs.Make(sd.img, sizeMB, loopfs.Options{BytesPerInode: bytesPerInode}); err != nil {
		return nil, err
	}
	if err := loopfs.AttachMount(sd.img, sd.dir); err != nil {
		return nil, err
	}
	os.Remove(filepath.Join(sd.dir, "lost+found"))
	return sd, nil
}

// own takes a sandbox's file system, named in its state, back after a
// restart (so sweep keeps it and release finds it).
func (p *diskPool) own(sd *sandboxDisk) {
	sd.img, sd.dir = p.paths(sd.Name)
	p.mu.Lock()
	p.busy[sd.Name] = true
	p.mu.Unlock()
}

// adopt mounts a running sandbox's file system (owned) again after a
// restart, through the loop device it is still attached to.
func (p *diskPool) adopt(sd *sandboxDisk) error {
	if _, err := os.Stat(sd.img); err != nil {
		return err
	}
	dev := p.loops.Of(sd.img)
	if dev == "" {
		return errors.New("its loop device is gone")
	}
	var mnt unix.Statfs_t
	if unix.Statfs(filepath.Join(sd.dir, "upper"), &mnt) == nil && mnt.Type == unix.EXT4_SUPER_MAGIC {
		return nil // mounted already
	}
	return loopfs.Mount(dev, sd.dir)
}

// close deletes the pool's file systems; a later take makes one.
func (p *diskPool) close() {
	p.mu.Lock()
	ready := p.ready
	p.ready, p.closed = nil, true
	p.mu.Unlock()
	for _, sd := range ready {
		p.delete(sd)
	}
}

// release gives a deleted sandbox's file system back: emptied into the
// pool if it held little and the pool has room, else unmounted and
// deleted. It runs in the background; the sandbox's overlay must be gone.
func (p *diskPool) release(sd *sandboxDisk) {
	go func() {
		var st unix.Statfs_t
		recycle := sd.SizeMB == p.defaultMB && unix.Statfs(sd.dir, &st) == nil && st.Files-st.Ffree < recycleInodes
		p.mu.Lock()
		recycle = recycle && len(p.ready) < diskPoolMax && !p.closed
		p.mu.Unlock()
		if recycle && p.empty(sd) == nil {
			p.mu.Lock()
			if len(p.ready) < diskPoolMax && !p.closed {
				p.ready = append(p.ready, sd)
				sd = nil
			}
			p.mu.Unlock()
		}
		if sd != nil {
			p.delete(sd)
		}
	}()
}

// empty removes everything on a file system.
func (p *diskPool) empty(sd *sandboxDisk) error {
	ents, err := os.ReadDir(sd.dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(sd.dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// delete unmounts a file system and removes its image; the loop device
// detaches itself once the last mount is gone.
func (p *diskPool) delete(sd *sandboxDisk) {
	if err := unix.Unmount(sd.dir, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		p.log.Warn("unmount a sandbox file system", slog.String("disk", sd.Name), slog.Any("error", err))
	}
	os.Remove(sd.dir)
	os.Remove(sd.img)
	p.mu.Lock()
	delete(p.busy, sd.Name)
	p.mu.Unlock()
}

// sweep deletes the images no sandbox or the pool holds (sandboxes that
// ended while the node was down).
func (p *diskPool) sweep() int {
	ents, _ := os.ReadDir(p.imgDir)
	n := 0
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".img")
		if !ok {
			continue
		}
		p.mu.Lock()
		busy := p.busy[name]
		p.mu.Unlock()
		if !busy {
			img, dir := p.paths(name)
			unix.Unmount(dir, unix.MNT_DETACH)
			os.Remove(dir)
			os.Remove(img)
			n++
		}
	}
	return n
}

// held is how many file systems exist (the pool's and sandboxes').
func (p *diskPool) held() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.busy)
}

// usage reports the bytes and inodes a sandbox's file system holds.
func (sd *sandboxDisk) usage() (bytes, inodes int64) {
	var st unix.Statfs_t
	if unix.Statfs(sd.dir, &st) != nil {
		return 0, 0
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, int64(st.Files - st.Ffree)
}
