package agent

import (
	"bytes"
	"errors"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
)

// File metadata is kept in extended attributes guest.MetadataPrefix+key.
// Reading it is best effort (a file system without user xattrs, or a file
// the user may not read, has none); writing it replaces the whole set.

// xattrNames lists the attribute names of p (follow: through a final
// symlink; /proc/self/fd/N paths name open files either way).
func xattrNames(p string, follow bool) ([]string, error) {
	list := unix.Llistxattr
	if follow {
		list = unix.Listxattr
	}
	buf := make([]byte, 1024)
	for {
		n, err := list(p, buf)
		if err == unix.ERANGE {
			size, err := list(p, nil)
			if err != nil {
				return nil, err
			}
			buf = make([]byte, size+64)
			continue
		}
		if err != nil {
			return nil, err
		}
		return splitNames(buf[:n]), nil
	}
}

func splitNames(b []byte) []string {
	var out []string
	for _, n := range bytes.Split(b, []byte{0}) {
		if len(n) > 0 {
			out = append(out, string(n))
		}
	}
	return out
}

// readMetadata returns the metadata of the file at p, nil when it has none
// or it cannot be read. Keys or values that are not UTF-8 (set inside the
// sandbox) are left out: protobuf strings must be.
func readMetadata(p string, follow bool) map[string]string {
	names, err := xattrNames(p, follow)
	if err != nil {
		return nil
	}
	get := unix.Lgetxattr
	if follow {
		get = unix.Getxattr
	}
	var md map[string]string
	for _, name := range names {
		key, ok := strings.CutPrefix(name, guest.MetadataPrefix)
		if !ok || key == "" || !utf8.ValidString(key) {
			continue
		}
		buf := make([]byte, 256)
		n, err := get(p, name, buf)
		if err == unix.ERANGE {
			if size, serr := get(p, name, nil); serr == nil {
				buf = make([]byte, size)
				n, err = get(p, name, buf)
			}
		}
		if err != nil || !utf8.Valid(buf[:n]) {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = string(buf[:n])
	}
	return md
}

// writeMetadata makes md the metadata of the open file fd: other keys
// are removed. A file system without user xattrs keeps none, which is no
// error (what the file then reports shows it), as in E2B's envd.
func writeMetadata(fd int, md map[string]string) error {
	if err := guest.ValidateMetadata(md); err != nil {
		return invalid("%v", err)
	}
	buf := make([]byte, 4096)
	n, err := unix.Flistxattr(fd, buf)
	if err == unix.ERANGE {
		if size, serr := unix.Flistxattr(fd, nil); serr == nil {
			buf = make([]byte, size+64)
			n, err = unix.Flistxattr(fd, buf)
		}
	}
	if xattrUnsupported(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, name := range splitNames(buf[:n]) {
		key, ok := strings.CutPrefix(name, guest.MetadataPrefix)
		if _, keep := md[key]; !ok || keep {
			continue
		}
		if err := unix.Fremovexattr(fd, name); err != nil && err != unix.ENODATA {
			return err
		}
	}
	for k, v := range md {
		if err := unix.Fsetxattr(fd, guest.MetadataPrefix+k, []byte(v), 0); err != nil {
			if xattrUnsupported(err) {
				return nil
			}
			return err
		}
	}
	return nil
}

func xattrUnsupported(err error) bool {
	return errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP)
}
