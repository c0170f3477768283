package cluster_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// A volume lives on one node: sandboxes that mount it are placed there,
// whichever replica creates them, and a sandbox cannot mount volumes of
// two nodes.
func TestVolumesPinSandboxesToTheirNode(t *testing.T) {
	c := startCluster(t)
	ctx := context.Background()
	v2, err := c.api(0).CreateVolume(ctx, "on-n2", dsec.VolumeOptions{SizeMB: 16, Node: "n2"})
	if err != nil {
		t.Fatal(err)
	}
	if v2.Node != "n2" || !strings.HasSuffix(v2.Id, "-n2") {
		t.Fatalf("volume asked on n2: %v", v2)
	}
	t.Run("sandboxes that mount it run on its node, through any replica", func(t *testing.T) {
		owner, err := create(ctx, c.api(1), dsec.CreateOptions{Volumes: []dsec.VolumeMount{{Name: "on-n2", Path: "/v"}}})
		if err != nil {
			t.Fatal(err)
		}
		defer owner.Close()
		if _, err := owner.Exec(ctx, dsec.Cmd("echo from-n2 > /v/f")); err != nil {
			t.Fatal(err)
		}
		for i := range 4 {
			sb, err := create(ctx, c.api(i%2), dsec.CreateOptions{Volumes: []dsec.VolumeMount{{Name: "on-n2", Path: "/v", ReadOnly: true}}})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			if nodeOf(sb.ID) != "n2" {
				t.Fatalf("a sandbox mounting a volume of n2 runs on %s", nodeOf(sb.ID))
			}
			if r, err := sb.Exec(ctx, dsec.Cmd("cat /v/f")); err != nil || string(r.Stdout) != "from-n2\n" {
				t.Fatalf("reader: %v %v", r, err)
			}
		}
		var b bytes.Buffer
		if _, err := c.api(0).ReadVolumeFile(ctx, v2.Id, "/f", &b); err != nil || b.String() != "from-n2\n" {
			t.Fatalf("the content API through the other replica: %q %v", b.String(), err)
		}
		if err := c.api(1).DeleteVolume(ctx, "on-n2"); errOf(err).Kind != "conflict" {
			t.Fatalf("delete of a mounted volume through a replica: %v", err)
		}
	})
	t.Run("a sandbox cannot mount volumes of two nodes", func(t *testing.T) {
		if _, err := c.api(0).CreateVolume(ctx, "on-n3", dsec.VolumeOptions{SizeMB: 16, Node: "n3"}); err != nil {
			t.Fatal(err)
		}
		_, err := create(ctx, c.api(1), dsec.CreateOptions{Volumes: []dsec.VolumeMount{{Name: "on-n2", Path: "/a", ReadOnly: true}, {Name: "on-n3", Path: "/b", ReadOnly: true}}})
		if e := errOf(err); e.Kind != "invalid" || !strings.Contains(e.Message, "different nodes") {
			t.Fatalf("volumes of two nodes: %v", err)
		}
		if _, err := create(ctx, c.api(0), dsec.CreateOptions{Volumes: []dsec.VolumeMount{{Name: "nowhere", Path: "/a"}}}); errOf(err).Kind != "not_found" {
			t.Fatalf("an unknown volume: %v", err)
		}
	})
	t.Run("a name is the project's across nodes, and every replica lists them", func(t *testing.T) {
		if _, err := c.api(1).CreateVolume(ctx, "on-n2", dsec.VolumeOptions{SizeMB: 16, Node: "n1"}); errOf(err).Kind != "conflict" {
			t.Fatalf("a second volume of one name on another node: %v", err)
		}
		for i := range 2 {
			list, err := c.api(i).ListVolumes(ctx)
			if err != nil || len(list) != 2 {
				t.Fatalf("replica %d lists %v (%v)", i, list, err)
			}
		}
	})
	for _, n := range []string{"on-n2", "on-n3"} {
		if err := c.api(0).DeleteVolume(ctx, n); err != nil {
			t.Fatalf("delete %s: %v", n, err)
		}
	}
}
