package gateway

import (
	"encoding/json"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// usage gathers what an answer says of its tokens, from a whole JSON
// answer or from each event of a stream, in the shapes OpenAI, vLLM,
// SGLang and Anthropic use.
type usage struct {
	prompt, completion int64
	tokenIDs           []int64
	logprobs           []float64
	promptIDs          []int64
}

// answer is the union of the fields read, in both APIs and both forms
// (a chat completion and its chunks, a completion, a message and its
// events).
type answer struct {
	Usage *struct {
		PromptTokens     int64 `json:"prompt_tokens"`
		CompletionTokens int64 `json:"completion_tokens"`
		InputTokens      int64 `json:"input_tokens"`
		OutputTokens     int64 `json:"output_tokens"`
	} `json:"usage"`
	PromptTokenIDs []int64 `json:"prompt_token_ids"`
	Choices        []struct {
		Index          int     `json:"index"`
		TokenIDs       []int64 `json:"token_ids"`
		PromptTokenIDs []int64 `json:"prompt_token_ids"`
		Logprobs       *struct {
			Content []struct {
				Logprob float64 `json:"logprob"`
			} `json:"content"`
			TokenLogprobs []float64 `json:"token_logprobs"`
		} `json:"logprobs"`
	} `json:"choices"`
	// Anthropic's stream: message_start carries the message (and its
	// input tokens), message_delta the output tokens so far.
	Message *answer `json:"message"`
}

// addJSON adds one JSON answer or stream event; what is not JSON, or not
// of these shapes, adds nothing.
func (u *usage) addJSON(b []byte) {
	var a answer
	if json.Unmarshal(b, &a) != nil {
		return
	}
	u.add(&a)
}

func (u *usage) add(a *answer) {
	if a.Message != nil {
		u.add(a.Message)
	}
	if a.Usage != nil {
		if p := a.Usage.PromptTokens + a.Usage.InputTokens; p > 0 {
			u.prompt = p
		}
		if c := a.Usage.CompletionTokens + a.Usage.OutputTokens; c > 0 {
			u.completion = c
		}
	}
	if len(a.PromptTokenIDs) > 0 {
		u.promptIDs = a.PromptTokenIDs
	}
	for _, c := range a.Choices {
		if c.Index != 0 {
			continue // the first choice's tokens only
		}
		u.tokenIDs = append(u.tokenIDs, c.TokenIDs...)
		if len(c.PromptTokenIDs) > 0 {
			u.promptIDs = c.PromptTokenIDs
		}
		if c.Logprobs != nil {
			for _, t := range c.Logprobs.Content {
				u.logprobs = append(u.logprobs, t.Logprob)
			}
			u.logprobs = append(u.logprobs, c.Logprobs.TokenLogprobs...)
		}
	}
}

// into records the tokens in call. A stream without the upstream's usage
// counts its sampled tokens where it returned them.
func (u *usage) into(call *dsecv1.ModelCall) {
	call.PromptTokens, call.CompletionTokens = u.prompt, u.completion
	if call.CompletionTokens == 0 {
		call.CompletionTokens = int64(max(len(u.tokenIDs), len(u.logprobs)))
	}
	if call.PromptTokens == 0 {
		call.PromptTokens = int64(len(u.promptIDs))
	}
	call.TokenIds, call.Logprobs, call.PromptTokenIds = u.tokenIDs, u.logprobs, u.promptIDs
}
