// Package dockerfile parses Dockerfiles and performs their variable
// substitution, for dsec image build.
//
// Parse turns a Dockerfile into its global build args and its stages, each
// a FROM and the steps after it. It handles what the Dockerfile reference
// defines below the level of meaning: parser directives (escape, syntax),
// comments, line continuations, the exec (JSON) and shell forms, leading
// flags and here-documents. It does not decide what a step means (which
// flags are supported, how ARG and ENV are scoped, what a heredoc feeds):
// that is the builder's job, helped by Expand (variable substitution on one
// word) and KeyValues (the pairs of an ENV or LABEL).
//
// Every bad-input error is an errdefs.Invalid. Those of Parse and KeyValues
// start with the Dockerfile line they concern ("line 7: ..."); Expand works
// on one word and knows no line, so its caller adds it.
//
// Nothing here touches the file system or the network, and every function
// is safe for concurrent use.
package dockerfile

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Limits on what Parse accepts.
const (
	maxSize  = 1 << 20 // bytes
	maxLines = 100_000
)

// blanks are the characters that separate words on an instruction line.
const blanks = " \t\r\v\f"

// File is a parsed Dockerfile.
type File struct {
	Args   []Arg // ARG instructions before the first FROM (global build args), in order
	Stages []*Stage
}

// Arg is one ARG declaration: ARG NAME or ARG NAME=default. One ARG
// instruction may declare several (ARG A=1 B), giving several Args.
type Arg struct {
	Name string
	// Default is the default as written, quotes included (the builder
	// expands it with Expand); nil when there is none. ARG A= gives a
	// pointer to "".
	Default *string
}

// Stage is one FROM and the steps after it.
type Stage struct {
	Base     string // the FROM image word as written (may contain $VAR / ${VAR}; the builder expands it with the global args)
	Name     string // the AS name, lowercased; "" if none
	Platform string // --platform flag value as written, "" if none
	Line     int    // line of the FROM
	Steps    []*Step
}

// Step is one instruction after a FROM.
type Step struct {
	Line    int    // line where the instruction starts (1-based)
	Command string // upper case: RUN COPY ADD ENV ARG WORKDIR USER ENTRYPOINT CMD LABEL EXPOSE SHELL VOLUME STOPSIGNAL HEALTHCHECK ONBUILD MAINTAINER
	// Original is the instruction as written, continuation lines joined
	// with the escape character and its newline removed and the ends
	// trimmed, for logs and cache keys. Heredoc bodies are not part of it.
	Original string
	// Flags holds the leading --name=value flags of RUN, COPY and ADD,
	// values as written; a flag given without =value gets "true". A flag
	// given more than once (RUN --mount, COPY --exclude) has its values
	// joined with "\n", in order. Unknown flags are kept: the builder
	// refuses the ones it does not support. Nil when there are none.
	Flags map[string]string
	// Args are the arguments after the flags:
	//   - exec form (JSON true): the strings of the array;
	//   - RUN, CMD, ENTRYPOINT in shell form, ENV, LABEL, HEALTHCHECK,
	//     ONBUILD: one element, the rest of the line;
	//   - COPY, ADD, VOLUME, EXPOSE, USER, WORKDIR, STOPSIGNAL,
	//     MAINTAINER, ARG: the words of the line, split at blanks outside
	//     quotes, quotes and escapes kept (Expand removes them).
	Args     []string
	JSON     bool      // the exec (JSON array) form was used (RUN, CMD, ENTRYPOINT, SHELL, COPY, ADD, VOLUME)
	Heredocs []Heredoc // RUN and COPY heredocs (<<EOF ... EOF), in order; nil when none
}

// Heredoc is one here-document: <<NAME, <<-NAME (strip leading tabs),
// <<"NAME" or <<'NAME' (quoted: no expansion).
type Heredoc struct {
	Name    string
	Content string // the body, each line ending with "\n", without the terminator line
	Expand  bool   // false when the delimiter was quoted
	Chomp   bool   // <<- : leading tabs stripped from body lines (already stripped in Content)
}

// commands are the instructions Parse knows; flagged are those whose
// leading --flags it parses.
var (
	commands = map[string]bool{
		"FROM": true, "RUN": true, "COPY": true, "ADD": true, "ENV": true, "ARG": true,
		"WORKDIR": true, "USER": true, "ENTRYPOINT": true, "CMD": true, "LABEL": true,
		"EXPOSE": true, "SHELL": true, "VOLUME": true, "STOPSIGNAL": true,
		"HEALTHCHECK": true, "ONBUILD": true, "MAINTAINER": true,
	}
	flagged = map[string]bool{"FROM": true, "RUN": true, "COPY": true, "ADD": true}
)

// Parse reads a Dockerfile from r.
//
// It fails with errdefs.Invalid, naming the line, on: an instruction before
// the first FROM other than ARG; an unknown instruction; a missing argument
// ("RUN" alone, "COPY a", "FROM" with nothing); a FROM that is not
// "FROM [--platform=p] image [AS name]", a bad or repeated stage name; a
// COPY or ADD whose argument starts with '[' but is not a JSON array of
// strings (for RUN, CMD, ENTRYPOINT and VOLUME such a line is shell form,
// as in Docker); a SHELL not in JSON form; an unterminated quote in a word
// list; a flag without a name; a bad parser directive; a heredoc without its
// terminator; no FROM at all (naming the last line); a file larger than
// 1 MiB or longer than 100,000 lines. An error reading r is returned
// wrapped, with the class r gave it.
//
// Heredoc delimiters are recognised in the shell form of RUN and COPY when
// they start a word (optionally after a file descriptor number, as in
// 3<<EOF) outside quotes; <<< is a here-string, not a heredoc.
func Parse(r io.Reader) (*File, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxSize+1))
	if err != nil {
		return nil, fmt.Errorf("read the Dockerfile: %w", err)
	}
	if len(data) > maxSize {
		return nil, errdefs.Invalid("line %d: the Dockerfile is larger than 1 MiB", bytes.Count(data[:maxSize], []byte("\n"))+1)
	}
	lines := strings.Split(strings.TrimPrefix(string(data), "\ufeff"), "\n")
	if lines[len(lines)-1] == "" {
		// A final newline ends the last line; it does not start another.
		lines = lines[:len(lines)-1]
	}
	if len(lines) > maxLines {
		return nil, errdefs.Invalid("line %d: the Dockerfile has more than %d lines", maxLines+1, maxLines)
	}
	for i, l := range lines {
		lines[i] = strings.TrimSuffix(l, "\r")
	}
	p := &parser{lines: lines, escape: '\\', stages: map[string]int{}}
	return p.parse()
}

// parser holds the state of one Parse.
type parser struct {
	lines  []string
	i      int  // index in lines of the next line to read
	escape byte // the escape character: '\\' or '`'
	file   File
	stages map[string]int // stage name -> line of its FROM
}

func (p *parser) parse() (*File, error) {
	if err := p.directives(); err != nil {
		return nil, err
	}
	for {
		line, text, ok := p.next()
		if !ok {
			break
		}
		if err := p.instruction(line, text); err != nil {
			return nil, err
		}
	}
	if len(p.file.Stages) == 0 {
		return nil, errdefs.Invalid("line %d: the Dockerfile has no FROM instruction", max(len(p.lines), 1))
	}
	return &p.file, nil
}

// directives reads the parser directives at the top of the file. They end
// at the first line that is not a known directive: an instruction, a blank
// line or a comment (an unknown directive is a comment).
func (p *parser) directives() error {
	seen := map[string]bool{}
	for ; p.i < len(p.lines); p.i++ {
		name, value, ok := directive(p.lines[p.i])
		if !ok {
			return nil
		}
		line := p.i + 1
		if seen[name] {
			return errdefs.Invalid("line %d: the %s directive is given twice", line, name)
		}
		seen[name] = true
		if name == "escape" {
			if value != `\` && value != "`" {
				return errdefs.Invalid("line %d: the escape directive must be \\ or `, not %q", line, clip(value))
			}
			p.escape = value[0]
		}
	}
	return nil
}

// directive reports whether line is a parser directive Parse knows
// (# escape=..., # syntax=..., # check=...), returning its lowercased name
// and its value. syntax and check are read and ignored.
func directive(line string) (name, value string, ok bool) {
	s := strings.Trim(line, blanks)
	if !strings.HasPrefix(s, "#") {
		return "", "", false
	}
	name, value, found := strings.Cut(s[1:], "=")
	if !found {
		return "", "", false
	}
	name = strings.ToLower(strings.Trim(name, blanks))
	switch name {
	case "escape", "syntax", "check":
		return name, strings.Trim(value, blanks), true
	}
	return "", "", false
}

// skippable reports whether l is blank or a comment.
func skippable(l string) bool {
	s := strings.TrimLeft(l, blanks)
	return s == "" || s[0] == '#'
}

// next returns the next instruction: the line it starts on and its text,
// continuation lines joined and the ends trimmed. Blank and comment lines
// before it, and between its continuation lines, are skipped.
func (p *parser) next() (line int, text string, ok bool) {
	for p.i < len(p.lines) && skippable(p.lines[p.i]) {
		p.i++
	}
	if p.i >= len(p.lines) {
		return 0, "", false
	}
	line = p.i + 1
	var b strings.Builder
	for p.i < len(p.lines) {
		l := p.lines[p.i]
		p.i++
		r := strings.TrimRight(l, blanks)
		if r == "" || r[len(r)-1] != p.escape {
			b.WriteString(l)
			break
		}
		b.WriteString(r[:len(r)-1])
		for p.i < len(p.lines) && skippable(p.lines[p.i]) {
			p.i++
		}
	}
	return line, strings.Trim(b.String(), blanks), true
}

// instruction parses one instruction, reads its heredoc bodies and files
// it: a FROM starts a stage, an ARG before the first FROM is a global arg,
// anything else is a step of the current stage.
func (p *parser) instruction(line int, text string) error {
	step, heredocs, err := parseStep(line, text, p.escape)
	if err != nil {
		return err
	}
	if err := p.readHeredocs(step, heredocs); err != nil {
		return err
	}
	switch {
	case step.Command == "FROM":
		return p.from(step)
	case len(p.file.Stages) > 0:
		if step.Command == "ARG" {
			if _, err := parseArgs(step); err != nil {
				return err
			}
		}
		st := p.file.Stages[len(p.file.Stages)-1]
		st.Steps = append(st.Steps, step)
		return nil
	case step.Command == "ARG":
		args, err := parseArgs(step)
		if err != nil {
			return err
		}
		p.file.Args = append(p.file.Args, args...)
		return nil
	default:
		return errdefs.Invalid("line %d: %s before the first FROM: only ARG may come first", line, step.Command)
	}
}

// from turns a FROM step into a new stage.
func (p *parser) from(step *Step) error {
	st := &Stage{Line: step.Line}
	for _, name := range slices.Sorted(maps.Keys(step.Flags)) {
		value := step.Flags[name]
		if name != "platform" {
			return errdefs.Invalid("line %d: FROM does not support --%s", step.Line, clip(name))
		}
		if strings.Contains(value, "\n") {
			return errdefs.Invalid("line %d: FROM --platform is given more than once", step.Line)
		}
		st.Platform = value
	}
	switch w := step.Args; {
	case len(w) == 1:
		st.Base = w[0]
	case len(w) == 3 && strings.EqualFold(w[1], "AS"):
		st.Base, st.Name = w[0], strings.ToLower(w[2])
	default:
		return errdefs.Invalid("line %d: want FROM [--platform=...] image [AS name]", step.Line)
	}
	if st.Name != "" {
		if !validStageName(st.Name) {
			return errdefs.Invalid("line %d: stage name %q must start with a letter and hold only letters, digits, '-', '_' and '.'", step.Line, clip(st.Name))
		}
		if first, ok := p.stages[st.Name]; ok {
			return errdefs.Invalid("line %d: stage name %q is already used on line %d", step.Line, st.Name, first)
		}
		p.stages[st.Name] = step.Line
	}
	p.file.Stages = append(p.file.Stages, st)
	return nil
}

// validStageName reports whether s matches [a-z][a-z0-9-_.]*.
func validStageName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z':
		case i > 0 && (c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'):
		default:
			return false
		}
	}
	return s != ""
}

// ArgsOf returns the declarations of an ARG step inside a stage (Parse
// has checked them).
func ArgsOf(step *Step) ([]Arg, error) { return parseArgs(step) }

// parseArgs returns the declarations of an ARG step.
func parseArgs(step *Step) ([]Arg, error) {
	args := make([]Arg, 0, len(step.Args))
	for _, w := range step.Args {
		name, def, hasDef := strings.Cut(w, "=")
		if name == "" {
			return nil, errdefs.Invalid("line %d: ARG: empty name in %q", step.Line, clip(w))
		}
		a := Arg{Name: name}
		if hasDef {
			a.Default = &def
		}
		args = append(args, a)
	}
	return args, nil
}

// heredocToken is a heredoc delimiter found on an instruction line.
type heredocToken struct {
	name   string
	quoted bool
	chomp  bool
}

// readHeredocs reads the bodies of step's heredocs from the lines after
// the instruction, in order.
func (p *parser) readHeredocs(step *Step, tokens []heredocToken) error {
	for _, t := range tokens {
		var b strings.Builder
		closed := false
		for p.i < len(p.lines) {
			l := p.lines[p.i]
			p.i++
			if t.chomp {
				l = strings.TrimLeft(l, "\t")
			}
			if l == t.name {
				closed = true
				break
			}
			b.WriteString(l)
			b.WriteByte('\n')
		}
		if !closed {
			return errdefs.Invalid("line %d: heredoc %q has no terminator line", step.Line, clip(t.name))
		}
		step.Heredocs = append(step.Heredocs, Heredoc{Name: t.name, Content: b.String(), Expand: !t.quoted, Chomp: t.chomp})
	}
	return nil
}

// parseStep parses one instruction's text (continuations joined, ends
// trimmed) and returns the step and the heredoc delimiters it names.
func parseStep(line int, text string, esc byte) (*Step, []heredocToken, error) {
	word, rest := text, ""
	if i := strings.IndexAny(text, blanks); i >= 0 {
		word, rest = text[:i], strings.TrimLeft(text[i:], blanks)
	}
	cmd := strings.ToUpper(word)
	if !commands[cmd] {
		return nil, nil, errdefs.Invalid("line %d: unknown instruction %q", line, clip(word))
	}
	s := &Step{Line: line, Command: cmd, Original: text}
	if flagged[cmd] {
		var err error
		if s.Flags, rest, err = parseFlags(line, rest, esc); err != nil {
			return nil, nil, err
		}
	}
	missing := func() error { return errdefs.Invalid("line %d: %s requires an argument", line, cmd) }
	switch cmd {
	case "RUN", "CMD", "ENTRYPOINT":
		if list, ok := jsonArray(rest); ok {
			if cmd == "RUN" && len(list) == 0 {
				return nil, nil, missing()
			}
			s.JSON, s.Args = true, list
		} else {
			if rest == "" {
				return nil, nil, missing()
			}
			s.Args = []string{rest}
		}
	case "SHELL":
		list, ok := jsonArray(rest)
		if !ok || len(list) == 0 {
			return nil, nil, errdefs.Invalid(`line %d: SHELL requires a JSON array such as ["/bin/sh", "-c"]`, line)
		}
		s.JSON, s.Args = true, list
	case "COPY", "ADD":
		if strings.HasPrefix(rest, "[") {
			list, ok := jsonArray(rest)
			if !ok {
				return nil, nil, errdefs.Invalid("line %d: %s: the arguments start with [ but are not a JSON array of strings", line, cmd)
			}
			s.JSON, s.Args = true, list
		} else {
			w, err := splitWords(line, rest, esc)
			if err != nil {
				return nil, nil, err
			}
			s.Args = w
		}
		if len(s.Args) < 2 {
			return nil, nil, errdefs.Invalid("line %d: %s requires at least one source and a destination", line, cmd)
		}
	case "VOLUME":
		if list, ok := jsonArray(rest); ok {
			s.JSON, s.Args = true, list
		} else {
			w, err := splitWords(line, rest, esc)
			if err != nil {
				return nil, nil, err
			}
			s.Args = w
		}
		if len(s.Args) == 0 {
			return nil, nil, missing()
		}
	case "ENV", "LABEL", "HEALTHCHECK", "ONBUILD":
		if rest == "" {
			return nil, nil, missing()
		}
		s.Args = []string{rest}
	default: // FROM ARG EXPOSE USER WORKDIR STOPSIGNAL MAINTAINER
		w, err := splitWords(line, rest, esc)
		if err != nil {
			return nil, nil, err
		}
		if len(w) == 0 {
			return nil, nil, missing()
		}
		s.Args = w
	}
	var heredocs []heredocToken
	if (cmd == "RUN" || cmd == "COPY") && !s.JSON {
		heredocs = findHeredocs(rest, esc)
	}
	return s, heredocs, nil
}

// parseFlags takes the leading --name[=value] words off rest and returns
// them and what follows them.
func parseFlags(line int, rest string, esc byte) (map[string]string, string, error) {
	var flags map[string]string
	for strings.HasPrefix(rest, "--") {
		end, ok := wordEnd(rest, 0, esc)
		if !ok {
			return nil, "", errdefs.Invalid("line %d: unterminated quote", line)
		}
		name, value, hasValue := strings.Cut(rest[2:end], "=")
		rest = strings.TrimLeft(rest[end:], blanks)
		if name == "" {
			return nil, "", errdefs.Invalid("line %d: a flag has no name", line)
		}
		if !hasValue {
			value = "true"
		}
		if flags == nil {
			flags = map[string]string{}
		}
		if old, ok := flags[name]; ok {
			value = old + "\n" + value
		}
		flags[name] = value
	}
	return flags, rest, nil
}

// jsonArray parses s as a JSON array of strings.
func jsonArray(s string) ([]string, bool) {
	if !strings.HasPrefix(s, "[") {
		return nil, false
	}
	var list []string
	if err := json.Unmarshal([]byte(s), &list); err != nil {
		return nil, false
	}
	return list, true
}

// span is the byte range [start, end) of a word.
type span struct{ start, end int }

// spans splits s into words at blanks outside single and double quotes;
// esc escapes the next character outside single quotes. It reports false
// when a quote is not closed.
func spans(s string, esc byte) ([]span, bool) {
	var out []span
	i := 0
	for {
		for i < len(s) && isBlank(s[i]) {
			i++
		}
		if i >= len(s) {
			return out, true
		}
		end, ok := wordEnd(s, i, esc)
		if !ok {
			return nil, false
		}
		out = append(out, span{i, end})
		i = end
	}
}

// wordEnd returns the end of the word starting at s[start].
func wordEnd(s string, start int, esc byte) (int, bool) {
	var quote byte // the open quote, 0 outside quotes
	i := start
	for i < len(s) {
		c := s[i]
		switch {
		case quote == 0 && isBlank(c):
			return i, true
		case c == esc && quote != '\'' && i+1 < len(s):
			i++
		case quote == 0 && (c == '\'' || c == '"'):
			quote = c
		case quote != 0 && c == quote:
			quote = 0
		}
		i++
	}
	return i, quote == 0
}

// splitWords is spans returning the words, or an error naming line.
func splitWords(line int, s string, esc byte) ([]string, error) {
	sp, ok := spans(s, esc)
	if !ok {
		return nil, errdefs.Invalid("line %d: unterminated quote", line)
	}
	var w []string
	for _, x := range sp {
		w = append(w, s[x.start:x.end])
	}
	return w, nil
}

// findHeredocs returns the heredoc delimiters in the shell-form text s: a
// word outside quotes that starts with <<, optionally after file
// descriptor digits, followed by an optional '-' and a name, bare or
// quoted.
func findHeredocs(s string, esc byte) []heredocToken {
	var out []heredocToken
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			if c == esc && quote == '"' && i+1 < len(s) {
				i++
			} else if c == quote {
				quote = 0
			}
		case c == esc:
			i++
		case c == '\'' || c == '"':
			quote = c
		case c == '<' && strings.HasPrefix(s[i:], "<<") && atWordStart(s, i):
			if t, n, ok := heredocAt(s[i+2:]); ok {
				out = append(out, t)
				i += 1 + n
			} else {
				i++ // past the second '<', so <<< is never read as <<
			}
		}
	}
	return out
}

// atWordStart reports whether s[i] starts a word, file descriptor digits
// before it aside.
func atWordStart(s string, i int) bool {
	for i > 0 && s[i-1] >= '0' && s[i-1] <= '9' {
		i--
	}
	return i == 0 || isBlank(s[i-1])
}

// heredocAt parses what follows a "<<": [-]NAME, [-]"NAME" or [-]'NAME'.
// It returns the token and the bytes it used.
func heredocAt(t string) (heredocToken, int, bool) {
	var tok heredocToken
	j := 0
	if j < len(t) && t[j] == '-' {
		tok.chomp = true
		j++
	}
	if j < len(t) && (t[j] == '\'' || t[j] == '"') {
		end := strings.IndexByte(t[j+1:], t[j])
		if end <= 0 {
			return tok, 0, false
		}
		tok.name, tok.quoted = t[j+1:j+1+end], true
		return tok, j + end + 2, true
	}
	k := j
	for k < len(t) && !isBlank(t[k]) && !strings.ContainsRune("<>|&;()'\"$`\\", rune(t[k])) {
		k++
	}
	if k == j {
		return tok, 0, false
	}
	tok.name = t[j:k]
	return tok, k, true
}

func isBlank(c byte) bool { return strings.IndexByte(blanks, c) >= 0 }

// clip shortens s for an error message.
func clip(s string) string {
	const limit = 60
	if len(s) <= limit {
		return s
	}
	i := limit
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "..."
}
