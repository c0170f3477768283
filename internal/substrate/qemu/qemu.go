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
	"fmt"
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

// ControlArgs are the QEMU arguments every dsec VM ends with: the agent
// channel (vhost-vsock with guest CID cid when vsock, else a virtio-serial
// port on agentSock), the monitor on qmpSock, and QEMU's own seccomp
// sandbox. transport is the machine's virtio transport: "device"
// (virtio-mmio, the microvm machine) or "pci".
func ControlArgs(transport string, vsock bool, cid uint32, agentSock, qmpSock string) []string {
	var args []string
	if vsock {
		args = append(args, "-device", fmt.Sprintf("vhost-vsock-%s,guest-cid=%d", transport, cid))
	} else {
		args = append(args,
			"-device", "virtio-serial-"+transport+",max_ports=2",
			"-chardev", "socket,id=agent,path="+agentSock+",server=on,wait=off",
			"-device", "virtserialport,chardev=agent,name=dsec.agent")
	}
	return append(args,
		"-qmp", "unix:"+qmpSock+",server=on,wait=off",
		// QEMU itself may not spawn processes, gain privileges or use
		// obsolete syscalls.
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-msg", "timestamp=on",
	)
}
