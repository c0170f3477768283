package agent

import _ "embed"

// forkerBinary is forker/forker.c built freestanding for amd64 (see
// IsolatePIDs). Rebuild it after changing the source:
//
//go:generate gcc -nostdlib -static -Os -s -ffreestanding -fno-stack-protector -fno-pie -no-pie -fno-asynchronous-unwind-tables -Wall -o forker_amd64.bin forker/forker.c
//go:embed forker_amd64.bin
var forkerBinary []byte
