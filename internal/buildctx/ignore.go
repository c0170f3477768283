package buildctx

import (
	"bufio"
	"fmt"
	"io"
	"path"
	"path/filepath"
	"strings"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Ignore is a parsed .dockerignore file. It is immutable and safe for
// concurrent use. A nil *Ignore excludes nothing.
type Ignore struct {
	patterns []pattern
}

// pattern is one .dockerignore line, split into path elements.
type pattern struct {
	elems     []string
	exception bool // the line started with "!"
}

// ParseIgnore reads a .dockerignore file with Docker's rules: one pattern
// per line; a line starting with "#" is a comment; surrounding whitespace is
// trimmed and blank lines are skipped; a leading "!" makes an exception that
// re-includes what earlier patterns excluded; each pattern is cleaned with
// filepath.Clean and a leading "/" is dropped, so patterns are relative to
// the context root; a pattern that cleans to "." is ignored. A malformed
// pattern (for example "[") or a lone "!" is an errdefs.Invalid error naming
// the line.
func ParseIgnore(r io.Reader) (*Ignore, error) {
	ig := &Ignore{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if n == 1 {
			line = strings.TrimPrefix(line, "\uFEFF") // a UTF-8 byte order mark
		}
		// Docker tests for "#" before trimming: " #x" is a pattern.
		if strings.HasPrefix(line, "#") {
			continue
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		var p pattern
		if rest, ok := strings.CutPrefix(line, "!"); ok {
			p.exception = true
			line = strings.TrimSpace(rest)
			if line == "" {
				return nil, errdefs.Invalid(".dockerignore line %d: exception %q names no pattern", n, "!")
			}
		}
		clean := filepath.ToSlash(filepath.Clean(line))
		if len(clean) > 1 {
			clean = strings.TrimPrefix(clean, "/")
		}
		if clean == "." {
			continue
		}
		for _, e := range strings.Split(clean, "/") {
			if _, err := path.Match(e, ""); err != nil {
				return nil, errdefs.Invalid(".dockerignore line %d: bad pattern %q", n, line)
			}
			// Consecutive "**" mean the same as one and would make
			// matching slower.
			if e == "**" && len(p.elems) > 0 && p.elems[len(p.elems)-1] == "**" {
				continue
			}
			p.elems = append(p.elems, e)
		}
		ig.patterns = append(ig.patterns, p)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read .dockerignore: %w", err)
	}
	return ig, nil
}

// Excluded reports whether the context path rel (slash-separated, relative
// to the context root) is left out of the build context. A pattern matches
// rel if it matches rel itself or any of its parent directories, so "foo"
// excludes "foo/bar/baz"; the last matching pattern decides. Within a path
// element the rules of path.Match apply; an element "**" matches any number
// of elements, including none ("**/x" matches "x" and "a/b/x"), except that
// a trailing "**" needs at least one ("foo/**" matches what is inside foo,
// not foo itself). Docker's rules do not depend on the kind of file, so
// isDir does not change the answer; it is taken so callers need not care.
func (ig *Ignore) Excluded(rel string, isDir bool) bool {
	if ig == nil {
		return false
	}
	rel = path.Clean(filepath.ToSlash(rel))
	if rel == "." || rel == "/" {
		return false // the root is always sent
	}
	name := strings.Split(strings.TrimPrefix(rel, "/"), "/")
	excluded := false
	for _, p := range ig.patterns {
		// An exclusion cannot change an excluded path, nor an exception
		// an included one.
		if p.exception != excluded {
			continue
		}
		for n := len(name); n > 0; n-- {
			if match(p.elems, name[:n]) {
				excluded = !p.exception
				break
			}
		}
	}
	return excluded
}

// mayIncludeBelow reports whether some exception could match a path strictly
// beneath the excluded directory dir, so dir must be walked rather than
// skipped. It may answer true when nothing beneath dir ends up included; it
// never answers false when something would be.
func (ig *Ignore) mayIncludeBelow(dir string) bool {
	if ig == nil {
		return false
	}
	d := strings.Split(path.Clean(dir), "/")
	for _, p := range ig.patterns {
		if p.exception && prefixMatch(p.elems, d) {
			return true
		}
	}
	return false
}

// prefixMatch reports whether pat could match some path strictly beneath
// dir. A pattern no longer than dir that matches it matches dir itself or an
// ancestor: it covers dir as a whole, and as dir is excluded, a later
// exclusion that also covers everything beneath dir overrides it.
func prefixMatch(pat, dir []string) bool {
	for i, e := range pat {
		if e == "**" || i == len(dir) {
			return true
		}
		if ok, _ := path.Match(e, dir[i]); !ok {
			return false
		}
	}
	return false
}

// match reports whether the pattern elements pat match the path elements
// name in full.
func match(pat, name []string) bool {
	for len(pat) > 0 {
		if pat[0] == "**" {
			if len(pat) == 1 {
				return len(name) > 0
			}
			for i := range len(name) + 1 {
				if match(pat[1:], name[i:]) {
					return true
				}
			}
			return false
		}
		if len(name) == 0 {
			return false
		}
		if ok, _ := path.Match(pat[0], name[0]); !ok {
			return false
		}
		pat, name = pat[1:], name[1:]
	}
	return len(name) == 0
}
