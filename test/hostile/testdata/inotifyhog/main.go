// Command inotifyhog opens inotify instances until the kernel refuses one
// (or it has opened the most it was asked for), prints how many it opened
// and why it stopped, then holds them until killed: `inotifyhog [MAX]`.
// The hostile tests build it statically and upload it.
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	most := 1 << 20
	if len(os.Args) > 1 {
		most, _ = strconv.Atoi(os.Args[1])
	}
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) == nil {
		lim.Cur = lim.Max
		unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	}
	n := 0
	why := "asked for no more"
	for n < most {
		if _, err := unix.InotifyInit1(unix.IN_CLOEXEC); err != nil {
			why = err.Error()
			break
		}
		n++
	}
	fmt.Printf("opened %d: %s\n", n, why)
	os.Stdout.Sync()
	for {
		time.Sleep(time.Hour)
	}
}
