package cluster_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// A sandbox port is reached through any API replica: the replica's E2B
// facade dials it over the node API's ConnectPort stream, which the node
// relays to the sandbox's agent.
func TestASandboxPortIsReachedThroughEveryReplica(t *testing.T) {
	c := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, err := create(ctx, c.api(0), dsec.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	res, err := sb.Exec(ctx, dsec.Cmd("mkdir -p /tmp/www && echo served by "+sb.ID+" > /tmp/www/index.html && busybox httpd -p 8080 -h /tmp/www"))
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start httpd: %v %v", res, err)
	}
	get := func(url string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for i, api := range c.apis {
		for range 3 { // pooled connections are reused
			code, body := get(fmt.Sprintf("%s/sandboxes/%s/ports/8080/index.html", api.URL, sb.ID))
			if code != 200 || body != "served by "+sb.ID+"\n" {
				t.Fatalf("port 8080 through replica %d: %d %q", i, code, body)
			}
		}
		code, body := get(fmt.Sprintf("%s/sandboxes/%s/ports/8081/", api.URL, sb.ID))
		if code != http.StatusBadGateway || body == "" {
			t.Fatalf("a closed port through replica %d: %d %q", i, code, body)
		}
	}
}
