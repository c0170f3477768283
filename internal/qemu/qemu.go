// Package qemu is the QEMU plumbing the VM substrates share (microvm and
// vm): finding the binary and a guest kernel, probing for KVM with a TCG
// fallback, starting and adopting QEMU processes, the QMP monitor client,
// initramfs archives, memory snapshots through QEMU's migration stream,
// the screen and input (screendump, input-send-event), and VM, the
// lifecycle of one sandbox's VM across its QEMU processes (start or
// restore until the agent answers, pause to a file, resume, machine
// snapshots, adoption by a restarted node, the agent channel). Drivers
// build their own machines' command lines; VM runs them.
package qemu

import (
	"errors"
	"os/exec"
)

// FindBinary returns the path of qemu-system-x86_64 (or of name, if set).
func FindBinary(name string) (string, error) {
	if name == "" {
		name = "qemu-system-x86_64"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", errors.New(name + " not installed (apt-get install qemu-system-x86)")
	}
	return p, nil
}
