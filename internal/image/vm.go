package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// A VM image (kind vm) is a bootable disk rather than file system layers.
// Its record has one layer, whose directory holds the disk and what the vm
// driver needs to boot it:
//
//	layers/<hex digest>/disk.qcow2   the disk (qcow2, no backing file); the
//	                                 shared read-only base of every VM's
//	                                 copy-on-write disk
//	layers/<hex digest>/vmlinuz      the image's own kernel and initramfs,
//	layers/<hex digest>/initrd.img   for direct boot (optional)
//	layers/<hex digest>/vm.json      VMImage
//
// The layer directory is content-addressed and collected like any layer,
// so sandboxes and snapshots of a deleted VM image keep their base disk.
const (
	VMDiskFile   = "disk.qcow2"
	VMKernelFile = "vmlinuz"
	VMInitrdFile = "initrd.img"
	VMMetaFile   = "vm.json"
)

// VMImage describes a VM image's disk and how it boots.
type VMImage struct {
	// VirtualSize is the disk's size as the guest sees it, in bytes.
	VirtualSize int64 `json:"virtual_size"`
	// Firmware is how the disk boots through firmware: "bios" (SeaBIOS
	// runs the bootloader in the disk's MBR, e.g. GRUB).
	Firmware string `json:"firmware"`
	// DirectBoot is set when the layer holds the image's own kernel and
	// initramfs, which the driver can boot without the firmware and
	// bootloader (faster); Cmdline is their kernel command line (root
	// device and options).
	DirectBoot bool   `json:"direct_boot,omitempty"`
	Cmdline    string `json:"cmdline,omitempty"`
	// Agent says how the image runs dsec-guest: "node" (its service runs
	// the agent the node attaches to every VM: images built by BuildVM)
	// or "installed" (its own copy: imported images).
	Agent string `json:"agent"`
}

// ReadVMLayer reads the VMImage of a VM image's layer directory.
func ReadVMLayer(dir string) (*VMImage, error) {
	b, err := os.ReadFile(filepath.Join(dir, VMMetaFile))
	if err != nil {
		return nil, errdefs.Invalid("not a VM image (no %s in its layer): build one with `dsec image build-vm` or import a disk with `dsec image import-vm`", VMMetaFile)
	}
	var m VMImage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, errdefs.Internal(err, "decode VM image metadata")
	}
	return &m, nil
}

// addVMLayer stores the files of a VM image prepared in dir (VMDiskFile
// and, with meta.DirectBoot, VMKernelFile and VMInitrdFile) as a layer and
// records the image. Files are hard-linked when dir is on the store's file
// system (a build cache), else copied. digest identifies the files
// ("sha256:<hex>").
func (s *Store) addVMLayer(owner, name, source, dir, digest string, meta *VMImage) (*Image, error) {
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "vm-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	files := []string{VMDiskFile}
	if meta.DirectBoot {
		files = append(files, VMKernelFile, VMInitrdFile)
	}
	for _, f := range files {
		if err := linkOrCopy(filepath.Join(dir, f), filepath.Join(tmp, f)); err != nil {
			return nil, fmt.Errorf("store VM image file %s: %w", f, err)
		}
	}
	mb, _ := json.MarshalIndent(meta, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, VMMetaFile), mb, 0o644); err != nil {
		return nil, err
	}
	release, err := s.commitDir(digest, tmp)
	if err != nil {
		return nil, err
	}
	defer release() // until the record names it
	size, _ := s.haveLayer(digest)
	img := &Image{
		Name: normalize(name), Owner: owner, Digest: digest, Layers: []string{digest}, Size: size,
		Created: time.Now().UTC(), Source: source, VM: meta,
		Config: Config{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}},
	}
	if err := s.put(img); err != nil {
		return nil, err
	}
	return img, nil
}

// linkOrCopy hard-links src to dst, or copies it (keeping holes) across
// file systems.
func linkOrCopy(src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	out, err := exec.Command("cp", "--sparse=always", "--reflink=auto", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// maxVMImportBytes bounds an uploaded disk image.
const maxVMImportBytes = 256 << 30

// qemuImgInfo is the part of `qemu-img info --output=json` an import
// checks.
type qemuImgInfo struct {
	Format          string `json:"format"`
	VirtualSize     int64  `json:"virtual-size"`
	BackingFilename string `json:"backing-filename"`
	FormatSpecific  struct {
		Data struct {
			DataFile string `json:"data-file"`
		} `json:"data"`
	} `json:"format-specific"`
}

// ImportVM imports a bootable disk image (qcow2 or raw) read from r as
// the VM image name. The disk boots through its own bootloader (BIOS) and
// must run dsec-guest as a service (docs/substrates/vm.md says how to
// prepare one). A disk that names a backing or external data file is
// refused: it would make QEMU read host files. The disk is stored as a
// standalone qcow2.
func (s *Store) ImportVM(ctx context.Context, r io.Reader, name string, progress Progress) (*Image, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	if err := s.admit(); err != nil {
		return nil, err
	}
	defer s.fit()
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		return nil, errdefs.Unavailable("qemu-img is not installed on the node (apt-get install qemu-utils)")
	}
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "vm-import-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	upload := filepath.Join(tmp, "upload")
	f, err := os.OpenFile(upload, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	n, err := io.Copy(f, &countingReader{r: io.LimitReader(r, maxVMImportBytes+1), report: func(n int64) { progress.report("upload", "", n, 0) }})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, errdefs.Classify(ctx.Err())
		}
		return nil, errdefs.Invalid("read the disk image: %v", err)
	}
	if n > maxVMImportBytes {
		return nil, errdefs.Invalid("disk image larger than %d GiB", maxVMImportBytes>>30)
	}
	if n == 0 {
		return nil, errdefs.Invalid("empty disk image")
	}
	info, err := diskInfo(ctx, qemuImg, upload)
	if err != nil {
		return nil, err
	}
	progress.report("convert", "checking and converting to qcow2", 0, 0)
	disk := filepath.Join(tmp, VMDiskFile)
	cmd := exec.CommandContext(ctx, qemuImg, "convert", "-q", "-f", info.Format, "-O", "qcow2", upload, disk)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, errdefs.Invalid("convert the disk image: %s", strings.ReplaceAll(string(bytes.TrimSpace(out)), tmp, "…"))
	}
	os.Remove(upload)
	meta := &VMImage{VirtualSize: info.VirtualSize, Firmware: "bios", Agent: "installed"}
	digest, err := vmDigest(tmp, meta)
	if err != nil {
		return nil, err
	}
	img, err := s.addVMLayer(tenant.ImageOwner(ctx), name, "import-vm", tmp, digest, meta)
	if err != nil {
		return nil, err
	}
	progress.report("done", img.Name, n, n)
	return img, nil
}

// diskInfo checks an uploaded disk image with qemu-img: qcow2 or raw, no
// backing file, no external data file.
func diskInfo(ctx context.Context, qemuImg, path string) (*qemuImgInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, qemuImg, "info", "--output=json", path).Output()
	if err != nil {
		return nil, errdefs.Invalid("not a disk image qemu-img can read")
	}
	var info qemuImgInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return nil, errdefs.Invalid("not a disk image qemu-img can read")
	}
	switch {
	case info.Format != "qcow2" && info.Format != "raw":
		return nil, errdefs.Invalid("disk image format %q: import qcow2 or raw", info.Format)
	case info.BackingFilename != "":
		return nil, errdefs.Invalid("the disk image has a backing file; flatten it first (qemu-img convert -O qcow2 IN OUT)")
	case info.FormatSpecific.Data.DataFile != "":
		return nil, errdefs.Invalid("the disk image has an external data file; flatten it first (qemu-img convert -O qcow2 IN OUT)")
	case info.VirtualSize < 1<<20:
		return nil, errdefs.Invalid("the disk image is too small to boot (%d bytes)", info.VirtualSize)
	}
	return &info, nil
}

// vmDigest identifies a VM image's layer: its metadata and the content of
// its files in dir.
func vmDigest(dir string, meta *VMImage) (string, error) {
	h := sha256.New()
	mb, _ := json.Marshal(meta)
	h.Write(mb)
	files := []string{VMDiskFile}
	if meta.DirectBoot {
		files = append(files, VMKernelFile, VMInitrdFile)
	}
	for _, name := range files {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "\n%s\n", name)
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", err
		}
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}
