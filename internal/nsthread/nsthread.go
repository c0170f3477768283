// Package nsthread runs code on a thread that joined another network
// namespace, without ever letting any other goroutine run there.
package nsthread

import (
	"runtime"

	"github.com/vishvananda/netns"
)

// NetNS runs fn on a thread in the network namespace at path. The thread
// is thrown away afterwards (its goroutine ends locked to it), so no other
// goroutine ever runs in the namespace. Sockets and devices fn opens stay
// in the namespace.
func NetNS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		ns, err := netns.GetFromPath(path)
		if err != nil {
			errc <- err
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}
