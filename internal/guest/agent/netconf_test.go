package agent

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/nsthread"
)

// TestConfigureNetworkGivesTheInterfaceItsOwnIdentity configures a NIC
// twice, as a microVM's agent does at boot and a fork child's
// (`identity -net`) after its restore: the second configuration replaces
// the first — MAC, MTU, address, default route, resolvers — and leaves
// nothing of it; the interface is eth0 whatever the guest named it.
func TestConfigureNetworkGivesTheInterfaceItsOwnIdentity(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a network namespace)")
	}
	ns := fmt.Sprintf("dsecagentnet%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v %s", err, out)
	}
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", ns).Run()
		exec.Command("ip", "link", "del", fmt.Sprintf("dsecag%d", os.Getpid()%1000000)).Run()
	})
	// A veth whose other end is the host's (this kernel has no dummy
	// interfaces; it goes with the namespace), named as a full VM's udev
	// names its NIC.
	peer := fmt.Sprintf("dsecag%d", os.Getpid()%1000000)
	if out, err := exec.Command("ip", "link", "add", peer, "type", "veth", "peer", "name", "enp0s3", "netns", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip link add: %v %s", err, out)
	}
	old := resolvConf
	resolvConf = filepath.Join(t.TempDir(), "resolv.conf")
	defer func() { resolvConf = old }()

	parent, err := guest.ParseNetConfig("10.88.1.2/16,10.88.0.1,02:64:0a:58:01:02,1500,192.0.2.53")
	if err != nil {
		t.Fatal(err)
	}
	child, err := guest.ParseNetConfig("10.88.1.9/16,10.88.0.1,02:64:0a:58:01:09,1400,192.0.2.54,192.0.2.55")
	if err != nil {
		t.Fatal(err)
	}
	if child.String() != "10.88.1.9/16,10.88.0.1,02:64:0a:58:01:09,1400,192.0.2.54,192.0.2.55" {
		t.Fatalf("String does not round-trip: %s", child)
	}
	for _, c := range []guest.NetConfig{parent, child} {
		if err := nsthread.NetNS("/run/netns/"+ns, func() error { return ConfigureNetwork(c, time.Second) }); err != nil {
			t.Fatalf("configure %s: %v", c, err)
		}
	}
	ip := func(args ...string) string {
		out, err := exec.Command("ip", append([]string{"-n", ns}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %v: %v %s", args, err, out)
		}
		return string(out)
	}
	link := ip("-o", "link", "show", "eth0")
	if !strings.Contains(link, "link/ether 02:64:0a:58:01:09") || !strings.Contains(link, "mtu 1400") || !strings.Contains(link, ",UP") {
		t.Errorf("the link: %s", link)
	}
	if addrs := ip("-4", "-o", "addr", "show", "eth0"); !strings.Contains(addrs, "10.88.1.9/16") || strings.Contains(addrs, "10.88.1.2") {
		t.Errorf("the addresses: %s", addrs)
	}
	if r := ip("route", "show", "default"); !strings.Contains(r, "default via 10.88.0.1 dev eth0") {
		t.Errorf("the default route: %q", r)
	}
	if b, _ := os.ReadFile(resolvConf); string(b) != "nameserver 192.0.2.54\nnameserver 192.0.2.55\n" {
		t.Errorf("resolv.conf: %q", b)
	}
	if _, err := guest.ParseNetConfig("10.88.1.9/16,10.88.0.1,not-a-mac,1500"); err == nil {
		t.Error("a bad MAC was accepted")
	}
	if _, err := guest.ParseNetConfig("fd00::2/64,10.88.0.1,02:64:0a:58:01:09,1500"); err == nil {
		t.Error("an IPv6 address was accepted")
	}
}
