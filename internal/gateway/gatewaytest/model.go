// Package gatewaytest is a model server for tests of the model gateway:
// deterministic, OpenAI- and Anthropic-speaking, standing in for vLLM.
package gatewaytest

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Model is a deterministic OpenAI- and Anthropic-speaking model server,
// standing in for vLLM: its answer to a request is a function of the
// request, with token IDs and log probabilities as vLLM returns them.
// Its behaviour can be made hostile (rate limits, garbage, hangs, cut
// streams) per test.
type Model struct {
	URL   string
	Calls atomic.Int64

	// The fields below are read and changed under Set.
	mu        sync.Mutex
	Auth      []string // Authorization or x-api-key of each call
	RateLimit int      // answer 429 to this many calls first
	Mode      string   // "", "garbage", "hang", "truncate", "stall"
	Hold      chan struct{}
	Active    int // calls in the handler now
	Peak      int // the most at once
	// Chunks is how many chunks a stream sends (default: one per word of
	// the answer); ChunkDelay the pause before each.
	Chunks     int
	ChunkDelay time.Duration

	arrived chan struct{} // closed (and dropped) when a call arrives
}

// WaitCalls waits until the model has received n calls, for at most
// within, and reports whether it has.
func (m *Model) WaitCalls(n int64, within time.Duration) bool {
	t := time.NewTimer(within)
	defer t.Stop()
	for {
		m.mu.Lock()
		if m.arrived == nil {
			m.arrived = make(chan struct{})
		}
		ch := m.arrived
		m.mu.Unlock()
		if m.Calls.Load() >= n {
			return true
		}
		select {
		case <-ch:
		case <-t.C:
			return m.Calls.Load() >= n
		}
	}
}

// NewModel starts a model server on the host's loopback until t ends.
// Its base URL (with /v1) is URL.
func NewModel(t interface {
	Fatal(args ...any)
	Cleanup(func())
}) *Model {
	m := &Model{}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: m}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	m.URL = "http://" + l.Addr().String() + "/v1"
	return m
}

// ServeHTTP answers /v1/chat/completions (streaming or not),
// /v1/completions and /v1/messages: "echo: " and the prompt.
func (m *Model) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m.Calls.Add(1)
	m.mu.Lock()
	if m.arrived != nil {
		close(m.arrived)
		m.arrived = nil
	}
	m.Auth = append(m.Auth, r.Header.Get("Authorization")+r.Header.Get("x-api-key"))
	limited := m.RateLimit > 0
	if limited {
		m.RateLimit--
	}
	mode, hold, chunks, delay := m.Mode, m.Hold, m.Chunks, m.ChunkDelay
	m.Active++
	m.Peak = max(m.Peak, m.Active)
	m.mu.Unlock()
	defer m.Set(func(m *Model) { m.Active-- })
	if hold != nil {
		<-hold
	}
	if limited {
		w.Header().Set("Retry-After", "0")
		http.Error(w, `{"error":{"message":"slow down"}}`, http.StatusTooManyRequests)
		return
	}
	var req struct {
		Model    string `json:"model"`
		Stream   bool   `json:"stream"`
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
		Prompt string `json:"prompt"`
	}
	body, _ := io.ReadAll(r.Body)
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, `{"error":{"message":"bad json"}}`, http.StatusBadRequest)
		return
	}
	prompt := req.Prompt
	for _, msg := range req.Messages {
		prompt += msg.Content
	}
	words := []string{"echo:", prompt}
	switch mode {
	case "garbage":
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, "<html>proxy error</html>")
		return
	case "hang":
		<-r.Context().Done()
		return
	}
	if r.URL.Path == "/v1/messages" {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{
			"type": "message", "role": "assistant", "model": req.Model,
			"content": []any{map[string]any{"type": "text", "text": strings.Join(words, " ")}},
			"usage":   map[string]any{"input_tokens": len(prompt), "output_tokens": 2},
		})
		return
	}
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{
			"id": "c1", "object": "chat.completion", "model": req.Model,
			"prompt_token_ids": []int{1, 2, 3},
			"choices": []any{map[string]any{
				"index": 0, "message": map[string]any{"role": "assistant", "content": strings.Join(words, " ")},
				"token_ids": []int{7, 8},
				"logprobs":  map[string]any{"content": []any{map[string]any{"token": "echo:", "logprob": -0.5}, map[string]any{"token": prompt, "logprob": -1.5}}},
			}},
			"usage": map[string]any{"prompt_tokens": 3, "completion_tokens": 2},
		})
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	if chunks > 0 {
		words = words[:0]
		for i := 0; i < chunks; i++ {
			words = append(words, fmt.Sprintf("w%d", i))
		}
	}
	for i, word := range words {
		if delay > 0 {
			time.Sleep(delay)
		}
		fmt.Fprintf(w, "data: %s\n\n", mustJSON(map[string]any{
			"object": "chat.completion.chunk",
			"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": word}, "token_ids": []int{10 + i},
				"logprobs": map[string]any{"content": []any{map[string]any{"token": word, "logprob": -0.25}}}}},
		}))
		fl.Flush()
		switch mode {
		case "truncate":
			panic(http.ErrAbortHandler) // cut the connection mid-stream
		case "stall":
			<-r.Context().Done()
			return
		}
	}
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", mustJSON(map[string]any{"object": "chat.completion.chunk", "choices": []any{}, "usage": map[string]any{"prompt_tokens": 3, "completion_tokens": 2}}))
}

// Set changes m's behaviour (or reads its record) under its lock.
func (m *Model) Set(f func(m *Model)) {
	m.mu.Lock()
	f(m)
	m.mu.Unlock()
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
