package dsec

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
)

func (c *Client) functions() dsecv1connect.FunctionServiceClient { return c.raw.Function }

// RunCode runs a program as a function call (see dsecv1.RunCodeRequest).
func (c *Client) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error) {
	r, err := c.functions().RunCode(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// RunCodeBatch runs many calls; results are in order.
func (c *Client) RunCodeBatch(ctx context.Context, reqs []*dsecv1.RunCodeRequest) ([]*dsecv1.RunCodeResult, error) {
	r, err := c.functions().RunCodeBatch(ctx, connect.NewRequest(&dsecv1.RunCodeBatchRequest{Calls: reqs}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Results, nil
}

// Languages lists the function languages of an image.
func (c *Client) Languages(ctx context.Context, image string) ([]*dsecv1.LanguageInfo, error) {
	r, err := c.functions().ListLanguages(ctx, connect.NewRequest(&dsecv1.ListLanguagesRequest{Image: image}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Languages, nil
}

// Checker returns a built-in special judge for RunCodeRequest.Checker:
// "lines", "exact", "tokens", "float" (numbers within tolerance, relative
// or absolute), "unordered_lines" or "case_insensitive".
func Checker(builtin string, tolerance float64) *dsecv1.Checker {
	return &dsecv1.Checker{Builtin: builtin, FloatTolerance: tolerance}
}

// CheckerProgram returns a special judge that is a program in language:
// it runs per test case as `checker input expected actual` (three files in
// its directory) and accepts with exit 0; 1 or 2 is a wrong answer and
// anything else a judge_error (mask it, as a sandbox_error).
func CheckerProgram(language, code string) *dsecv1.Checker {
	return &dsecv1.Checker{Language: language, Code: code}
}
