package hostile

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// unknownVolume is a well-formed volume ID on the same node that no
// volume has.
func unknownVolume(id string) string { return "vol-aaaaaaaaaaaaaaaa" + id[len("vol-")+16:] }

// Project B holds project A's volume's name and ID (names leak, IDs are
// logged): it must not list, read, write, mount, delete or reach the
// volume's content through the E2B facade, and every answer must be the one
// for a volume that does not exist.
func TestAnotherProjectsKeyReachesNoVolume(t *testing.T) {
	a, b := client(t), clientFor(t, keyB)
	ctx := ctxFor(t, 5*time.Minute)
	vol, err := a.CreateVolume(ctx, "victim-data", dsec.VolumeOptions{SizeMB: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.DeleteVolume(context.Background(), vol.Id) })
	if _, err := a.WriteVolumeFile(ctx, vol.Id, "/secret.txt", strings.NewReader("the answer is 42"), false); err != nil {
		t.Fatal(err)
	}
	nb := newNeighbour(t)
	ghost := unknownVolume(vol.Id)
	// sameVolumeAnswer checks that a call naming A's volume (by ID, then by
	// name) fails as the call naming a volume that does not exist.
	sameVolumeAnswer := func(t *testing.T, what string, call func(ref string) error) {
		t.Helper()
		for _, refs := range [][2]string{{vol.Id, ghost}, {vol.Name, "no-such-volume"}} {
			errVictim, errGhost := call(refs[0]), call(refs[1])
			if errVictim == nil {
				t.Errorf("%s on another project's volume (%s) succeeded", what, refs[0])
				continue
			}
			if kindOf(errVictim) != "not_found" {
				t.Errorf("%s on another project's volume (%s): %v, want not_found", what, refs[0], errVictim)
			}
			x, y := strings.ReplaceAll(errVictim.Error(), refs[0], "REF"), strings.ReplaceAll(fmt.Sprint(errGhost), refs[1], "REF")
			if x != y {
				t.Errorf("%s: another project's volume answers %q, an unknown one %q: an existence oracle", what, x, y)
			}
		}
	}
	t.Run("listing shows none of A's volumes", func(t *testing.T) {
		list, err := b.ListVolumes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range list {
			if v.Id == vol.Id {
				t.Fatalf("project B lists project A's volume %s", vol.Id)
			}
		}
	})
	t.Run("every volume call answers as for an unknown volume", func(t *testing.T) {
		sameVolumeAnswer(t, "get", func(ref string) error { _, err := b.GetVolume(ctx, ref); return err })
		sameVolumeAnswer(t, "read file", func(ref string) error {
			var got bytes.Buffer
			_, err := b.ReadVolumeFile(ctx, ref, "/secret.txt", &got)
			if strings.Contains(got.String(), "the answer is 42") {
				t.Errorf("the volume's file leaked: %q", got.String())
			}
			return err
		})
		sameVolumeAnswer(t, "write file", func(ref string) error {
			_, err := b.WriteVolumeFile(ctx, ref, "/planted", strings.NewReader("x"), true)
			return err
		})
		sameVolumeAnswer(t, "list dir", func(ref string) error { _, err := b.ListVolumeDir(ctx, ref, "/", 1); return err })
		sameVolumeAnswer(t, "stat", func(ref string) error { _, err := b.StatVolumePath(ctx, ref, "/secret.txt"); return err })
		sameVolumeAnswer(t, "make dir", func(ref string) error { _, err := b.MakeVolumeDir(ctx, ref, "/planted-dir", true); return err })
		sameVolumeAnswer(t, "remove", func(ref string) error { return b.RemoveVolumePath(ctx, ref, "/secret.txt") })
	})
	t.Run("a sandbox of B cannot mount it, read-only or read-write", func(t *testing.T) {
		for _, ro := range []bool{true, false} {
			sameVolumeAnswer(t, fmt.Sprintf("mount (read-only %v)", ro), func(ref string) error {
				sb, err := b.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: time.Minute, Volumes: []dsec.VolumeMount{{Name: ref, Path: "/stolen", ReadOnly: ro}}})
				if err == nil {
					out, _ := sb.Exec(ctx, dsec.Cmd("cat /stolen/secret.txt"))
					t.Errorf("B's sandbox mounted A's volume and reads %q", out.GetStdout())
					sb.Close()
				}
				return err
			})
		}
	})
	t.Run("B's volume of the same name is its own", func(t *testing.T) {
		mine, err := b.CreateVolume(ctx, "victim-data", dsec.VolumeOptions{SizeMB: 16})
		if err != nil {
			t.Fatal(err)
		}
		defer b.DeleteVolume(context.Background(), mine.Id)
		if mine.Id == vol.Id {
			t.Fatal("B's create returned A's volume")
		}
		list, err := b.ListVolumeDir(ctx, "victim-data", "/", 1)
		if err != nil || len(list) != 0 {
			t.Fatalf("B's volume of the same name lists %v (%v)", list, err)
		}
	})
	t.Run("the E2B facade answers as for an unknown volume", func(t *testing.T) {
		e2b := func(method, path, key, token string) (int, string) {
			req, _ := http.NewRequestWithContext(ctx, method, srv(t).URL+path, nil)
			if key != "" {
				req.Header.Set("X-API-Key", key)
			}
			if token != "" {
				req.Header.Set("Authorization", "Bearer "+token)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(body)
		}
		for _, m := range []string{"GET", "DELETE"} {
			code, body := e2b(m, "/volumes/"+vol.Id, secret(keyB), "")
			ghostCode, ghostBody := e2b(m, "/volumes/"+ghost, secret(keyB), "")
			body, ghostBody = strings.ReplaceAll(body, vol.Id, "ID"), strings.ReplaceAll(ghostBody, ghost, "ID")
			if code != http.StatusNotFound || code != ghostCode || body != ghostBody {
				t.Errorf("%s /volumes/{A's}: %d %s; an unknown one: %d %s", m, code, body, ghostCode, ghostBody)
			}
			if strings.Contains(body, "token") {
				t.Errorf("%s /volumes/{A's} leaked a token: %s", m, body)
			}
		}
		code, body := e2b("GET", "/volumes", secret(keyB), "")
		if code != 200 || strings.Contains(body, vol.Id) {
			t.Errorf("GET /volumes with B's key: %d %s", code, body)
		}
		// The content API takes the volume's token only: B's API key, or
		// the token of B's own volume, are not it.
		mine, err := b.CreateVolume(ctx, "b-own", dsec.VolumeOptions{SizeMB: 16})
		if err != nil {
			t.Fatal(err)
		}
		defer b.DeleteVolume(context.Background(), mine.Id)
		_, own := e2b("GET", "/volumes/"+mine.Id, secret(keyB), "")
		var vt struct{ Token string }
		json.Unmarshal([]byte(own), &vt)
		if vt.Token == "" {
			t.Fatalf("B's own volume has no token: %s", own)
		}
		for _, tok := range []string{secret(keyB), vt.Token, ""} {
			code, body := e2b("GET", "/volumecontent/"+vol.Id+"/file?path=/secret.txt", "", tok)
			if code != http.StatusUnauthorized || strings.Contains(body, "the answer is 42") {
				t.Errorf("the content of A's volume with the token %q: %d %s", tok, code, body)
			}
		}
	})
	t.Run("a delete answers as for an unknown volume", func(t *testing.T) {
		sameVolumeAnswer(t, "delete", func(ref string) error { return b.DeleteVolume(ctx, ref) })
	})
	nb.check(t)
	t.Run("A's volume and its content are intact", func(t *testing.T) {
		var got bytes.Buffer
		if _, err := a.ReadVolumeFile(ctx, vol.Id, "/secret.txt", &got); err != nil || got.String() != "the answer is 42" {
			t.Fatalf("A reads %q (%v)", got.String(), err)
		}
		list, err := a.ListVolumeDir(ctx, vol.Id, "/", 1)
		if err != nil || len(list) != 1 {
			t.Fatalf("A's volume lists %v (%v): B planted something", list, err)
		}
	})
}

// A sandbox writes its volume, and the node reads and writes the same
// volume as root for the content API: links, FIFOs and ".." the sandbox
// plants must not take a trainer's content calls anywhere outside the
// volume (read a host file, write or chmod one, delete through a link) nor
// stall the node.
func TestLinksASandboxPlantsInAVolumeStayInsideIt(t *testing.T) {
	c := client(t)
	ctx := ctxFor(t, 5*time.Minute)
	host := t.TempDir() // a host directory the test owns, standing for /etc
	os.Chmod(host, 0o755)
	secretFile := filepath.Join(host, "shadow")
	if err := os.WriteFile(secretFile, []byte("root:host-secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	vol, err := c.CreateVolume(ctx, "planted", dsec.VolumeOptions{SizeMB: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.DeleteVolume(context.Background(), vol.Id) })
	nb := newNeighbour(t)
	attacker := create(t, c, dsec.CreateOptions{Volumes: []dsec.VolumeMount{{Name: vol.Id, Path: "/vol"}}})
	depth := strings.Repeat("../", 12)
	plant := fmt.Sprintf("ln -s %[1]s /vol/hostdir && ln -s %[2]s /vol/shadow && ln -s %[3]s%[1]s /vol/up && mkfifo /vol/fifo && mkdir /vol/d && ln -s %[1]s /vol/d/link && echo planted",
		host, secretFile, depth[:len(depth)-1])
	if r, err := attacker.Exec(ctx, dsec.Cmd(plant)); err != nil || string(r.Stdout) != "planted\n" {
		t.Fatalf("plant: %v %s %s", err, r.GetStdout(), r.GetStderr())
	}
	untouched := func(t *testing.T) {
		t.Helper()
		b, err := os.ReadFile(secretFile)
		st, _ := os.Stat(secretFile)
		if err != nil || string(b) != "root:host-secret" || st.Mode().Perm() != 0o600 {
			t.Fatalf("the host file changed: %q %v %v", b, st.Mode(), err)
		}
		ents, _ := os.ReadDir(host)
		if len(ents) != 1 {
			t.Fatalf("the host directory holds %d entries: something was written there", len(ents))
		}
	}
	t.Run("reads through the links do not reach the host", func(t *testing.T) {
		for _, p := range []string{"/shadow", "/hostdir/shadow", "/up/shadow", "/d/link/shadow", depth + strings.TrimPrefix(secretFile, "/")} {
			var got bytes.Buffer
			c.ReadVolumeFile(ctx, vol.Id, p, &got)
			if strings.Contains(got.String(), "host-secret") {
				t.Errorf("read %s returned the host's file", p)
			}
			if in, err := c.StatVolumePath(ctx, vol.Id, p); err == nil && in.Size == int64(len("root:host-secret")) && in.Type == "file" {
				t.Errorf("stat %s describes the host's file", p)
			}
		}
		list, _ := c.ListVolumeDir(ctx, vol.Id, "/hostdir", 1)
		for _, e := range list {
			if e.Name == "shadow" {
				t.Errorf("listing /hostdir lists the host's directory")
			}
		}
		untouched(t)
	})
	t.Run("writes, directories and modes through the links do not reach the host", func(t *testing.T) {
		c.WriteVolumeFile(ctx, vol.Id, "/hostdir/planted", strings.NewReader("x"), true)
		c.WriteVolumeFile(ctx, vol.Id, "/up/planted", strings.NewReader("x"), true)
		c.WriteVolumeFile(ctx, vol.Id, "/shadow", strings.NewReader("overwritten"), true) // replaces the link itself
		c.MakeVolumeDir(ctx, vol.Id, "/d/link/newdir", true)
		c.MakeVolumeDir(ctx, vol.Id, "/hostdir/newdir", false)
		for _, p := range []string{"/d/link/shadow", "/up/shadow"} {
			mode := uint32(0o777)
			c.Raw().Volumes.SetVolumePathAttrs(ctx, connect.NewRequest(&dsecv1.SetVolumePathAttrsRequest{Volume: vol.Id, Path: p, Mode: &mode}))
		}
		untouched(t)
	})
	t.Run("a remove through a link removes the link, not the host's files", func(t *testing.T) {
		for _, p := range []string{"/d", "/hostdir", "/up"} {
			if err := c.RemoveVolumePath(ctx, vol.Id, p); err != nil {
				t.Errorf("remove %s: %v", p, err)
			}
		}
		untouched(t)
	})
	t.Run("a FIFO answers at once instead of stalling the node", func(t *testing.T) {
		fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		start := time.Now()
		_, err := c.ReadVolumeFile(fctx, vol.Id, "/fifo", io.Discard)
		if err == nil || kindOf(err) != "invalid" {
			t.Errorf("reading a FIFO: %v after %v, want invalid at once", err, time.Since(start))
		}
	})
	nb.check(t)
}
