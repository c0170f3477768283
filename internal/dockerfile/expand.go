package dockerfile

import (
	"strings"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Expand performs Docker's variable substitution on one word of an
// instruction, as the builder does for ADD, COPY, ENV, EXPOSE, FROM, LABEL,
// STOPSIGNAL, USER, VOLUME and WORKDIR, and returns the word with its
// quotes removed.
//
// It understands $NAME and ${NAME}, where NAME is [A-Za-z_][A-Za-z0-9_]*
// (a '$' not followed by such a name or a '{' is literal), and, with w a
// word that may itself hold quotes and substitutions:
//
//	${NAME:-w}  NAME if set and not empty, else w
//	${NAME-w}   NAME if set, else w
//	${NAME:+w}  w if NAME is set and not empty, else ""
//	${NAME+w}   w if NAME is set, else ""
//	${NAME:?w}  NAME if set and not empty, else an error with message w
//	${NAME?w}   NAME if set, else an error with message w
//
// w is expanded only when it is used. Outside quotes a backslash makes the
// next character literal (\$ is a '$', \\ a '\') and is removed; a final
// lone backslash stays. Single quotes make everything up to the next single
// quote literal; double quotes allow substitution, and inside them a
// backslash escapes only '$', '"' and '\'. The quotes are removed. Expand
// always uses the backslash, whatever the file's escape directive.
//
// lookup reports a name's value and whether it is set; a nil lookup sets
// nothing. Errors are errdefs.Invalid and name no line (the caller knows
// it): a bad substitution ("${", "${A", "${A:x}", "${}", and the operators
// above are the only ones), an unterminated quote, or a ${NAME?w} whose
// NAME is missing.
func Expand(word string, lookup func(name string) (string, bool)) (string, error) {
	x := &expander{s: word, lookup: lookup}
	return x.word(false, true)
}

// expander is the state of one Expand.
type expander struct {
	s      string
	i      int // index in s of the next byte to read
	lookup func(string) (string, bool)
}

func (x *expander) get(name string) (string, bool) {
	if x.lookup == nil {
		return "", false
	}
	return x.lookup(name)
}

// word reads up to the end of s, or, inBraces, up to and past the '}' that
// closes a ${NAME op w}. With eval false it only checks the syntax: it
// looks nothing up and reports no ${NAME?w} errors.
func (x *expander) word(inBraces, eval bool) (string, error) {
	var b strings.Builder
	for x.i < len(x.s) {
		switch c := x.s[x.i]; c {
		case '}':
			x.i++
			if inBraces {
				return b.String(), nil
			}
			b.WriteByte(c)
		case '\'':
			end := strings.IndexByte(x.s[x.i+1:], '\'')
			if end < 0 {
				return "", errdefs.Invalid("unterminated single quote in %q", clip(x.s))
			}
			b.WriteString(x.s[x.i+1 : x.i+1+end])
			x.i += end + 2
		case '"':
			if err := x.double(&b, eval); err != nil {
				return "", err
			}
		case '\\':
			if x.i+1 < len(x.s) {
				b.WriteByte(x.s[x.i+1])
				x.i += 2
			} else {
				b.WriteByte(c)
				x.i++
			}
		case '$':
			v, err := x.dollar(eval)
			if err != nil {
				return "", err
			}
			b.WriteString(v)
		default:
			b.WriteByte(c)
			x.i++
		}
	}
	if inBraces {
		return "", x.bad()
	}
	return b.String(), nil
}

// double reads a double-quoted string, the opening quote at x.i, into b.
func (x *expander) double(b *strings.Builder, eval bool) error {
	x.i++
	for x.i < len(x.s) {
		c := x.s[x.i]
		switch {
		case c == '"':
			x.i++
			return nil
		case c == '\\' && x.i+1 < len(x.s) && strings.IndexByte(`$"\`, x.s[x.i+1]) >= 0:
			b.WriteByte(x.s[x.i+1])
			x.i += 2
		case c == '$':
			v, err := x.dollar(eval)
			if err != nil {
				return err
			}
			b.WriteString(v)
		default:
			b.WriteByte(c)
			x.i++
		}
	}
	return errdefs.Invalid("unterminated double quote in %q", clip(x.s))
}

// dollar reads a substitution, the '$' at x.i.
func (x *expander) dollar(eval bool) (string, error) {
	x.i++
	if x.i < len(x.s) && x.s[x.i] == '{' {
		return x.braced(eval)
	}
	if x.i >= len(x.s) || !isNameStart(x.s[x.i]) {
		return "$", nil
	}
	start := x.i
	for x.i < len(x.s) && isNameByte(x.s[x.i]) {
		x.i++
	}
	if !eval {
		return "", nil
	}
	v, _ := x.get(x.s[start:x.i])
	return v, nil
}

// braced reads a ${...}, the '{' at x.i.
func (x *expander) braced(eval bool) (string, error) {
	x.i++
	start := x.i
	if x.i < len(x.s) && isNameStart(x.s[x.i]) {
		for x.i < len(x.s) && isNameByte(x.s[x.i]) {
			x.i++
		}
	}
	name := x.s[start:x.i]
	if name == "" || x.i >= len(x.s) {
		return "", x.bad()
	}
	op := x.s[x.i]
	x.i++
	var val string
	var set bool
	if eval {
		val, set = x.get(name)
	}
	if op == '}' {
		return val, nil
	}
	colon := op == ':'
	if colon {
		if x.i >= len(x.s) {
			return "", x.bad()
		}
		op = x.s[x.i]
		x.i++
	}
	usable := set && (!colon || val != "")
	switch op {
	case '-':
		w, err := x.word(true, eval && !usable)
		if err != nil || usable {
			return val, err
		}
		return w, nil
	case '+':
		w, err := x.word(true, eval && usable)
		if err != nil || !usable {
			return "", err
		}
		return w, nil
	case '?':
		w, err := x.word(true, eval && !usable)
		if err != nil || !eval || usable {
			return val, err
		}
		switch {
		case w != "":
			return "", errdefs.Invalid("%s: %s", name, w)
		case colon:
			return "", errdefs.Invalid("variable %s is not set or is empty", name)
		default:
			return "", errdefs.Invalid("variable %s is not set", name)
		}
	}
	return "", x.bad()
}

func (x *expander) bad() error { return errdefs.Invalid("bad substitution in %q", clip(x.s)) }

func isNameStart(c byte) bool { return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

func isNameByte(c byte) bool { return isNameStart(c) || c >= '0' && c <= '9' }

// KeyValues splits the arguments of an ENV or LABEL step into ordered
// pairs, keys and values expanded with Expand (quotes removed, escapes
// honoured) against lookup.
//
// Two forms exist, told apart by the first word. The modern form is
// KEY=value KEY2="quoted value" KEY3=a\ b: words split at blanks outside
// quotes, each split at its first '=' outside quotes. Every pair is
// expanded against lookup alone, so a pair does not see the pairs before it
// in the same instruction (ENV A=1 B=$A gives B the A from before the
// instruction), as in Docker. The legacy form is KEY value with spaces:
// exactly one key, the rest of the line (inner spacing kept) its value.
//
// Errors are errdefs.Invalid naming step.Line: step is not ENV or LABEL,
// a key is empty, a modern-form word has no '=', a legacy key has no
// value, a quote is not closed, or Expand fails.
func KeyValues(step *Step, lookup func(string) (string, bool)) ([][2]string, error) {
	if step.Command != "ENV" && step.Command != "LABEL" {
		return nil, errdefs.Invalid("line %d: %s has no key-value pairs", step.Line, step.Command)
	}
	text := ""
	if len(step.Args) == 1 {
		text = strings.Trim(step.Args[0], blanks)
	}
	if text == "" {
		return nil, errdefs.Invalid("line %d: %s requires an argument", step.Line, step.Command)
	}
	words, ok := spans(text, '\\')
	if !ok {
		return nil, errdefs.Invalid("line %d: %s: unterminated quote", step.Line, step.Command)
	}
	expand := func(s string) (string, error) {
		v, err := Expand(s, lookup)
		if err != nil {
			return "", errdefs.Invalid("line %d: %s", step.Line, errdefs.Classify(err).Msg)
		}
		return v, nil
	}
	pair := func(k, v, word string) ([2]string, error) {
		key, err := expand(k)
		if err != nil {
			return [2]string{}, err
		}
		if key == "" {
			return [2]string{}, errdefs.Invalid("line %d: %s: empty key in %q", step.Line, step.Command, clip(word))
		}
		value, err := expand(v)
		return [2]string{key, value}, err
	}

	first := text[words[0].start:words[0].end]
	if assignAt(first) < 0 {
		value := strings.TrimLeft(text[words[0].end:], blanks)
		if value == "" {
			return nil, errdefs.Invalid("line %d: %s %s has no value; write %[2]s %[3]s=value", step.Line, step.Command, clip(first))
		}
		p, err := pair(first, value, first)
		if err != nil {
			return nil, err
		}
		return [][2]string{p}, nil
	}
	out := make([][2]string, 0, len(words))
	for _, sp := range words {
		w := text[sp.start:sp.end]
		eq := assignAt(w)
		if eq < 0 {
			return nil, errdefs.Invalid("line %d: %s: %q is not of the form KEY=value", step.Line, step.Command, clip(w))
		}
		p, err := pair(w[:eq], w[eq+1:], w)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// assignAt returns the index of the first '=' in w outside quotes and not
// escaped by a backslash, or -1.
func assignAt(w string) int {
	var quote byte
	for i := 0; i < len(w); i++ {
		c := w[i]
		switch {
		case c == '\\' && quote != '\'':
			i++
		case quote == 0 && (c == '\'' || c == '"'):
			quote = c
		case quote != 0 && c == quote:
			quote = 0
		case quote == 0 && c == '=':
			return i
		}
	}
	return -1
}
