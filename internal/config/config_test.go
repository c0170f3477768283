package config

import (
	"os"
	"path/filepath"
	"testing"
)

func TestLoadE2BSection(t *testing.T) {
	p := filepath.Join(t.TempDir(), "dsec.yaml")
	os.WriteFile(p, []byte(`
api_keys: [e2b_0123abcd]
e2b:
  domain: sandbox.example.com
  default_network: egress
  templates:
    base: {image: debian}
    swe: {image: swe-env, kind: microvm, cpu: 2, memory_mb: 4096}
`), 0o600)
	c, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	swe := c.E2B.Templates["swe"]
	if c.E2B.Domain != "sandbox.example.com" || c.E2B.DefaultNetwork != "egress" || c.E2B.Templates["base"].Image != "debian" ||
		swe.Image != "swe-env" || swe.Kind != "microvm" || swe.CPU != 2 || swe.MemoryMB != 4096 {
		t.Fatalf("loaded %+v", c.E2B)
	}
	os.WriteFile(p, []byte("e2b: {templates: {base: {image: debian, gpu: 1}}}\n"), 0o600)
	if _, err := Load(p); err == nil {
		t.Fatal("an unknown template field was accepted")
	}
}
