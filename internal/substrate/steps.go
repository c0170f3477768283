package substrate

import (
	"context"
	"time"
)

// A driver's start is several steps (for a container: the writable layer,
// the mounts, the cgroups, the runtime to the agent's first answer); the
// node learns how long each took through a recorder in the start's
// context, so where a create's time goes inside a substrate is measured on
// every create, not guessed (docs/performance.md).

type stepsKey struct{}

// StepRecorder is told that step took took.
type StepRecorder func(step string, took time.Duration)

// WithSteps returns ctx carrying record, for the drivers' Step calls.
func WithSteps(ctx context.Context, record StepRecorder) context.Context {
	return context.WithValue(ctx, stepsKey{}, record)
}

// Step tells ctx's recorder (if any) that step ran from since until now,
// and returns now: the next step's start.
//
//	t := time.Now()
//	... mount ...
//	t = substrate.Step(ctx, "mount", t)
func Step(ctx context.Context, step string, since time.Time) time.Time {
	now := time.Now()
	if record, ok := ctx.Value(stepsKey{}).(StepRecorder); ok {
		record(step, now.Sub(since))
	}
	return now
}
