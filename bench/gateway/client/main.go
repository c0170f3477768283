// Command client is bench/gateway's load generator: the same program runs
// on the host against the model server (the baseline) and inside a
// sandbox against its model gateway, and prints what it measured as JSON.
//
//	client seq N BASEURL      N chat completions one after another
//	client streams K BASEURL  K streaming chat completions at once
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

type result struct {
	Calls     int     `json:"calls"`
	Failed    int     `json:"failed"`
	Latencies []int64 `json:"latencies_us"`
	FirstErr  string  `json:"first_error,omitempty"`
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: client seq|streams N BASEURL")
		os.Exit(2)
	}
	n, _ := strconv.Atoi(os.Args[2])
	base := os.Args[3]
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 1024}, Timeout: 5 * time.Minute}
	var mu sync.Mutex
	var res result
	one := func(i int, stream bool) {
		body := fmt.Sprintf(`{"model":"policy","stream":%v,"messages":[{"role":"user","content":"call %d"}]}`, stream, i)
		start := time.Now()
		err := call(hc, base, body, stream)
		d := time.Since(start)
		mu.Lock()
		defer mu.Unlock()
		res.Calls++
		if err != nil {
			res.Failed++
			if res.FirstErr == "" {
				res.FirstErr = err.Error()
			}
			return
		}
		res.Latencies = append(res.Latencies, d.Microseconds())
	}
	switch os.Args[1] {
	case "seq":
		one(-1, false) // warm the connection
		res = result{}
		for i := 0; i < n; i++ {
			one(i, false)
		}
	case "streams":
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() { defer wg.Done(); one(i, true) }()
		}
		wg.Wait()
	}
	json.NewEncoder(os.Stdout).Encode(res)
}

func call(hc *http.Client, base, body string, stream bool) error {
	req, _ := http.NewRequest(http.MethodPost, base+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+os.Getenv("OPENAI_API_KEY"))
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	done := !stream
	for sc.Scan() {
		if stream && sc.Text() == "data: [DONE]" {
			done = true
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if !done {
		return fmt.Errorf("stream ended without [DONE]")
	}
	return nil
}
