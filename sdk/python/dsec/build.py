"""Image builds: a Dockerfile built by the dsec server, and its context.

    img = client.build_image("task-42", "./environment")               # ./environment/Dockerfile
    img = client.build_image("t", "./env", dockerfile="gpu.Dockerfile",
                             build_args={"PY": "3.11"}, target="runtime",
                             on_progress=lambda p: print(p.get("message", "")))
    with client.create("task-42") as sb: ...
    sb.commit("checkpoint")                                              # a running sandbox as an image
    client.prune_build_cache()

The server runs each RUN step in a sandbox of the caller's project and
caches every step that changes files (docs/images.md); this module sends
the context directory as a tar, leaving out what its ``.dockerignore``
excludes, with Docker's rules (:class:`DockerIgnore`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
import re
import stat
import tarfile
import tempfile
from typing import IO, Iterator, List, Optional, Tuple

_CHUNK = 1 << 20


class DockerIgnore:
    """A parsed ``.dockerignore``: one pattern a line, ``#`` comments, a
    leading ``!`` re-includes what earlier lines excluded, patterns are
    relative to the context root (a leading ``/`` is dropped), ``*``, ``?``
    and ``[...]`` match within a path element, ``**`` any number of
    elements. A pattern that matches a directory excludes what is inside
    it; the last matching line decides."""

    def __init__(self, text: str = "") -> None:
        self._patterns: List[Tuple[List[str], bool]] = []
        for n, line in enumerate(text.splitlines(), 1):
            if n == 1:
                line = line.lstrip("\ufeff")
            if line.startswith("#"):  # as Docker: before trimming
                continue
            line = line.strip()
            if not line:
                continue
            exception = line.startswith("!")
            if exception:
                line = line[1:].strip()
                if not line:
                    raise ValueError(f".dockerignore line {n}: '!' names no pattern")
            clean = posixpath.normpath(line)
            if len(clean) > 1:
                clean = clean.lstrip("/")
            if clean in (".", ""):
                continue
            elems: List[str] = []
            for e in clean.split("/"):
                if e == "**" and elems and elems[-1] == "**":
                    continue
                if e.count("[") != e.count("]"):
                    raise ValueError(f".dockerignore line {n}: bad pattern {line!r}")
                elems.append(e)
            self._patterns.append((elems, exception))

    @classmethod
    def of(cls, context: str) -> "DockerIgnore":
        """The context's ``.dockerignore`` (none: nothing is excluded)."""
        try:
            with open(os.path.join(context, ".dockerignore"), encoding="utf-8") as f:
                return cls(f.read())
        except FileNotFoundError:
            return cls()

    def excluded(self, rel: str) -> bool:
        """Whether the context path ``rel`` (slash-separated, relative to
        the root) is left out of the context."""
        rel = posixpath.normpath(rel.replace(os.sep, "/")).lstrip("/")
        if rel in ("", "."):
            return False
        name = rel.split("/")
        out = False
        for elems, exception in self._patterns:
            if exception != out:  # an exclusion cannot change an excluded path, nor an exception an included one
                continue
            if any(_match(elems, name[:k]) for k in range(len(name), 0, -1)):
                out = not exception
        return out

    def may_include_below(self, rel: str) -> bool:
        """Whether an exception could re-include something strictly below
        the excluded directory ``rel`` (so it must be walked)."""
        d = posixpath.normpath(rel).split("/")
        for elems, exception in self._patterns:
            if exception and _prefix_match(elems, d):
                return True
        return False


def _elem_match(pat: str, name: str) -> bool:
    # fnmatch's rules within one element; "*" never crosses a "/" here since
    # elements have none. Escapes are taken literally, as on Linux.
    return re.fullmatch(fnmatch.translate(pat), name) is not None


def _match(pat: List[str], name: List[str]) -> bool:
    if not pat:
        return not name
    if pat[0] == "**":
        if len(pat) == 1:
            return len(name) > 0
        return any(_match(pat[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and _elem_match(pat[0], name[0]) and _match(pat[1:], name[1:])


def _prefix_match(pat: List[str], d: List[str]) -> bool:
    for i, e in enumerate(pat):
        if e == "**" or i == len(d):
            return True
        if not _elem_match(e, d[i]):
            return False
    return False


def _entries(context: str) -> Iterator[Tuple[str, os.stat_result]]:
    """What the context sends, in order: (slash-separated path, lstat) of
    each file, directory and symlink that ``.dockerignore`` leaves in, a
    directory before what it holds, the parents of an exception below an
    excluded directory before it."""
    if not os.path.isdir(context):
        raise ValueError(f"build context {context!r} is not a directory")
    ignore = DockerIgnore.of(context)
    sent = set()

    def entry(rel: str) -> Iterator[Tuple[str, os.stat_result]]:
        parent = posixpath.dirname(rel)
        if parent and parent not in sent:
            yield from entry(parent)
        sent.add(rel)
        yield rel, os.lstat(os.path.join(context, rel))

    def walk(rel: str) -> Iterator[Tuple[str, os.stat_result]]:
        d = os.path.join(context, rel) if rel else context
        for name in sorted(os.listdir(d)):
            r = posixpath.join(rel, name) if rel else name
            is_dir = stat.S_ISDIR(os.lstat(os.path.join(d, name)).st_mode)
            if ignore.excluded(r):
                if is_dir and ignore.may_include_below(r):
                    yield from walk(r)  # an exception below it
                continue
            yield from entry(r)
            if is_dir:
                yield from walk(r)

    return walk("")


def context_tar(context: str, out: IO[bytes]) -> int:
    """Write the build context ``context`` to ``out`` as an uncompressed tar:
    regular files, directories and symlinks (never followed), in a fixed
    order, with numeric owners and modes; what ``.dockerignore`` excludes
    is left out (sockets, devices and fifos too). Returns the number of
    regular files written."""
    files = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tw:
        for rel, st in _entries(context):
            p = os.path.join(context, rel)
            ti = tarfile.TarInfo(rel)
            ti.mode, ti.uid, ti.gid, ti.mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)
            ti.uname = ti.gname = ""
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                tw.addfile(ti)
            elif stat.S_ISLNK(st.st_mode):
                ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(p)
                tw.addfile(ti)
            elif stat.S_ISREG(st.st_mode):
                ti.size = st.st_size
                with open(p, "rb") as f:
                    tw.addfile(ti, f)
                files += 1
    return files


def context_digest(context: str) -> str:
    """A digest of the context's content as a build sees it: each path
    sent, its type, its mode bits and its content or link target (not its
    times or owners), so copies of one environment digest alike."""
    h = hashlib.sha256()
    for rel, st in _entries(context):
        p = os.path.join(context, rel)
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        h.update(f"{len(rel)}:{rel}\0{stat.S_IFMT(st.st_mode):o}\0{stat.S_IMODE(st.st_mode):o}\0{size}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            link = os.readlink(p).encode()
            h.update(f"{len(link)}:".encode() + link)
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                for b in iter(lambda: f.read(_CHUNK), b""):
                    h.update(b)
        h.update(b"\0")
    return h.hexdigest()


def context_chunks(context: str) -> Iterator[bytes]:
    """The context's tar (see :func:`context_tar`) in chunks, spooled
    through a temporary file so a large context is not held in memory."""
    with tempfile.TemporaryFile() as f:
        context_tar(context, f)
        f.seek(0)
        while True:
            b = f.read(_CHUNK)
            if not b:
                return
            yield b


def from_map(dockerfile: str, image_map: Optional[dict]) -> str:
    """The Dockerfile with each FROM image that ``image_map`` names
    replaced by its dsec name (stage names and ``scratch`` stay)."""
    if not image_map:
        return dockerfile

    def repl(m: "re.Match[str]") -> str:
        return m.group(1) + image_map.get(m.group(2), m.group(2))

    return re.sub(r"(?im)^(\s*FROM\s+(?:--\S+\s+)*)(\S+)", repl, dockerfile)


__all__ = ["DockerIgnore", "context_tar", "context_chunks", "context_digest", "from_map"]
