module github.com/opendsec/dsec

go 1.26.8

require (
	connectrpc.com/connect v1.21.1
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/creack/pty v1.1.24 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
