// Command netprobe fetches a URL the way a program in a sandbox would:
// names resolved by Go's own resolver through /etc/hosts and
// /etc/resolv.conf, TLS with the URL's host as SNI (certificates not
// verified: reachability is what the hostile tests check). busybox's wget
// cannot resolve names (a static glibc without NSS modules crashes), so
// the tests copy this into sandboxes instead.
//
//	netprobe URL
//
// prints the status line and the body, and exits 0 on a 2xx answer, 1 on
// any other answer and 2 when there was none.
package main

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: netprobe URL")
		os.Exit(2)
	}
	c := &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
			Proxy:           nil,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	resp, err := c.Get(os.Args[1])
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(2)
	}
	defer resp.Body.Close()
	fmt.Println(resp.Proto, resp.Status)
	io.Copy(os.Stdout, resp.Body)
	if resp.StatusCode/100 != 2 {
		os.Exit(1)
	}
}
