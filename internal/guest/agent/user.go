package agent

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// identity is a resolved user: the credentials a process runs with.
type identity struct {
	name   string
	uid    uint32
	gid    uint32
	groups []uint32
	home   string
}

var rootIdentity = identity{name: "root", home: "/root"}

// resolveUser resolves "name", "uid", "name:group" or "uid:gid" against the
// sandbox's /etc/passwd and /etc/group. An empty spec is root.
func resolveUser(spec string) (identity, error) {
	if spec == "" || spec == "root" || spec == "0" {
		id := rootIdentity
		if e, ok := lookupPasswd(func(f []string) bool { return f[2] == "0" }); ok && strings.HasPrefix(e.home, "/") {
			id.home = e.home
		}
		return id, nil
	}
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	id := identity{home: "/"}
	found := false
	if n, err := strconv.ParseUint(userPart, 10, 32); err == nil {
		id.uid, id.gid, id.name = uint32(n), uint32(n), userPart
		if e, ok := lookupPasswd(func(f []string) bool { return f[2] == userPart }); ok {
			id.name, id.gid, id.home = e.name, e.gid, e.home
		}
		found = true
	} else if e, ok := lookupPasswd(func(f []string) bool { return f[0] == userPart }); ok {
		id = e
		found = true
	}
	if !found {
		return identity{}, fmt.Errorf("unknown user %q in the sandbox's /etc/passwd", userPart)
	}
	if hasGroup {
		if n, err := strconv.ParseUint(groupPart, 10, 32); err == nil {
			id.gid = uint32(n)
		} else if gid, ok := lookupGroup(groupPart); ok {
			id.gid = gid
		} else {
			return identity{}, fmt.Errorf("unknown group %q in the sandbox's /etc/group", groupPart)
		}
	}
	id.groups = supplementaryGroups(id.name, id.gid)
	return id, nil
}

func lookupPasswd(match func([]string) bool) (identity, bool) {
	var out identity
	ok := false
	scanColon("/etc/passwd", 7, func(f []string) bool {
		if !match(f) {
			return true
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			return true
		}
		out = identity{name: f[0], uid: uint32(uid), gid: uint32(gid), home: f[5]}
		ok = true
		return false
	})
	return out, ok
}

func lookupGroup(name string) (uint32, bool) {
	var gid uint32
	ok := false
	scanColon("/etc/group", 4, func(f []string) bool {
		if f[0] != name {
			return true
		}
		if n, err := strconv.ParseUint(f[2], 10, 32); err == nil {
			gid, ok = uint32(n), true
		}
		return false
	})
	return gid, ok
}

func supplementaryGroups(user string, primary uint32) []uint32 {
	groups := []uint32{primary}
	scanColon("/etc/group", 4, func(f []string) bool {
		for _, m := range strings.Split(f[3], ",") {
			if m == user {
				if n, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(n) != primary {
					groups = append(groups, uint32(n))
				}
			}
		}
		return true
	})
	return groups
}

// scanColon calls fn for each line of a colon-separated file with at least
// n fields, until fn returns false.
func scanColon(path string, n int, fn func([]string) bool) {
	// Resolved like the paths of file calls: the sandbox's user may have
	// made it a link.
	fd, err := openIn(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		fields := strings.Split(line, ":")
		if len(fields) < n {
			continue
		}
		if !fn(fields) {
			return
		}
	}
}

// nameOf returns the user or group name for id from a colon file, or the
// number itself.
func nameOf(path string, id uint32) string {
	s := strconv.FormatUint(uint64(id), 10)
	name := s
	scanColon(path, 3, func(f []string) bool {
		if f[2] == s {
			name = f[0]
			return false
		}
		return true
	})
	return name
}
