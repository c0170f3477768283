package e2b

import (
	"context"
	"errors"
	"net/http"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
)

// E2B's pause semantics on top of dsec's. A native call on a paused
// sandbox resumes it; an E2B sandbox stays paused until connect() (or the
// deprecated resume) resumes it, and its data plane (envd, the code
// interpreter, user ports) answers 502 meanwhile. A sandbox created with
// lifecycle {onTimeout: "pause"} pauses at its timeout instead of ending
// (the node's on_timeout "pause"); with autoResume, the next data-plane
// request resumes it. keepMemory: false (pause's, or onTimeout's) is the
// node's filesystem-only pause ("pause_filesystem"): the sandbox's
// processes end, its files stay, and connect() cold-boots it (new
// processes, a new boot id, the same ID and access tokens). Such a
// sandbox cannot auto-resume on traffic.

// autoResumeLabel marks a sandbox created with autoResume: its data plane
// resumes it instead of answering that it is paused.
const autoResumeLabel = labelPrefix + "auto-resume"

// onTimeoutPause and onTimeoutPauseFilesystem are SandboxSpec.on_timeout's
// "pause" and "pause_filesystem" (keepMemory: false).
const (
	onTimeoutPause           = "pause"
	onTimeoutPauseFilesystem = "pause_filesystem"
)

// lifecycleJSON is E2B's SandboxLifecycle (getInfo).
type lifecycleJSON struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

// lifecycleOf is a sandbox's lifecycle as E2B reports it.
func lifecycleOf(sb *dsecv1.Sandbox) *lifecycleJSON {
	l := &lifecycleJSON{OnTimeout: "kill"}
	if o := sb.GetSpec().GetOnTimeout(); o == onTimeoutPause || o == onTimeoutPauseFilesystem {
		l.OnTimeout = "pause"
		l.AutoResume = sb.GetSpec().GetLabels()[autoResumeLabel] == "true"
	}
	return l
}

// lifecycleSpec sets a create's timeout policy from autoPause,
// autoPauseMemory and autoResume.
func lifecycleSpec(in *newSandbox, spec *dsecv1.SandboxSpec) error {
	pause := in.AutoPause != nil && *in.AutoPause
	resume := in.AutoResume != nil && in.AutoResume.Enabled
	fsOnly := in.AutoPauseMemory != nil && !*in.AutoPauseMemory
	switch {
	case resume && !pause:
		return errdefs.Invalid("autoResume needs lifecycle onTimeout \"pause\" (autoPause)")
	case resume && fsOnly:
		return errdefs.Invalid("autoResume needs a pause that keeps memory: a filesystem-only auto-pause (keepMemory: false) resumes by connect() only")
	}
	switch {
	case pause && fsOnly:
		spec.OnTimeout = onTimeoutPauseFilesystem
	case pause:
		spec.OnTimeout = onTimeoutPause
	}
	if resume {
		spec.Labels[autoResumeLabel] = "true"
	}
	return nil
}

// sandboxPaused is the data plane's answer for a paused sandbox that does
// not resume on traffic: E2B's proxy answers 502 with its own body
// (errors.go writes it), the Connect RPCs "unavailable".
type sandboxPaused struct{ id string }

func (e *sandboxPaused) Error() string { return "The sandbox is paused" }

func (e *sandboxPaused) Unwrap() error {
	return errdefs.Unavailable("sandbox %s is paused: connect() resumes it", clip(e.id))
}

// pausedBody is E2B's proxy body for a paused sandbox.
type pausedBody struct {
	SandboxID     string `json:"sandboxId"`
	Message       string `json:"message"`
	Code          int    `json:"code"`
	CanAutoResume bool   `json:"canAutoResume"`
}

// writePaused writes E2B's answer for a paused sandbox if err is one, and
// reports whether it did.
func writePaused(w http.ResponseWriter, err error) bool {
	var p *sandboxPaused
	if !errors.As(err, &p) {
		return false
	}
	writeJSON(w, http.StatusBadGateway, pausedBody{SandboxID: p.id, Message: p.Error(), Code: http.StatusBadGateway})
	return true
}

// awake returns the node of sandbox id for a data-plane request (envd, the
// code interpreter, a user port): the sandbox runs, or it is paused with
// autoResume and awake resumes it. A paused sandbox without autoResume is
// a sandboxPaused error, anything else notRunning. Node calls are made with
// ctx's caller.
//
// The state is read before the request's own call, which would resume the
// sandbox (the native API's rule): a pause that lands between the two
// (the user's, or the timeout's) is undone by that call.
func (f *Facade) awake(ctx context.Context, id string) (apiserver.Node, error) {
	n, err := f.r.ForSandbox(ctx, id)
	if err != nil {
		return nil, notRunning(id)
	}
	sb, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: id}, apiserver.Node.GetSandbox)
	if err != nil {
		return nil, notRunning(id)
	}
	switch sb.State {
	case "running":
		return n, nil
	case "paused":
		if sb.GetSpec().GetLabels()[autoResumeLabel] != "true" {
			return nil, &sandboxPaused{id: id}
		}
		if _, err := apiserver.Do(ctx, n, &dsecv1.ResumeSandboxRequest{Id: id}, apiserver.Node.ResumeSandbox); err != nil {
			return nil, f.sandboxErr(ctx, id, err)
		}
		return n, nil
	}
	return nil, notRunning(id)
}
