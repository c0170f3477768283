//go:build !amd64

package agent

// forkerBinary is empty where forker/forker.c has no build (its system
// calls are amd64's): IsolatePIDs then fails.
var forkerBinary []byte
