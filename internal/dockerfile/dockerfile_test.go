package dockerfile

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/opendsec/dsec/internal/errdefs"
)

func str(s string) *string { return &s }

// dump renders v for a failure message.
func dump(v any) string {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err.Error()
	}
	return string(b)
}

const multiStage = `# syntax=docker/dockerfile:1
ARG BASE=golang:1.26
ARG VERSION

FROM ${BASE} AS build
WORKDIR /src
RUN apt-get update && \
    # tools for the build
    apt-get install -y make
COPY . .
RUN --mount=type=cache,target=/root/.cache --network=none make VERSION=$VERSION

FROM --platform=linux/amd64 debian:bookworm-slim AS Runtime
COPY --from=build --chown=1000:1000 /out /app/
ENV PATH=/app/bin:$PATH LANG="C.UTF-8"
ENV TZ Europe/Paris
LABEL org.opencontainers.image.title="dsec demo" version=1
EXPOSE 8080/tcp 9090
WORKDIR /app
USER 1000:1000
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENTRYPOINT ["/app/bin/server"]
CMD ["--port", "8080"]

FROM runtime
ENTRYPOINT /app/bin/server --debug
CMD --port 8080
`

const miscInstructions = `from alpine as Base
run echo hi
Copy "my file.txt" 'dst dir/'
COPY ["a b", "/c/"]
ADD --checksum=sha256:abc --link https://example.com/x.tgz /x/
VOLUME /data /logs
VOLUME ["/cache"]
VOLUME [/not-json]
ARG A=1 B
STOPSIGNAL SIGTERM
MAINTAINER Jane Doe <jane@example.com>
HEALTHCHECK --interval=5s CMD curl -f http://localhost/
ONBUILD RUN make
RUN [ -f /x ] && echo y
CMD ["a", 1]
CMD []
RUN --mount=type=cache,target=/a --mount=type=secret,id=k --network=none make
`

func TestParse(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want *File
	}{
		{
			name: "a multi-stage file parses into global args, stages and steps",
			in:   multiStage,
			want: &File{
				Args: []Arg{{Name: "BASE", Default: str("golang:1.26")}, {Name: "VERSION"}},
				Stages: []*Stage{
					{Base: "${BASE}", Name: "build", Line: 5, Steps: []*Step{
						{Line: 6, Command: "WORKDIR", Original: "WORKDIR /src", Args: []string{"/src"}},
						{Line: 7, Command: "RUN", Original: "RUN apt-get update &&     apt-get install -y make",
							Args: []string{"apt-get update &&     apt-get install -y make"}},
						{Line: 10, Command: "COPY", Original: "COPY . .", Args: []string{".", "."}},
						{Line: 11, Command: "RUN", Original: "RUN --mount=type=cache,target=/root/.cache --network=none make VERSION=$VERSION",
							Flags: map[string]string{"mount": "type=cache,target=/root/.cache", "network": "none"},
							Args:  []string{"make VERSION=$VERSION"}},
					}},
					{Base: "debian:bookworm-slim", Name: "runtime", Platform: "linux/amd64", Line: 13, Steps: []*Step{
						{Line: 14, Command: "COPY", Original: "COPY --from=build --chown=1000:1000 /out /app/",
							Flags: map[string]string{"from": "build", "chown": "1000:1000"}, Args: []string{"/out", "/app/"}},
						{Line: 15, Command: "ENV", Original: `ENV PATH=/app/bin:$PATH LANG="C.UTF-8"`, Args: []string{`PATH=/app/bin:$PATH LANG="C.UTF-8"`}},
						{Line: 16, Command: "ENV", Original: "ENV TZ Europe/Paris", Args: []string{"TZ Europe/Paris"}},
						{Line: 17, Command: "LABEL", Original: `LABEL org.opencontainers.image.title="dsec demo" version=1`,
							Args: []string{`org.opencontainers.image.title="dsec demo" version=1`}},
						{Line: 18, Command: "EXPOSE", Original: "EXPOSE 8080/tcp 9090", Args: []string{"8080/tcp", "9090"}},
						{Line: 19, Command: "WORKDIR", Original: "WORKDIR /app", Args: []string{"/app"}},
						{Line: 20, Command: "USER", Original: "USER 1000:1000", Args: []string{"1000:1000"}},
						{Line: 21, Command: "SHELL", Original: `SHELL ["/bin/bash", "-o", "pipefail", "-c"]`,
							Args: []string{"/bin/bash", "-o", "pipefail", "-c"}, JSON: true},
						{Line: 22, Command: "ENTRYPOINT", Original: `ENTRYPOINT ["/app/bin/server"]`, Args: []string{"/app/bin/server"}, JSON: true},
						{Line: 23, Command: "CMD", Original: `CMD ["--port", "8080"]`, Args: []string{"--port", "8080"}, JSON: true},
					}},
					{Base: "runtime", Line: 25, Steps: []*Step{
						{Line: 26, Command: "ENTRYPOINT", Original: "ENTRYPOINT /app/bin/server --debug", Args: []string{"/app/bin/server --debug"}},
						{Line: 27, Command: "CMD", Original: "CMD --port 8080", Args: []string{"--port 8080"}},
					}},
				},
			},
		},
		{
			name: "every instruction form keeps its arguments as the reference defines them",
			in:   miscInstructions,
			want: &File{Stages: []*Stage{{Base: "alpine", Name: "base", Line: 1, Steps: []*Step{
				{Line: 2, Command: "RUN", Original: "run echo hi", Args: []string{"echo hi"}},
				{Line: 3, Command: "COPY", Original: `Copy "my file.txt" 'dst dir/'`, Args: []string{`"my file.txt"`, `'dst dir/'`}},
				{Line: 4, Command: "COPY", Original: `COPY ["a b", "/c/"]`, Args: []string{"a b", "/c/"}, JSON: true},
				{Line: 5, Command: "ADD", Original: "ADD --checksum=sha256:abc --link https://example.com/x.tgz /x/",
					Flags: map[string]string{"checksum": "sha256:abc", "link": "true"}, Args: []string{"https://example.com/x.tgz", "/x/"}},
				{Line: 6, Command: "VOLUME", Original: "VOLUME /data /logs", Args: []string{"/data", "/logs"}},
				{Line: 7, Command: "VOLUME", Original: `VOLUME ["/cache"]`, Args: []string{"/cache"}, JSON: true},
				{Line: 8, Command: "VOLUME", Original: "VOLUME [/not-json]", Args: []string{"[/not-json]"}},
				{Line: 9, Command: "ARG", Original: "ARG A=1 B", Args: []string{"A=1", "B"}},
				{Line: 10, Command: "STOPSIGNAL", Original: "STOPSIGNAL SIGTERM", Args: []string{"SIGTERM"}},
				{Line: 11, Command: "MAINTAINER", Original: "MAINTAINER Jane Doe <jane@example.com>", Args: []string{"Jane", "Doe", "<jane@example.com>"}},
				{Line: 12, Command: "HEALTHCHECK", Original: "HEALTHCHECK --interval=5s CMD curl -f http://localhost/",
					Args: []string{"--interval=5s CMD curl -f http://localhost/"}},
				{Line: 13, Command: "ONBUILD", Original: "ONBUILD RUN make", Args: []string{"RUN make"}},
				{Line: 14, Command: "RUN", Original: "RUN [ -f /x ] && echo y", Args: []string{"[ -f /x ] && echo y"}},
				{Line: 15, Command: "CMD", Original: `CMD ["a", 1]`, Args: []string{`["a", 1]`}},
				{Line: 16, Command: "CMD", Original: "CMD []", Args: []string{}, JSON: true},
				{Line: 17, Command: "RUN", Original: "RUN --mount=type=cache,target=/a --mount=type=secret,id=k --network=none make",
					Flags: map[string]string{"mount": "type=cache,target=/a\ntype=secret,id=k", "network": "none"}, Args: []string{"make"}},
			}}}},
		},
		{
			name: "global args keep their defaults as written and FROM keeps its variables",
			in:   "ARG A=1 B C=\nARG D=\"x y\"\nFROM --platform=$BUILDPLATFORM ${A}-img\n",
			want: &File{
				Args:   []Arg{{Name: "A", Default: str("1")}, {Name: "B"}, {Name: "C", Default: str("")}, {Name: "D", Default: str(`"x y"`)}},
				Stages: []*Stage{{Base: "${A}-img", Platform: "$BUILDPLATFORM", Line: 3}},
			},
		},
		{
			name: "the escape directive makes the backtick continue lines and the backslash literal",
			in:   "# syntax=docker/dockerfile:1\n#escape = `\nFROM mcr.microsoft.com/windows/servercore\nCOPY testfile.txt c:\\\nRUN dir c:\\ `\n    && echo done\n",
			want: &File{Stages: []*Stage{{Base: "mcr.microsoft.com/windows/servercore", Line: 3, Steps: []*Step{
				{Line: 4, Command: "COPY", Original: `COPY testfile.txt c:\`, Args: []string{"testfile.txt", `c:\`}},
				{Line: 5, Command: "RUN", Original: `RUN dir c:\     && echo done`, Args: []string{`dir c:\     && echo done`}},
			}}}},
		},
		{
			name: "a directive after a comment is only a comment",
			in:   "# a comment\n# escape=`\nFROM alpine\nRUN echo `\nRUN echo \\\n  done\n",
			want: &File{Stages: []*Stage{{Base: "alpine", Line: 3, Steps: []*Step{
				{Line: 4, Command: "RUN", Original: "RUN echo `", Args: []string{"echo `"}},
				{Line: 5, Command: "RUN", Original: "RUN echo   done", Args: []string{"echo   done"}},
			}}}},
		},
		{
			name: "a byte order mark and CRLF line endings are ignored",
			in:   "\ufeffFROM alpine\r\nRUN a \\\r\n  b\r\n",
			want: &File{Stages: []*Stage{{Base: "alpine", Line: 1, Steps: []*Step{
				{Line: 2, Command: "RUN", Original: "RUN a   b", Args: []string{"a   b"}},
			}}}},
		},
		{
			name: "two heredocs in one RUN are read in order, <<- strips tabs and a quoted name disables expansion",
			in:   "FROM alpine\nRUN <<EOF1 cat > /a && cat <<-\"EOF2\" > /b\necho one $HOME\nEOF1\n\ttabbed $X\n\t\tdeeper\n\tEOF2\nRUN echo done\n",
			want: &File{Stages: []*Stage{{Base: "alpine", Line: 1, Steps: []*Step{
				{Line: 2, Command: "RUN", Original: `RUN <<EOF1 cat > /a && cat <<-"EOF2" > /b`, Args: []string{`<<EOF1 cat > /a && cat <<-"EOF2" > /b`},
					Heredocs: []Heredoc{
						{Name: "EOF1", Content: "echo one $HOME\n", Expand: true},
						{Name: "EOF2", Content: "tabbed $X\ndeeper\n", Chomp: true},
					}},
				{Line: 8, Command: "RUN", Original: "RUN echo done", Args: []string{"echo done"}},
			}}}},
		},
		{
			name: "a COPY heredoc keeps blank and comment lines of its body and a fd-numbered heredoc counts",
			in:   "FROM alpine\nCOPY <<'EOF' /etc/motd\nhello $USER\n\n# not a comment\nEOF\nRUN python3 - 3<<PY\nprint(1)\nPY\n",
			want: &File{Stages: []*Stage{{Base: "alpine", Line: 1, Steps: []*Step{
				{Line: 2, Command: "COPY", Original: "COPY <<'EOF' /etc/motd", Args: []string{"<<'EOF'", "/etc/motd"},
					Heredocs: []Heredoc{{Name: "EOF", Content: "hello $USER\n\n# not a comment\n"}}},
				{Line: 7, Command: "RUN", Original: "RUN python3 - 3<<PY", Args: []string{"python3 - 3<<PY"},
					Heredocs: []Heredoc{{Name: "PY", Content: "print(1)\n", Expand: true}}},
			}}}},
		},
		{
			name: "<< inside quotes, escaped, followed by a blank, in <<< or in arithmetic is not a heredoc",
			in:   "FROM alpine\nRUN echo \"<<EOF\" '<<X' \\<<Y && cat <<<\"here\" && echo $((1<<2)) << EOF\nRUN [\"sh\", \"-c\", \"cat <<EOF\"]\n",
			want: &File{Stages: []*Stage{{Base: "alpine", Line: 1, Steps: []*Step{
				{Line: 2, Command: "RUN", Original: `RUN echo "<<EOF" '<<X' \<<Y && cat <<<"here" && echo $((1<<2)) << EOF`,
					Args: []string{`echo "<<EOF" '<<X' \<<Y && cat <<<"here" && echo $((1<<2)) << EOF`}},
				{Line: 3, Command: "RUN", Original: `RUN ["sh", "-c", "cat <<EOF"]`, Args: []string{"sh", "-c", "cat <<EOF"}, JSON: true},
			}}}},
		},
		{
			name: "a file of exactly 100000 lines is accepted",
			in:   "FROM scratch\n" + strings.Repeat("\n", maxLines-1),
			want: &File{Stages: []*Stage{{Base: "scratch", Line: 1}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.in))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %s\nwant %s", dump(got), dump(tt.want))
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{"an instruction before the first FROM", "RUN echo hi\nFROM scratch", "line 1: RUN before the first FROM: only ARG may come first"},
		{"an ENV after global args but before FROM", "ARG A\n\nENV B=1\nFROM a", "line 3: ENV before the first FROM: only ARG may come first"},
		{"an unknown instruction", "FROM scratch\nFETCH x", `line 2: unknown instruction "FETCH"`},
		{"an unknown instruction before FROM", "FETCH x", `line 1: unknown instruction "FETCH"`},
		{"RUN alone", "FROM scratch\nRUN", "line 2: RUN requires an argument"},
		{"RUN with only flags", "FROM scratch\nRUN --network=none", "line 2: RUN requires an argument"},
		{"RUN with an empty JSON array", "FROM scratch\nRUN []", "line 2: RUN requires an argument"},
		{"RUN whose continuation reaches the end of the file", "FROM scratch\nRUN \\\n\n  # comment\n", "line 2: RUN requires an argument"},
		{"ENV alone", "FROM scratch\nENV", "line 2: ENV requires an argument"},
		{"EXPOSE alone", "FROM scratch\nEXPOSE", "line 2: EXPOSE requires an argument"},
		{"COPY with one word", "FROM scratch\nCOPY a", "line 2: COPY requires at least one source and a destination"},
		{"COPY with one word over two lines", "FROM scratch\nCOPY --from=x \\\n  a\n", "line 2: COPY requires at least one source and a destination"},
		{"ADD with a one-element JSON array", "FROM scratch\nADD [\"a\"]", "line 2: ADD requires at least one source and a destination"},
		{"COPY with malformed JSON", "FROM scratch\nCOPY [\"a\", \"b\"", "line 2: COPY: the arguments start with [ but are not a JSON array of strings"},
		{"SHELL in shell form", "FROM scratch\nSHELL /bin/sh -c", `line 2: SHELL requires a JSON array such as ["/bin/sh", "-c"]`},
		{"SHELL with an empty array", "FROM scratch\nSHELL []", `line 2: SHELL requires a JSON array such as ["/bin/sh", "-c"]`},
		{"FROM with nothing", "FROM", "line 1: FROM requires an argument"},
		{"FROM with only a platform", "FROM --platform=linux/arm64", "line 1: FROM requires an argument"},
		{"FROM with AS and no name", "FROM a AS", "line 1: want FROM [--platform=...] image [AS name]"},
		{"FROM with two images", "FROM a b", "line 1: want FROM [--platform=...] image [AS name]"},
		{"FROM with a word after the name", "FROM a AS b c", "line 1: want FROM [--platform=...] image [AS name]"},
		{"FROM with a bad stage name", "FROM a AS 1st", `line 1: stage name "1st" must start with a letter and hold only letters, digits, '-', '_' and '.'`},
		{"two stages with one name in different cases", "FROM a AS x\nRUN y\nFROM b AS X", `line 3: stage name "x" is already used on line 1`},
		{"FROM with a flag other than platform", "FROM --pull=always a", "line 1: FROM does not support --pull"},
		{"FROM with two unsupported flags, naming the first in order", "FROM --zz=1 --pull=always a", "line 1: FROM does not support --pull"},
		{"FROM with two platforms", "FROM --platform=a --platform=b img", "line 1: FROM --platform is given more than once"},
		{"an empty file", "", "line 1: the Dockerfile has no FROM instruction"},
		{"a file of global args only", "ARG A\n# only a comment\n", "line 2: the Dockerfile has no FROM instruction"},
		{"a heredoc without its terminator", "FROM scratch\nRUN cat <<EOF\nhello\n", `line 2: heredoc "EOF" has no terminator line`},
		{"a second heredoc whose terminator is indented without <<-", "FROM scratch\nRUN <<A <<B\na\nA\nb\n  B\n", `line 2: heredoc "B" has no terminator line`},
		{"a file larger than 1 MiB", "FROM scratch\nRUN " + strings.Repeat("x", maxSize), "line 2: the Dockerfile is larger than 1 MiB"},
		{"a file of more than 100000 lines", "FROM scratch\n" + strings.Repeat("\n", maxLines), "line 100001: the Dockerfile has more than 100000 lines"},
		{"an unterminated quote in COPY", "FROM scratch\nCOPY \"a b /c", "line 2: unterminated quote"},
		{"an unterminated quote in a flag", "FROM scratch\nRUN --mount=\"type=cache /x", "line 2: unterminated quote"},
		{"a flag with no name", "FROM scratch\nRUN --=x y", "line 2: a flag has no name"},
		{"a bare double dash", "FROM scratch\nRUN -- y", "line 2: a flag has no name"},
		{"a bad escape directive", "# escape=x\nFROM a", "line 1: the escape directive must be \\ or `, not \"x\""},
		{"a repeated escape directive", "# escape=`\n# escape=\\\nFROM a", "line 2: the escape directive is given twice"},
		{"a global ARG with an empty name", "ARG =1\nFROM a", `line 1: ARG: empty name in "=1"`},
		{"a stage ARG with an empty name", "FROM a\nARG B= =2", `line 2: ARG: empty name in "=2"`},
	}
	for _, tt := range tests {
		t.Run(tt.name+" is refused", func(t *testing.T) {
			f, err := Parse(strings.NewReader(tt.in))
			if err == nil {
				t.Fatalf("Parse succeeded: %s", dump(f))
			}
			if err.Error() != tt.want {
				t.Errorf("error %q, want %q", err, tt.want)
			}
			if k := errdefs.KindOf(err); k != errdefs.KindInvalid {
				t.Errorf("kind %q, want %q", k, errdefs.KindInvalid)
			}
		})
	}
}

func TestParseReadError(t *testing.T) {
	t.Run("a read error is returned wrapped", func(t *testing.T) {
		boom := errors.New("boom")
		_, err := Parse(iotest.ErrReader(boom))
		if !errors.Is(err, boom) || err.Error() != "read the Dockerfile: boom" {
			t.Errorf("error %v, want it to wrap boom", err)
		}
	})
}

func TestExpand(t *testing.T) {
	env := map[string]string{"A": "a", "B": "b", "E": "", "HOME": "/root"}
	lookup := func(name string) (string, bool) { v, ok := env[name]; return v, ok }
	tests := []struct {
		name    string
		word    string
		want    string
		wantErr string
	}{
		{name: "a bare name is replaced", word: "$A", want: "a"},
		{name: "a braced name is replaced", word: "${A}", want: "a"},
		{name: "an unset name becomes empty", word: "$U", want: ""},
		{name: "a bare name ends at the first non-name byte", word: "$A-x/$HOME/bin", want: "a-x//root/bin"},
		{name: "a braced name can be followed by name bytes", word: "pre${A}post", want: "preapost"},
		{name: "a bare name takes every name byte", word: "$Ax", want: ""},

		{name: ":- keeps a set value", word: "${A:-w}", want: "a"},
		{name: ":- replaces an empty value", word: "${E:-w}", want: "w"},
		{name: ":- replaces an unset value", word: "${U:-w}", want: "w"},
		{name: "- keeps a set value", word: "${A-w}", want: "a"},
		{name: "- keeps an empty value", word: "${E-w}", want: ""},
		{name: "- replaces an unset value", word: "${U-w}", want: "w"},
		{name: ":+ gives the word for a set value", word: "${A:+w}", want: "w"},
		{name: ":+ gives nothing for an empty value", word: "${E:+w}", want: ""},
		{name: ":+ gives nothing for an unset value", word: "${U:+w}", want: ""},
		{name: "+ gives the word for a set value", word: "${A+w}", want: "w"},
		{name: "+ gives the word for an empty value", word: "${E+w}", want: "w"},
		{name: "+ gives nothing for an unset value", word: "${U+w}", want: ""},
		{name: ":? keeps a set value", word: "${A:?m}", want: "a"},
		{name: ":? fails on an empty value", word: "${E:?must be set}", wantErr: "E: must be set"},
		{name: ":? fails on an unset value", word: "${U:?m}", wantErr: "U: m"},
		{name: ":? without a message says what is wrong", word: "${U:?}", wantErr: "variable U is not set or is empty"},
		{name: "? keeps a set value", word: "${A?m}", want: "a"},
		{name: "? keeps an empty value", word: "${E?m}", want: ""},
		{name: "? fails on an unset value", word: "${U?m}", wantErr: "U: m"},
		{name: "? without a message says what is wrong", word: "${U?}", wantErr: "variable U is not set"},
		{name: "the message of ? is expanded", word: "${U:?need $A}", wantErr: "U: need a"},

		{name: "a nested default is expanded", word: "${U:-${B}}", want: "b"},
		{name: "defaults nest deeper", word: "${U:-${U2:-deep}}", want: "deep"},
		{name: "an unused word is not evaluated", word: "${A:-${U:?never}}", want: "a"},
		{name: "an unused + word is not evaluated", word: "${U:+${U:?never}}", want: ""},
		{name: "a quoted default keeps its blanks and loses its quotes", word: `${U:-"x y"}`, want: "x y"},
		{name: "a quoted brace does not close the substitution", word: `${U:-"}"}`, want: "}"},
		{name: "a brace outside a substitution is literal", word: "${U:-a}b}", want: "ab}"},

		{name: "an escaped dollar is literal", word: `\$A`, want: "$A"},
		{name: "an escaped brace form is literal", word: `\${A}`, want: "${A}"},
		{name: "an escaped backslash is one backslash", word: `a\\b`, want: `a\b`},
		{name: "an escaped blank is a blank", word: `a\ b`, want: "a b"},
		{name: "a final lone backslash stays", word: `x\`, want: `x\`},
		{name: "a dollar without a name is literal", word: "$ $1 a$", want: "$ $1 a$"},

		{name: "single quotes suppress expansion and are removed", word: "'$A ${B}'", want: "$A ${B}"},
		{name: "double quotes allow expansion and are removed", word: `"$A b"`, want: "a b"},
		{name: "a single quote inside double quotes is literal", word: `"it's"`, want: "it's"},
		{name: "double quotes inside single quotes are literal", word: `'say "hi"'`, want: `say "hi"`},
		{name: "inside double quotes a backslash escapes only $, \" and \\", word: `"\$A \"q\" \\ \x"`, want: `$A "q" \ \x`},
		{name: "quoted and bare parts join", word: `a"$B"'$B'$B`, want: "ab$Bb"},

		{name: "a lone ${ is a bad substitution", word: "${", wantErr: `bad substitution in "${"`},
		{name: "an unclosed ${A is a bad substitution", word: "${A", wantErr: `bad substitution in "${A"`},
		{name: "an unknown operator is a bad substitution", word: "${A:x}", wantErr: `bad substitution in "${A:x}"`},
		{name: "a pattern operator is a bad substitution", word: "${A%x}", wantErr: `bad substitution in "${A%x}"`},
		{name: "an empty name is a bad substitution", word: "${}", wantErr: `bad substitution in "${}"`},
		{name: "a colon at the end is a bad substitution", word: "${A:", wantErr: `bad substitution in "${A:"`},
		{name: "an unclosed default is a bad substitution", word: "${A:-b", wantErr: `bad substitution in "${A:-b"`},
		{name: "an unclosed substitution inside quotes is a bad substitution", word: `"${A"`, wantErr: `bad substitution in "\"${A\""`},
		{name: "an unclosed single quote is an error", word: "'a", wantErr: `unterminated single quote in "'a"`},
		{name: "an unclosed double quote is an error", word: `"a`, wantErr: `unterminated double quote in "\"a"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Expand(tt.word, lookup)
			if tt.wantErr != "" {
				if err == nil || err.Error() != tt.wantErr {
					t.Fatalf("Expand(%q) = %q, %v; want error %q", tt.word, got, err, tt.wantErr)
				}
				if k := errdefs.KindOf(err); k != errdefs.KindInvalid {
					t.Errorf("kind %q, want %q", k, errdefs.KindInvalid)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("Expand(%q) = %q, %v; want %q", tt.word, got, err, tt.want)
			}
		})
	}
	t.Run("a nil lookup sets nothing", func(t *testing.T) {
		if got, err := Expand("${A:-d}$A", nil); err != nil || got != "d" {
			t.Errorf("got %q, %v; want \"d\"", got, err)
		}
	})
}

func TestKeyValues(t *testing.T) {
	env := map[string]string{"HOME": "/root", "A": "old"}
	lookup := func(name string) (string, bool) { v, ok := env[name]; return v, ok }
	tests := []struct {
		name    string
		line    string // an instruction, parsed as line 2 after a FROM
		want    [][2]string
		wantErr string
	}{
		{
			name: "the modern form gives every pair with quotes removed, escapes honoured and variables expanded",
			line: `ENV A=1 B="two words" C=a\ b D='$HOME' E=$HOME F= G="x=y"`,
			want: [][2]string{{"A", "1"}, {"B", "two words"}, {"C", "a b"}, {"D", "$HOME"}, {"E", "/root"}, {"F", ""}, {"G", "x=y"}},
		},
		{
			name: "pairs of one ENV do not see each other",
			line: "ENV A=new B=$A",
			want: [][2]string{{"A", "new"}, {"B", "old"}},
		},
		{
			name: "a LABEL may quote its keys and span lines",
			line: "LABEL \"com.example.vendor\"=\"ACME Inc\" \\\n  version=1.0",
			want: [][2]string{{"com.example.vendor", "ACME Inc"}, {"version", "1.0"}},
		},
		{
			name: "the legacy form takes the rest of the line as the value",
			line: `ENV GREETING hello   "big" world`,
			want: [][2]string{{"GREETING", "hello   big world"}},
		},
		{
			name: "the legacy form expands its value",
			line: "ENV PATH $HOME/bin:$PATH",
			want: [][2]string{{"PATH", "/root/bin:"}},
		},
		{
			name: "the legacy form keeps later equals signs in the value",
			line: "LABEL note a=b",
			want: [][2]string{{"note", "a=b"}},
		},
		{name: "an empty key is refused", line: "ENV =1", wantErr: `line 2: ENV: empty key in "=1"`},
		{name: "a key that expands to nothing is refused", line: "LABEL ${U}=1", wantErr: `line 2: LABEL: empty key in "${U}=1"`},
		{name: "a word without = after a pair is refused", line: "ENV A=1 B", wantErr: `line 2: ENV: "B" is not of the form KEY=value`},
		{name: "a legacy key without a value is refused", line: "ENV A", wantErr: "line 2: ENV A has no value; write ENV A=value"},
		{name: "an unterminated quote is refused", line: `LABEL a="b`, wantErr: "line 2: LABEL: unterminated quote"},
		{name: "a bad substitution is refused with its line", line: "ENV A=${B", wantErr: `line 2: bad substitution in "${B"`},
		{name: "a required variable that is unset is refused with its line", line: "ENV A=${U:?needed}", wantErr: "line 2: U: needed"},
		{name: "a step that is not ENV or LABEL is refused", line: "RUN A=1", wantErr: "line 2: RUN has no key-value pairs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := Parse(strings.NewReader("FROM scratch\n" + tt.line + "\n"))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			got, err := KeyValues(f.Stages[0].Steps[0], lookup)
			if tt.wantErr != "" {
				if err == nil || err.Error() != tt.wantErr {
					t.Fatalf("got %q, %v; want error %q", got, err, tt.wantErr)
				}
				if k := errdefs.KindOf(err); k != errdefs.KindInvalid {
					t.Errorf("kind %q, want %q", k, errdefs.KindInvalid)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}
