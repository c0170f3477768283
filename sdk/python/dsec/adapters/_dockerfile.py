"""Task environments from the task: a Dockerfile built through dsec.

A task directory (Harbor, terminal-bench, tinker's harbor_rl) brings an
``environment/Dockerfile``. For kind ``container`` the dsec server builds it
(``Client.build_image``, docs/images.md): the whole Dockerfile with Docker's
meaning (multi-stage, ADD of archives, ENTRYPOINT/CMD kept in the image),
each step cached by the server. The image is named after a digest of what
the build reads (the Dockerfile with ``image_map`` applied, the kind, the
build network, and the context's content as ``.dockerignore`` leaves it,
without times or owners), so an unchanged environment is one image per
server: a GRPO group of trials, and later runs, start from it. What the
server does not build is UnsupportedOption; a failing step is BuildFailed.

Machine kinds (microvm, vm) have no layer builds: there the build runs in a
sandbox of the kind: it starts from the FROM image (an image the dsec server
already has, under that name or mapped with ``image_map``), runs the RUN
steps, copies the COPY/ADD sources from the build context, and snapshots
the result, named as above. ENV, WORKDIR and USER become the sandboxes'
defaults. Instructions that have no meaning for a sandbox whose first
process is dsec's agent are recorded nowhere there: CMD, ENTRYPOINT,
EXPOSE, LABEL, MAINTAINER, STOPSIGNAL; and it refuses with UnsupportedOption
multi-stage builds (a second FROM, AS names, COPY --from), RUN flags
(--mount, --network, --security), SHELL, HEALTHCHECK, ONBUILD, FROM
--platform, ADD of a URL or of a local archive (which Docker would unpack).
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import os
import re
import shlex
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..aio import AsyncClient, AsyncSandbox
from ..build import DockerIgnore, context_digest, from_map
from ..errors import DsecError, InvalidRequest, NotFound, Unimplemented
from ._common import UnsupportedOption

#: the PATH a container sandbox has when its image sets none
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL"}
_ARCHIVE = re.compile(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2|tar\.xz|txz)$")


class BuildFailed(RuntimeError):
    """A build step failed (the environment definition's fault, not dsec's:
    do not retry it)."""


@dataclass
class Step:
    op: str  # RUN, COPY, WORKDIR (mkdir)
    args: Any
    env: Dict[str, str]
    workdir: str
    user: str
    flags: Dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    """A parsed Dockerfile: where to start, what to run, and the defaults
    the result's sandboxes get."""

    base: str
    steps: List[Step]
    env: Dict[str, str]
    workdir: str
    user: str
    sources: List[str]  # context-relative files COPY/ADD read


def _expand(s: str, vars: Mapping[str, str]) -> str:
    def sub(m: "re.Match[str]") -> str:
        name = m.group(1) or m.group(2)
        default = m.group(3)
        v = vars.get(name)
        if v is None or v == "":
            return default if default is not None else (v or "")
        return v

    return re.sub(r"\$(?:(\w+)|\{(\w+)(?::-([^}]*))?\})", sub, s)


def _lines(text: str) -> List[Tuple[str, str]]:
    """(INSTRUCTION, rest) pairs: continuations joined, comments dropped."""
    out: List[Tuple[str, str]] = []
    cur = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        parts = cur.strip().split(None, 1)
        out.append((parts[0].upper(), parts[1] if len(parts) > 1 else ""))
        cur = ""
    if cur.strip():
        parts = cur.strip().split(None, 1)
        out.append((parts[0].upper(), parts[1] if len(parts) > 1 else ""))
    return out


def _flags(rest: str) -> Tuple[Dict[str, str], str]:
    flags: Dict[str, str] = {}
    while rest.startswith("--"):
        tok, _, rest = rest.partition(" ")
        k, _, v = tok[2:].partition("=")
        flags[k] = v
        rest = rest.lstrip()
    return flags, rest


def _json_or_words(rest: str) -> List[str]:
    if rest.startswith("["):
        try:
            v = json.loads(rest)
            if isinstance(v, list):
                return [str(x) for x in v]
        except ValueError:
            pass
    return shlex.split(rest)


def parse(text: str, context: str, where: str = "Dockerfile",
          base_env: Optional[Callable[[str], Mapping[str, str]]] = None) -> Plan:
    """Parse a Dockerfile; raise UnsupportedOption for what cannot be built.
    ``base_env(image)`` is the FROM image's environment, which ENV, WORKDIR
    and COPY expand variables from (``ENV PATH=/opt/bin:$PATH``)."""
    vars: Dict[str, str] = {}
    env: Dict[str, str] = {}
    inherited: Dict[str, str] = {}
    workdir, user = "", ""
    base = ""
    steps: List[Step] = []
    sources: List[str] = []
    ignore = DockerIgnore.of(context)
    for op, rest in _lines(text):
        if op == "FROM":
            if base:
                raise UnsupportedOption(where, "a multi-stage build (a second FROM)", "build one stage")
            flags, rest = _flags(rest)
            if flags:
                raise UnsupportedOption(where, "FROM --" + next(iter(flags)), "no FROM flags")
            words = rest.split()
            if len(words) > 1:
                raise UnsupportedOption(where, f"FROM ... {' '.join(words[1:])}", "named stages need a multi-stage build")
            base = _expand(words[0], vars)
            inherited = dict(base_env(base)) if base_env else {}
        elif op == "ARG":
            for item in shlex.split(rest):
                k, eq, v = item.partition("=")
                if k not in vars:
                    vars[k] = v if eq else vars.get(k, "")
        elif op == "ENV":
            items = shlex.split(rest)
            if items and "=" not in items[0]:  # ENV key value (the legacy form)
                items = [items[0] + "=" + " ".join(items[1:])]
            for item in items:
                k, _, v = item.partition("=")
                v = _expand(v, {**inherited, **vars, **env})
                env[k] = vars[k] = v
        elif op == "WORKDIR":
            w = _expand(rest.strip(), {**inherited, **vars, **env})
            workdir = w if w.startswith("/") else os.path.join(workdir or "/", w)
            steps.append(Step("WORKDIR", workdir, dict(env), workdir, user))
        elif op == "USER":
            user = _expand(rest.strip(), {**inherited, **vars, **env})
        elif op == "RUN":
            flags, rest = _flags(rest)
            if flags:
                raise UnsupportedOption(where, "RUN --" + next(iter(flags)), "RUN takes no flags here")
            argv = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            steps.append(Step("RUN", argv, {**inherited, **vars, **env}, workdir, user))
        elif op in ("COPY", "ADD"):
            flags, rest = _flags(rest)
            for k in flags:
                if k not in ("chown", "chmod"):
                    raise UnsupportedOption(where, f"{op} --{k}", "COPY/ADD take --chown and --chmod only")
            words = [_expand(w, {**inherited, **vars, **env}) for w in _json_or_words(rest)]
            if len(words) < 2:
                raise BuildFailed(f"{where}: {op} needs a source and a destination")
            srcs, dest = words[:-1], words[-1]
            files: List[Tuple[str, str]] = []  # (context-relative source, destination path)
            for src in srcs:
                if op == "ADD" and re.match(r"^[a-z]+://", src):
                    raise UnsupportedOption(where, f"ADD {src}", "ADD of a URL (download it in a RUN step)")
                if op == "ADD" and _ARCHIVE.search(src):
                    raise UnsupportedOption(where, f"ADD {src}", "ADD of an archive, which Docker unpacks (use COPY and RUN tar)")
                files += _resolve(context, src, dest, len(srcs) > 1 or dest.endswith("/"), workdir, ignore, where)
            sources += [f for f, _ in files]
            steps.append(Step("COPY", files, dict(env), workdir, user, flags))
        elif op == "VOLUME":
            for d in _json_or_words(rest):
                steps.append(Step("WORKDIR", _expand(d, {**inherited, **vars, **env}), dict(env), workdir, user))
        elif op in _IGNORED:
            continue
        else:
            raise UnsupportedOption(where, op, "the builder runs FROM, ARG, ENV, WORKDIR, USER, RUN, COPY, ADD, VOLUME")
    if not base:
        raise BuildFailed(f"{where}: no FROM")
    return Plan(base=base, steps=steps, env=env, workdir=workdir, user=user, sources=sources)


def _resolve(context: str, src: str, dest: str, dest_is_dir: bool, workdir: str, ignore: DockerIgnore,
             where: str) -> List[Tuple[str, str]]:
    root = os.path.realpath(context)
    if not dest.startswith("/"):
        dest = os.path.join(workdir or "/", dest)
    matches = sorted(glob.glob(os.path.join(root, src))) if any(c in src for c in "*?[") else [os.path.join(root, src)]
    out: List[Tuple[str, str]] = []
    for m in matches:
        real = os.path.realpath(m)
        if not (real == root or real.startswith(root + os.sep)):
            raise BuildFailed(f"{where}: COPY {src}: outside the build context")
        if not os.path.exists(real):
            raise BuildFailed(f"{where}: COPY {src}: no such file in the build context")
        if os.path.isdir(real):
            for d, _, fs in os.walk(real):
                for f in fs:
                    p = os.path.join(d, f)
                    rel = os.path.relpath(p, root)
                    if not ignore.excluded(rel):
                        out.append((rel, os.path.join(dest, os.path.relpath(p, real))))
        else:
            rel = os.path.relpath(real, root)
            if ignore.excluded(rel):
                continue
            out.append((rel, os.path.join(dest, os.path.basename(real)) if dest_is_dir else dest))
    return out


@dataclass
class Image:
    """Where a task's sandboxes start: a dsec image, or a built snapshot,
    with the defaults the Dockerfile set."""

    image: Optional[str] = None
    snapshot: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    built: bool = False  # this call ran the build

    def spec(self) -> Dict[str, Any]:
        """Keywords for AsyncClient.create."""
        kw: Dict[str, Any] = {}
        if self.snapshot:
            kw["from_snapshot"] = self.snapshot
        else:
            kw["image"] = self.image
        if self.env:
            kw["env"] = dict(self.env)
        if self.workdir:
            kw["workdir"] = self.workdir
        if self.user:
            kw["user"] = self.user
        return kw


_locks: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[str, asyncio.Lock]]" = weakref.WeakKeyDictionary()


class Builder:
    """Builds task environments through one dsec server, once per content."""

    def __init__(self, client: AsyncClient, *, kind: str = "container", image_map: Optional[Mapping[str, str]] = None,
                 network: str = "egress", cpu: Optional[float] = None, memory_mb: Optional[int] = None,
                 timeout_s: float = 1800, prefix: str = "dsec-build-") -> None:
        self.client, self.kind = client, kind
        self.image_map = dict(image_map or {})
        self.network, self.cpu, self.memory_mb = network, cpu, memory_mb
        self.timeout_s, self.prefix = timeout_s, prefix

    async def image_for(self, context: str, *, force: bool = False, dockerfile: str = "Dockerfile") -> Image:
        """The image or snapshot the environment in ``context`` runs on,
        built if no build of the same content exists (or ``force``)."""
        path = os.path.join(context, dockerfile)
        with open(path) as f:
            text = f.read()
        if self.kind == "container":
            return await self._build_image(context, path, dockerfile, text, force)
        images = {i.get("name"): i for i in await self.client.images()}

        def base_env(name: str) -> Dict[str, str]:
            cfg = images.get(self.image_map.get(name, name), {}).get("config") or {}
            env = dict(e.split("=", 1) for e in cfg.get("env") or [] if "=" in e)
            env.setdefault("PATH", _DEFAULT_PATH)
            return env

        plan = parse(text, context, where=path, base_env=base_env)
        base = self.image_map.get(plan.base, plan.base)
        if base not in images:
            raise UnsupportedOption(path, f"FROM {plan.base}",
                                    f"the dsec server has no image {base!r}; import it under that name "
                                    f"(dsec image pull / dsec image upload) or map it with image_map")
        defaults = dict(env=plan.env, workdir=plan.workdir, user=plan.user)
        if not any(s.op in ("RUN", "COPY") for s in plan.steps) and not any(s.op == "WORKDIR" for s in plan.steps):
            return Image(image=base, **defaults)
        key = self._key(context, plan, base, images[base].get("digest", ""), text)
        name = self.prefix + key[:24]
        lock = _locks.setdefault(asyncio.get_running_loop(), {}).setdefault(name, asyncio.Lock())
        async with lock:
            if not force:
                snap = await self._find(name)
                if snap:
                    return Image(snapshot=snap, **defaults)
            snap = await self._build(context, plan, base, name)
            return Image(snapshot=snap, built=True, **defaults)

    async def _build_image(self, context: str, path: str, dockerfile: str, text: str, force: bool) -> Image:
        """The image the server builds from the Dockerfile, once per content."""
        text = from_map(text, self.image_map)
        h = hashlib.sha256()
        for part in (self.kind, self.network, text, context_digest(context)):
            h.update(part.encode() + b"\0")
        name = self.prefix + h.hexdigest()[:24]
        lock = _locks.setdefault(asyncio.get_running_loop(), {}).setdefault(name, asyncio.Lock())
        async with lock:
            if not force and name in {i.get("name") for i in await self.client.images()}:
                return Image(image=name)
            try:
                await self.client.build_image(name, context, dockerfile_text=text, no_cache=force, network=self.network,
                                              cpu=self.cpu, memory_mb=self.memory_mb, step_timeout_s=int(self.timeout_s))
            except Unimplemented as e:
                raise UnsupportedOption(path, e.message, "dsec image build does not build it") from e
            except NotFound as e:
                raise UnsupportedOption(path, e.message, "import the image under that name (dsec image import) "
                                        "or map it with image_map") from e
            except InvalidRequest as e:
                raise BuildFailed(f"{path}: {e.message}") from e
            return Image(image=name, built=True)

    def _key(self, context: str, plan: Plan, base: str, digest: str, text: str) -> str:
        h = hashlib.sha256()
        for part in (base, digest, self.kind, self.network, text):
            h.update(part.encode() + b"\0")
        for rel in sorted(set(plan.sources)):
            p = os.path.join(context, rel)
            h.update(rel.encode() + b"\0" + oct(os.stat(p).st_mode & 0o7777).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        return h.hexdigest()

    async def _find(self, name: str) -> Optional[str]:
        snaps = [s for s in await self.client.snapshots() if s.name == name]
        return sorted(snaps, key=lambda s: s.id)[0].id if snaps else None

    async def _build(self, context: str, plan: Plan, base: str, name: str) -> str:
        kw: Dict[str, Any] = {"image": base, "kind": self.kind, "network": self.network, "ttl_s": int(self.timeout_s) + 600,
                              "labels": {"dsec-build": name[len(self.prefix):][:60]}}
        if self.cpu:
            kw["cpu"] = self.cpu
        if self.memory_mb:
            kw["memory_mb"] = self.memory_mb
        sb = await self.client.create(**kw)
        try:
            for st in plan.steps:
                await self._step(sb, context, st)
            return (await sb.snapshot(name)).id
        finally:
            try:
                await sb.close()
            except DsecError:
                pass

    async def _step(self, sb: AsyncSandbox, context: str, st: Step) -> None:
        if st.op == "WORKDIR":
            await self._run(sb, ["mkdir", "-p", st.args], st, user="root", cwd="/")
        elif st.op == "RUN":
            await self._run(sb, st.args, st)
        elif st.op == "COPY":
            for rel, dest in st.args:
                await sb.upload(os.path.join(context, rel), dest)
            dests = [d for _, d in st.args]
            if st.flags.get("chown") and dests:
                await self._run(sb, ["chown", st.flags["chown"], *dests], st, user="root")
            if st.flags.get("chmod") and dests:
                await self._run(sb, ["chmod", st.flags["chmod"], *dests], st, user="root")

    async def _run(self, sb: AsyncSandbox, argv: List[str], st: Step, user: Optional[str] = None,
                   cwd: Optional[str] = None) -> None:
        r = await sb.exec(argv, env=st.env or None, cwd=cwd or st.workdir or None, user=user or st.user or None,
                          timeout_s=self.timeout_s)
        if r.exit_code != 0 or r.timed_out:
            tail = (r.stderr or r.stdout)[-2000:]
            raise BuildFailed(f"{' '.join(argv)[:200]!r} exited {r.exit_code}"
                              f"{' (timed out)' if r.timed_out else ''}: {tail}")
