"""The synchronous client and the sandbox handle."""

from __future__ import annotations

import base64
import os
import shlex
import urllib.parse
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _wire
from .build import context_chunks, from_map
from .compose import interpolate, shared_volume_wire, sidecar_wire
from .errors import DsecError, NotFound, SandboxGone, make_error
from .events import (EventStream, Webhook, create_webhook, delete_webhook, enable_webhook, list_webhooks,
                     subscribe)
from .network import Network, NetworkLog, NetworkPolicy, PolicyLike, policy_wire
from .volumes import _VOLUMES, MountLike, Volume, mount_wire

DEFAULT_URL = "http://127.0.0.1:7070"
# The sandbox API, one service per role (api/dsec/v1/sandbox.proto).
_LIFECYCLE = "dsec.v1.LifecycleService"
_PROCESS = "dsec.v1.ProcessService"
_FILES = "dsec.v1.FilesystemService"
_SNAPSHOTS = "dsec.v1.SnapshotService"
_LOGS = "dsec.v1.LogService"
_SCREEN = "dsec.v1.ScreenService"
_IMAGE = "dsec.v1.ImageService"
_SYSTEM = "dsec.v1.SystemService"

Command = Union[str, Sequence[str]]


def _int(v: Any) -> int:
    return int(v) if v not in (None, "") else 0


@dataclass
class ExecResult:
    """The result of a command. ``return_code`` is an alias of
    ``exit_code``; ``output`` is stdout followed by stderr; iterating gives
    ``(exit_code, stdout, stderr)``."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0
    signal: str = ""
    oom_killed: bool = False
    process_id: str = ""
    #: position in the sandbox's trajectory log
    seq: int = 0
    #: True when the result was answered from the log (a repeated request_id)
    replayed: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def return_code(self) -> int:
        return self.exit_code

    @property
    def returncode(self) -> int:
        return self.exit_code

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def __iter__(self) -> Iterator[Any]:
        return iter((self.exit_code, self.stdout, self.stderr))

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "ExecResult":
        return cls(
            exit_code=_int(m.get("exitCode")),
            stdout_bytes=_wire.unb64(m.get("stdout")),
            stderr_bytes=_wire.unb64(m.get("stderr")),
            timed_out=bool(m.get("timedOut")),
            truncated=bool(m.get("truncated")),
            duration_ms=_int(m.get("durationMs")),
            signal=m.get("signal", ""),
            oom_killed=bool(m.get("oomKilled")),
            process_id=m.get("processId", ""),
            seq=_int(m.get("seq")),
            replayed=bool(m.get("replayed")),
        )


@dataclass
class ExecEvent:
    """One event of a streaming command: kind is "started", "stdout",
    "stderr" or "exit"."""

    kind: str
    data: bytes = b""
    result: Optional[ExecResult] = None
    process_id: str = ""


@dataclass
class FileInfo:
    path: str
    name: str
    type: str
    size: int
    mode: int
    mtime: str = ""
    symlink_target: str = ""
    owner: str = ""
    group: str = ""
    #: a write with a request_id answered from the trajectory log
    replayed: bool = False

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "FileInfo":
        return cls(
            path=m.get("path", ""), name=m.get("name", ""), type=m.get("type", ""), size=_int(m.get("size")),
            mode=_int(m.get("mode")), mtime=m.get("mtime", ""), symlink_target=m.get("symlinkTarget", ""),
            owner=m.get("owner", ""), group=m.get("group", ""), replayed=bool(m.get("replayed")),
        )


@dataclass
class SnapshotInfo:
    id: str
    name: str
    sandbox_id: str
    image: str
    size_bytes: int

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "SnapshotInfo":
        return cls(id=m.get("id", ""), name=m.get("name", ""), sandbox_id=m.get("sandboxId", ""),
                   image=m.get("image", ""), size_bytes=_int(m.get("sizeBytes")))


@dataclass
class SandboxInfo:
    id: str
    node: str
    state: str
    reason: str
    kind: str
    image: str
    labels: Dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    expires_at: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
    runtime: str = ""  # "" is the kind's default runtime
    on_timeout: str = ""  # "" or "delete": the TTL ends the sandbox; "pause": it pauses; "pause_filesystem": filesystem-only
    # An ended sandbox's end: when, its class (deleted, session_expired, ttl, idle_ttl,
    # paused_ttl, workload_exit, oom, died, pause_failed, node_down) and whether
    # the platform ended it.
    ended_at: str = ""
    end_cause: str = ""
    infra: bool = False
    # Each sidecar's status: {"name", "state" (starting, running, healthy,
    # unhealthy, exited), "exitCode", "healthOutput"}.
    sidecars: List[Dict[str, Any]] = field(default_factory=list)

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "SandboxInfo":
        spec = m.get("spec") or {}
        return cls(
            id=m.get("id", ""), node=m.get("node", ""), state=m.get("state", ""), reason=m.get("reason", ""),
            kind=spec.get("kind", ""), image=spec.get("image", ""), labels=dict(spec.get("labels") or {}),
            created_at=m.get("createdAt", ""), expires_at=m.get("expiresAt", ""), raw=m,
            runtime=spec.get("runtime", ""), on_timeout=spec.get("onTimeout", ""),
            ended_at=m.get("endedAt", ""), end_cause=m.get("endCause", ""), infra=bool(m.get("infra", False)),
            sidecars=list(m.get("sidecars") or []),
        )


@dataclass
class StatsSample:
    """One sample of a sandbox's use (``at`` is RFC 3339)."""

    at: str
    cpu_time_ms: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0
    pids: int = 0


@dataclass
class Stats:
    """A sandbox's resource use now (CPU time since it started, memory,
    disk, processes, OOM kills, its limits) and, when asked for,
    ``history``: the samples the node kept (every 5 s, the last 15
    minutes), oldest first."""

    cpu_time_ms: int
    memory_bytes: int
    pids: int
    oom_kills: int
    cpu_limit: float
    memory_limit_mb: int
    disk_bytes: int = 0
    disk_limit_mb: int = 0
    history: List[StatsSample] = field(default_factory=list)

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "Stats":
        return cls(
            cpu_time_ms=_int(m.get("cpuTimeMs")), memory_bytes=_int(m.get("memoryBytes")), pids=_int(m.get("pids")),
            oom_kills=_int(m.get("oomKills")), cpu_limit=float(m.get("cpuLimit") or 0),
            memory_limit_mb=_int(m.get("memoryLimitMb")), disk_bytes=_int(m.get("diskBytes")),
            disk_limit_mb=_int(m.get("diskLimitMb")),
            history=[StatsSample(at=h.get("at", ""), cpu_time_ms=_int(h.get("cpuTimeMs")), memory_bytes=_int(h.get("memoryBytes")),
                                 disk_bytes=_int(h.get("diskBytes")), pids=_int(h.get("pids"))) for h in m.get("history") or []],
        )


def _call(sandbox_id: str, container: str, **kw: Any) -> Dict[str, Any]:
    """A request naming a sandbox and, for a sidecar, its container."""
    req: Dict[str, Any] = {"sandboxId": sandbox_id}
    if container:
        req["container"] = container
    req.update(kw)
    return req


def _exec_request(sandbox_id: str, cmd: Command, *, timeout_s: Optional[float], stdin: Union[bytes, str, None],
                  env: Optional[Mapping[str, str]], cwd: Optional[str], user: Optional[str],
                  max_output_bytes: Optional[int], pty: bool = False, tag: Optional[str] = None,
                  request_id: Optional[str] = None, container: str = "") -> Dict[str, Any]:
    req = _call(sandbox_id, container)
    if request_id:
        req["requestId"] = request_id
    if isinstance(cmd, str):
        req["cmd"] = cmd
    else:
        req["argv"] = [str(a) for a in cmd]
    if timeout_s:
        req["timeoutS"] = float(timeout_s)
    if stdin is not None:
        req["stdin"] = _wire.b64(stdin.encode() if isinstance(stdin, str) else bytes(stdin))
    if env:
        req["env"] = {str(k): str(v) for k, v in env.items()}
    if cwd:
        req["cwd"] = cwd
    if user:
        req["user"] = user
    if max_output_bytes:
        req["maxOutputBytes"] = str(int(max_output_bytes))
    if pty:
        req["pty"] = True
    if tag:
        req["tag"] = tag
    return req


def _event_of(m: Dict[str, Any], pid: str) -> Optional[ExecEvent]:
    """The ExecEvent of one message of an ExecStream or ConnectProcess
    stream (None for a keepalive); pid is the process's, once started."""
    if "started" in m:
        return ExecEvent("started", process_id=m["started"].get("processId", ""))
    if "stdout" in m:
        return ExecEvent("stdout", _wire.unb64(m["stdout"]), process_id=pid)
    if "stderr" in m:
        return ExecEvent("stderr", _wire.unb64(m["stderr"]), process_id=pid)
    if "exit" in m:
        return ExecEvent("exit", result=ExecResult._from(m["exit"]), process_id=pid)
    return None


def _events(stream: Iterator[Dict[str, Any]]) -> Iterator[ExecEvent]:
    """The ExecEvents of an ExecStream or ConnectProcess stream."""
    pid = ""
    for m in stream:
        ev = _event_of(m, pid)
        if ev is not None:
            pid = ev.process_id
            yield ev


def _build_spec(image: Optional[str], *, kind: Optional[str] = None, cpu: Optional[float] = None,
                memory_mb: Optional[int] = None, pids: Optional[int] = None, disk_mb: Optional[int] = None,
                gpu: Optional[int] = None, ttl_s: Optional[int] = None,
                idle_ttl_s: Optional[int] = None, labels: Optional[Mapping[str, str]] = None,
                env: Optional[Mapping[str, str]] = None, network: Optional[str] = None, user: Optional[str] = None,
                workdir: Optional[str] = None, from_snapshot: Any = None, session: Any = None,
                node_selector: Optional[Mapping[str, str]] = None, network_policy: Optional[PolicyLike] = None,
                bandwidth_mbps: Optional[int] = None, runtime: Optional[str] = None,
                on_timeout: Optional[str] = None,
                volumes: Optional[Sequence[MountLike]] = None,
                sidecars: Optional[Sequence[Mapping[str, Any]]] = None,
                aliases: Optional[Sequence[str]] = None,
                shared_volumes: Optional[Sequence[Any]] = None,
                model_gateway: bool = False, fast_forward_from: Any = None,
                layers: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    # No kind: the server's default (container), or a machine snapshot's own kind.
    spec: Dict[str, Any] = {"resources": {}}
    if kind:
        spec["kind"] = kind
    if image:
        spec["image"] = image
    if from_snapshot is not None:
        spec["snapshot"] = from_snapshot if isinstance(from_snapshot, str) else from_snapshot.id
    if cpu:
        spec["resources"]["cpu"] = float(cpu)
    if memory_mb:
        spec["resources"]["memoryMb"] = str(int(memory_mb))
    if pids:
        spec["resources"]["pids"] = str(int(pids))
    if disk_mb:
        spec["resources"]["diskMb"] = str(int(disk_mb))
    if gpu:
        spec["resources"]["gpu"] = int(gpu)
    if ttl_s:
        spec["ttlS"] = str(int(ttl_s))
    if idle_ttl_s:
        spec["idleTtlS"] = str(int(idle_ttl_s))
    if labels:
        spec["labels"] = {str(k): str(v) for k, v in labels.items()}
    if env:
        spec["env"] = {str(k): str(v) for k, v in env.items()}
    if network_policy is not None:
        if network not in (None, "", "egress"):
            raise ValueError(f"network_policy needs network='egress', not {network!r}")
        network = "egress"
    if network:
        spec["network"] = {"mode": network}
    if network_policy is not None:
        spec["network"]["policy"] = policy_wire(network_policy)
    if bandwidth_mbps:
        spec["resources"]["bandwidthMbps"] = str(int(bandwidth_mbps))
    if user:
        spec["user"] = user
    if workdir:
        spec["workdir"] = workdir
    if session is not None:
        spec["session"] = session if isinstance(session, str) else session.name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if runtime:
        spec["runtime"] = runtime
    if on_timeout:
        spec["onTimeout"] = on_timeout
    if volumes:
        spec["volumes"] = [mount_wire(m) for m in volumes]
    if sidecars:
        spec["sidecars"] = [sidecar_wire(sc) for sc in sidecars]
    if aliases:
        spec["aliases"] = [str(a) for a in aliases]
    if shared_volumes:
        spec["sharedVolumes"] = [shared_volume_wire(v) for v in shared_volumes]
    if model_gateway or fast_forward_from is not None:
        mg: Dict[str, Any] = {"enabled": bool(model_gateway)}
        if fast_forward_from is not None:
            mg["fastForwardFrom"] = fast_forward_from if isinstance(fast_forward_from, str) else fast_forward_from.id
        spec["modelGateway"] = mg
    if layers:
        spec["layers"] = [str(x) for x in layers]
    return spec


class Sandbox:
    """A handle to one sandbox. ``close()`` deletes it and is idempotent;
    the handle is a context manager that closes on exit."""

    def __init__(self, client: "Client", info: Union[SandboxInfo, str]) -> None:
        self._client = client
        if isinstance(info, str):
            self.id = info
            self._info: Optional[SandboxInfo] = None
        else:
            self.id = info.id
            self._info = info
        self._closed = False
        # The sidecar this handle's exec, process and file calls act in
        # ("": the main container); see container().
        self._container = ""

    def container(self, name: str) -> "Sandbox":
        """A handle whose exec, process and file calls act in the sidecar
        ``name`` (``""`` or ``"main"``: the main container); its other
        calls (pause, close, ...) act on the whole sandbox."""
        c = Sandbox(self._client, self._info if self._info is not None else self.id)
        c._container = name
        c._closed = True  # closing is the sandbox's handle's to do
        return c

    def _req(self, **kw: Any) -> Dict[str, Any]:
        return _call(self.id, self._container, **kw)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def info(self) -> SandboxInfo:
        """The sandbox's status as last fetched (``refresh()`` updates it)."""
        if self._info is None:
            self.refresh()
        assert self._info is not None
        return self._info

    @property
    def state(self) -> str:
        return self.refresh().state

    def refresh(self) -> SandboxInfo:
        self._info = self._client.get(self.id).info
        return self._info

    def exec(self, cmd: Command, *, timeout_s: Optional[float] = None, stdin: Union[bytes, str, None] = None,
             env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
             max_output_bytes: Optional[int] = None, request_id: Optional[str] = None) -> ExecResult:
        """Run a command to completion. A string runs with ``/bin/sh -c``; a
        list runs as argv. A non-zero exit or a timeout is a result, not an
        exception; exceptions mean the call itself failed.

        With ``request_id`` the call is exactly-once: repeating it returns the
        logged result (``result.replayed``) without running again, so it is
        also safe to retry after a lost connection."""
        req = _exec_request(self.id, cmd, timeout_s=timeout_s, stdin=stdin, env=env, cwd=cwd, user=user,
                            max_output_bytes=max_output_bytes, request_id=request_id, container=self._container)
        http_timeout = (timeout_s or 600) + 30
        return ExecResult._from(self._client._t.unary(_PROCESS, "Exec", req, timeout=http_timeout,
                                                      retry=request_id is not None))

    def exec_stream(self, cmd: Command, *, timeout_s: Optional[float] = None, stdin: Union[bytes, str, None] = None,
                    env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
                    max_output_bytes: Optional[int] = None, pty: bool = False, tag: Optional[str] = None,
                    request_id: Optional[str] = None) -> Iterator[ExecEvent]:
        """Run a command and yield its events as they happen."""
        req = _exec_request(self.id, cmd, timeout_s=timeout_s, stdin=stdin, env=env, cwd=cwd, user=user,
                            max_output_bytes=max_output_bytes, pty=pty, tag=tag, request_id=request_id, container=self._container)
        return _events(self._client._t.stream(_PROCESS, "ExecStream", req, timeout=(timeout_s or 600) + 60))

    def logs(self, *, timeout_s: float = 3600) -> Iterator[ExecEvent]:
        """A sidecar's output (its service process; call it on
        :meth:`container`): what it printed so far, then what it prints,
        until its process exits (the last event, "exit")."""
        stream = self._client._t.stream(_PROCESS, "ConnectProcess", self._req(tag="service"), timeout=timeout_s)
        return _events(stream)

    def write_file(self, path: str, data: Union[bytes, str, IO[bytes]], *, mode: Optional[int] = None,
                   request_id: Optional[str] = None) -> FileInfo:
        """Write a file (parents are created). ``data`` may be a binary file
        object, which is streamed. With ``request_id`` the write is
        exactly-once (a repeat with the same content is answered from the
        log)."""
        q = {"path": path}
        if self._container:
            q["container"] = self._container
        if mode is not None:
            q["mode"] = format(mode, "o")
        if request_id:
            q["request_id"] = request_id
        body: Any = data.encode() if isinstance(data, str) else data
        # http.client sends a file object with its length when it has one,
        # else chunked.
        headers = self._client._t.headers("application/octet-stream")
        m = self._client._http_json("PUT", self._files_path(q), body, headers)
        return FileInfo(path=m.get("path", path), name=os.path.basename(path), type="file", size=_int(m.get("size")),
                        mode=_int(m.get("mode")), replayed=bool(m.get("replayed")))

    def read_file(self, path: str, *, max_bytes: Optional[int] = None) -> bytes:
        """Read a whole file (or its first ``max_bytes``)."""
        chunks = []
        for chunk in self.read_file_stream(path, max_bytes=max_bytes):
            chunks.append(chunk)
        return b"".join(chunks)

    def read_file_stream(self, path: str, *, max_bytes: Optional[int] = None, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        q: Dict[str, str] = {"path": path}
        if self._container:
            q["container"] = self._container
        if max_bytes:
            q["max_bytes"] = str(max_bytes)
        resp = self._client._t.request("GET", self._files_path(q), None, self._client._t.headers("application/octet-stream"))
        if resp.status != 200:
            self._client._raise_http(resp)
        while True:
            chunk = resp.read(chunk_size)
            if not chunk:
                return
            yield chunk

    def upload(self, local_path: str, remote_path: str) -> FileInfo:
        """Stream a local file into the sandbox."""
        with open(local_path, "rb") as f:
            return self.write_file(remote_path, f, mode=os.stat(local_path).st_mode & 0o777)

    def download(self, remote_path: str, local_path: str) -> None:
        """Stream a sandbox file to a local path."""
        tmp = local_path + ".dsec-part"
        with open(tmp, "wb") as f:
            for chunk in self.read_file_stream(remote_path):
                f.write(chunk)
        os.replace(tmp, local_path)

    def stat(self, path: str, *, user: Optional[str] = None) -> FileInfo:
        """A path's info (as ``user``, when given: a path that user cannot
        reach is PermissionDenied)."""
        req = self._req(path=path)
        if user:
            req["user"] = user
        return FileInfo._from(self._client._t.unary(_FILES, "Stat", req))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def list_dir(self, path: str, depth: int = 1) -> List[FileInfo]:
        m = self._client._t.unary(_FILES, "ListDir", self._req(path=path, depth=depth))
        return [FileInfo._from(e) for e in m.get("entries", [])]

    def make_dir(self, path: str) -> FileInfo:
        return FileInfo._from(self._client._t.unary(_FILES, "MakeDir", self._req(path=path)))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._client._t.unary(_FILES, "Remove", self._req(path=path, recursive=recursive))

    def rename(self, src: str, dst: str) -> FileInfo:
        return FileInfo._from(self._client._t.unary(_FILES, "Rename", self._req(**{"from": src, "to": dst})))

    def chmod(self, path: str, mode: int, *, user: Optional[str] = None) -> FileInfo:
        """Set ``path``'s permission bits (``0o755``); only its owner or root may."""
        req: Dict[str, Any] = self._req(path=path, mode=mode)
        if user:
            req["user"] = user
        return FileInfo._from(self._client._t.unary(_FILES, "ChangeMode", req))

    def keepalive(self, extend_ttl_s: Optional[int] = None) -> SandboxInfo:
        """Reset the idle timer (call it while the model generates); with
        ``extend_ttl_s`` also move the expiry to now + that."""
        req: Dict[str, Any] = {"id": self.id}
        if extend_ttl_s:
            req["extendTtlS"] = str(int(extend_ttl_s))
        self._info = SandboxInfo._from(self._client._t.unary(_LIFECYCLE, "Keepalive", req))
        return self._info

    def shell(self, name: str = "default", *, startup: Optional[str] = None,
              split_stderr: bool = False) -> "ShellSession":
        """A persistent bash session: cwd and environment carry over. With
        ``split_stderr`` each command's stderr comes back on its own
        (``run_split``) instead of merged into its output."""
        from .shell import ShellSession

        return ShellSession(self, name, startup=startup, split_stderr=split_stderr)

    def stats(self, *, history: bool = False) -> Stats:
        """The sandbox's resource use now; with ``history`` also the samples
        the node kept of it. It neither resumes a paused sandbox nor counts
        as activity."""
        req: Dict[str, Any] = {"id": self.id}
        if history:
            req["history"] = True
        return Stats._from(self._client._t.unary(_LIFECYCLE, "GetSandboxStats", req, retry=True))

    def pause(self, *, keep_memory: bool = True) -> SandboxInfo:
        """Freeze the sandbox and release what memory the host allows. Any
        later call resumes it. Pausing a paused sandbox is not an error.

        ``keep_memory=False`` pauses filesystem-only: every process ends and
        only the file system is kept (all memory and CPU are released); the
        resume cold-boots the sandbox (new processes, a new boot id, the
        same ID and files). Kind container only."""
        req: Dict[str, Any] = {"id": self.id}
        if not keep_memory:
            req["filesystemOnly"] = True
        self._info = SandboxInfo._from(self._client._t.unary(_LIFECYCLE, "PauseSandbox", req))
        return self._info

    def resume(self) -> SandboxInfo:
        self._info = SandboxInfo._from(self._client._t.unary(_LIFECYCLE, "ResumeSandbox", {"id": self.id}))
        return self._info

    def snapshot(self, name: Optional[str] = None) -> "SnapshotInfo":
        """Capture the sandbox (for containers its writable layer, frozen
        while captured) as a snapshot to create sandboxes from."""
        req: Dict[str, Any] = {"sandboxId": self.id}
        if name:
            req["name"] = name
        return SnapshotInfo._from(self._client._t.unary(_SNAPSHOTS, "Snapshot", req))

    def commit(self, name: str) -> Dict[str, Any]:
        """Store this container sandbox's files (its image with its writable
        layer, captured frozen) and its environment, user and working
        directory as an image ``name`` of its project; the sandbox runs on.
        Returns the image (as :meth:`Client.images` lists it)."""
        return self._client._t.unary(_IMAGE, "CommitSandbox", {"sandboxId": self.id, "name": name}, timeout=600)

    def fork(self, n: int, *, labels: Optional[Mapping[str, str]] = None, idempotency_key: Optional[str] = None) -> List["Sandbox"]:
        """Snapshot this sandbox and start ``n`` children from it."""
        return self._client.fork(self, n, labels=labels, idempotency_key=idempotency_key)

    def log(self, from_seq: int = 0) -> List[Dict[str, Any]]:
        """The trajectory log: every exec and file mutation, in order, with
        results (protojson dicts)."""
        out: List[Dict[str, Any]] = []
        seq = from_seq
        while True:
            m = self._client._t.unary(_LOGS, "GetLog", {"sandboxId": self.id, "fromSeq": str(seq)})
            entries = m.get("entries", [])
            out.extend(entries)
            nxt = _int(m.get("nextSeq"))
            if not entries or nxt <= seq:
                return out
            seq = nxt

    def rollout(self, cmd: Union[str, Sequence[str]], rollout_id: str, **kw: Any) -> "Rollout":
        """Start an agent command as a rollout (see :mod:`dsec.rollout`): it
        runs on if this process dies, within ``timeout_s``; ``verifier`` (a
        command) scores it when it ends (the last line of its stdout, as a
        number, is ``reward``). Starting ``rollout_id`` again reattaches to
        it. Keywords: ``env``, ``cwd``, ``user``, ``timeout_s``,
        ``verifier``, ``verifier_timeout_s``, and ``workers``: sandboxes
        (or IDs) the agent drives through the dsec API at its model
        gateway's address (``dsec.Client(os.environ["DSEC_URL"])`` inside,
        no key); its calls to them are answered from their logs when the
        same rollout runs again in a new agent sandbox (a resume)."""
        from .rollout import start

        return start(self._client, self.id, rollout_id, cmd, **kw)

    def replay(self, keep: bool = False) -> Dict[str, Any]:
        """Re-execute the logged calls in a fresh sandbox; reports divergences."""
        return self._client._t.unary(_LOGS, "Replay", {"sandboxId": self.id, "keep": keep}, timeout=3600)

    def screenshot(self) -> bytes:
        """The sandbox's screen as PNG bytes (kinds with the "screen"
        capability: vm). ``screenshot_info`` also gives its size."""
        return self.screenshot_info()[0]

    def screenshot_info(self) -> Tuple[bytes, int, int]:
        """The screen as ``(png, width, height)``: the guest's resolution
        (720x400 for an 80x25 text console)."""
        m = self._client._t.unary(_SCREEN, "Screenshot", {"sandboxId": self.id})
        return base64.b64decode(m.get("png", "")), _int(m.get("width")), _int(m.get("height"))

    def input(self, *actions: Mapping[str, Any]) -> None:
        """Send keyboard and mouse actions to the screen, in order: dicts
        such as ``{"text": "ls\\n"}``, ``{"keys": "ctrl+c"}``,
        ``{"move": {"x": 10, "y": 20}}``, ``{"click": {"x": 10, "y": 20,
        "button": "right", "count": 2}}``, ``{"button": {"button": "left",
        "down": True}}``, ``{"scroll": {"dy": 3}}``. The helpers below
        send one action each."""
        self._client._t.unary(_SCREEN, "SendInput", {"sandboxId": self.id, "actions": list(actions)})

    def vnc(self) -> Dict[str, Any]:
        """Give the screen's VNC server a new password: ``{"address":
        "127.0.0.1:5901", "password": ..., "expiresAt": ...}`` (the address is
        on the node's loopback; the node must run with ``vm.vnc``)."""
        return self._client._t.unary(_SCREEN, "OpenVNC", {"sandboxId": self.id})

    def type_text(self, text: str) -> None:
        """Type text on a US keyboard layout ("\\n" is Return)."""
        self.input({"text": text})

    def press_keys(self, combo: str) -> None:
        """Press a key combination: "Return", "ctrl+c", "alt+F4", ..."""
        self.input({"keys": combo})

    def mouse_move(self, x: int, y: int) -> None:
        """Move the pointer to a screen position (pixels)."""
        self.input({"move": {"x": x, "y": y}})

    def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        """Click at a screen position (count 2 is a double click)."""
        self.input({"click": {"x": x, "y": y, "button": button, "count": count}})

    def scroll(self, dy: int, dx: int = 0) -> None:
        """Turn the mouse wheel: dy clicks down (negative: up)."""
        self.input({"scroll": {"dx": dx, "dy": dy}})

    def network(self) -> Network:
        """The sandbox's network now: its mode and the egress policy in
        force (credentials without their values)."""
        return Network._from(self._client._t.unary(_LIFECYCLE, "GetNetworkPolicy", {"id": self.id}, retry=True))

    def set_network_policy(self, policy: Optional[PolicyLike]) -> Network:
        """Put an egress policy in force for the sandbox's new connections
        (open ones it denies are cut); ``None`` lifts every restriction,
        ``NetworkPolicy()`` denies everything. The sandbox needs
        ``network="egress"``. The phase pattern::

            sb = client.create("debian", network_policy=NetworkPolicy(allow=["deb.debian.org"]))
            sb.exec("apt-get install -y ...")      # setup: the package mirror
            sb.set_network_policy(NetworkPolicy())  # rollout: nothing
        """
        req: Dict[str, Any] = {"id": self.id}
        if policy is not None:
            req["policy"] = policy_wire(policy)
        return Network._from(self._client._t.unary(_LIFECYCLE, "SetNetworkPolicy", req, retry=True))

    def network_log(self, after_seq: int = 0, limit: Optional[int] = None) -> NetworkLog:
        """The connections the sandbox opened, allowed and denied, after
        record ``after_seq`` (``log.next_seq`` reads on)."""
        req: Dict[str, Any] = {"sandboxId": self.id, "afterSeq": str(int(after_seq))}
        if limit:
            req["limit"] = int(limit)
        return NetworkLog._from(self._client._t.unary(_LOGS, "GetNetworkLog", req, retry=True))

    def alive(self) -> bool:
        """Whether the sandbox is running. Never raises."""
        try:
            return self.refresh().state in ("running", "paused")
        except Exception:
            return False

    def close(self) -> None:
        """Delete the sandbox. Idempotent."""
        if self._closed:
            return
        self._client.delete(self.id)
        self._closed = True

    def _files_path(self, q: Mapping[str, str]) -> str:
        return f"/v1/sandboxes/{urllib.parse.quote(self.id)}/files?" + urllib.parse.urlencode(q)


class Client:
    """A dsec client. ``url`` defaults to ``$DSEC_URL`` or
    http://127.0.0.1:7070, ``api_key`` to ``$DSEC_API_KEY``. Safe to share
    between threads (each thread gets its own kept-alive connection)."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, *, timeout: float = 120.0) -> None:
        self.url = url or os.environ.get("DSEC_URL") or DEFAULT_URL
        self._t = _wire.Transport(self.url, api_key if api_key is not None else os.environ.get("DSEC_API_KEY"), timeout)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._t.close()

    def create(self, image: Optional[str] = None, *, count: Optional[int] = None,
               idempotency_key: Optional[str] = None, timeout_s: float = 300,
               compose: Union[str, Sequence[str], None] = None, compose_env: Optional[Mapping[str, str]] = None, **spec: Any) -> Any:
        """Create a sandbox and return once it accepts commands.

        Spec keywords: ``kind`` ("container"), ``cpu``, ``memory_mb``,
        ``pids``, ``disk_mb`` (the sandbox's disk: its writable layer for
        containers, its disk for microvm and vm), ``gpu``, ``ttl_s``,
        ``idle_ttl_s``, ``labels``, ``env``, ``network`` ("none" or
        "egress"), ``network_policy`` (a :class:`NetworkPolicy` or a dict
        with its keys; implies egress), ``bandwidth_mbps`` (egress
        throughput each way), ``user``, ``workdir``, ``from_snapshot``,
        ``session``, ``node_selector`` (cluster mode: node labels),
        ``runtime`` ("gvisor": another runtime of the kind; ``info()``
        lists each node's), ``on_timeout`` ("delete", the default, or
        "pause": reaching ``ttl_s`` or ``idle_ttl_s`` pauses the sandbox
        and any call resumes it; paused at its TTL it is kept for the
        node's ``paused_ttl``, 24 h by default, and resumes with a fresh
        TTL), ``volumes`` (volumes of the project to mount: ``"name:/path"``
        read-write, this sandbox alone, or ``"name:/path:ro"`` shared
        read-only; see :meth:`create_volume`), ``sidecars`` (further
        containers sharing the sandbox's network: see :mod:`dsec.compose`),
        ``aliases`` (further names of the main container for its sidecars),
        ``shared_volumes`` (file systems of the sandbox alone that its
        containers mount by name through ``volumes``: names, or dicts with
        ``name`` and ``size_mb``), ``model_gateway`` (True: an
        OpenAI-compatible endpoint inside, ``OPENAI_BASE_URL`` =
        http://127.0.0.1:4319/v1, forwarding to the session's and the project's upstreams,
        see :meth:`Session.set_model_upstreams`, and recording each call in
        the log), ``fast_forward_from`` (a sandbox or its ID: its recorded
        model calls answer this one's while they are the same), ``layers``
        (images whose layers are stacked over ``image``'s, in order, at
        create: a workspace over a shared base, a toolkit over any task
        image; kind container).
        ``compose`` is a Compose file's text instead of ``image`` and
        ``sidecars`` (its service "main", or its only one, is the main
        container), or a list of texts laid over one another as
        ``docker compose -f a -f b`` merges them; variables are
        substituted here from ``compose_env`` (default: ``os.environ``). With ``count``, create
        that many in one request and return the list of those that started
        (raising if none did; see :meth:`create_many` for per-item
        results)."""
        body = _build_spec(image, **spec)
        if count is not None and compose is not None:
            raise ValueError("compose creates one sandbox at a time")
        if count is not None:
            results = self._create_many(body, int(count), idempotency_key, timeout_s)
            ok = [r for r in results if isinstance(r, Sandbox)]
            if not ok and results:
                raise results[0]
            return ok
        req: Dict[str, Any] = {"spec": body}
        if idempotency_key:
            req["idempotencyKey"] = idempotency_key
        if compose is not None:
            files = [compose] if isinstance(compose, str) else list(compose)
            if not files:
                raise ValueError("compose: no file given")
            texts = [interpolate(f, compose_env) for f in files]
            req["compose"] = texts[0]
            if texts[1:]:
                req["composeOverrides"] = texts[1:]
        m = self._t.unary(_LIFECYCLE, "CreateSandbox", req, timeout=timeout_s, retry=idempotency_key is not None)
        return Sandbox(self, SandboxInfo._from(m))

    def create_many(self, image: Optional[str], n: int, *, idempotency_key: Optional[str] = None,
                    timeout_s: float = 600, **spec: Any) -> List[Union["Sandbox", DsecError]]:
        """Create ``n`` sandboxes of one spec in one request. The result has
        one item per sandbox, in order: a Sandbox, or that item's DsecError
        (partial success is explicit)."""
        return self._create_many(_build_spec(image, **spec), n, idempotency_key, timeout_s)

    def _create_many(self, spec: Dict[str, Any], n: int, key: Optional[str], timeout_s: float) -> List[Any]:
        req: Dict[str, Any] = {"spec": spec, "count": n}
        if key:
            req["idempotencyKey"] = key
        m = self._t.unary(_LIFECYCLE, "CreateSandboxes", req, timeout=timeout_s, retry=key is not None)
        return self._results(m)

    def _results(self, m: Dict[str, Any]) -> List[Any]:
        out: List[Any] = []
        for r in sorted(m.get("results", []), key=lambda r: _int(r.get("index"))):
            if r.get("error"):
                e = r["error"]
                out.append(make_error(e.get("kind", ""), e.get("message", ""), infra=e.get("infra"), retryable=e.get("retryable")))
            else:
                out.append(Sandbox(self, SandboxInfo._from(r["sandbox"])))
        return out

    def fork(self, sandbox: Union[str, Sandbox], n: int, *, labels: Optional[Mapping[str, str]] = None,
             idempotency_key: Optional[str] = None, session: Optional[str] = None) -> List[Sandbox]:
        """Snapshot a running sandbox and start ``n`` children from it (a GRPO
        group). Children that failed to start are left out; ``len()`` tells."""
        sid = sandbox if isinstance(sandbox, str) else sandbox.id
        req: Dict[str, Any] = {"sandboxId": sid, "count": n}
        if labels:
            req["labels"] = {str(k): str(v) for k, v in labels.items()}
        if idempotency_key:
            req["idempotencyKey"] = idempotency_key
        if session:
            req["session"] = session
        results = self._results(self._t.unary(_SNAPSHOTS, "Fork", req, timeout=600))
        ok = [r for r in results if isinstance(r, Sandbox)]
        if not ok and results:
            raise results[0]
        return ok

    def pause(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None,
              keep_memory: bool = True) -> List[str]:
        """Pause every sandbox matching the labels (e.g. a preempted job);
        ``keep_memory=False`` pauses them filesystem-only (Sandbox.pause)."""
        return self._bulk("PauseSandboxes", labels, selector, {} if keep_memory else {"filesystemOnly": True})

    def resume(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None) -> List[str]:
        return self._bulk("ResumeSandboxes", labels, selector)

    def _bulk(self, method: str, labels: Optional[Mapping[str, str]], selector: Optional[str],
              extra: Optional[Dict[str, Any]] = None) -> List[str]:
        parts = [f"{k}={v}" for k, v in (labels or {}).items()]
        if selector:
            parts.append(selector)
        if not parts:
            raise ValueError("labels or selector is required")
        m = self._t.unary(_LIFECYCLE, method, {"labelSelector": ",".join(parts), **(extra or {})}, timeout=600)
        fails = m.get("failures") or []
        if fails:
            f = fails[0]
            e = f.get("error", {})
            raise make_error(e.get("kind", ""), f"{len(fails)} sandboxes failed; first {f.get('id')}: {e.get('message', '')}",
                             infra=e.get("infra"), retryable=e.get("retryable"))
        return list(m.get("ids", []))

    def create_volume(self, name: str, *, size_mb: Optional[int] = None, labels: Optional[Mapping[str, str]] = None,
                      node: Optional[str] = None) -> Volume:
        """Create an empty volume of the project (``size_mb`` is its limit;
        default the node's, 1024). Mount it with ``create(volumes=...)``."""
        req: Dict[str, Any] = {"name": name}
        if size_mb:
            req["sizeMb"] = str(int(size_mb))
        if labels:
            req["labels"] = {str(k): str(v) for k, v in labels.items()}
        if node:
            req["node"] = node
        return Volume._from(self, self._t.unary(_VOLUMES, "CreateVolume", req))

    def volume(self, name_or_id: str) -> Volume:
        return Volume._from(self, self._t.unary(_VOLUMES, "GetVolume", {"volume": name_or_id}))

    def volumes(self) -> List[Volume]:
        """The project's volumes, oldest first."""
        return [Volume._from(self, v) for v in self._t.unary(_VOLUMES, "ListVolumes", {}).get("volumes", [])]

    def delete_volume(self, volume: Union[str, Volume]) -> None:
        """Delete a volume and its content (a Conflict while a sandbox mounts it)."""
        self._t.unary(_VOLUMES, "DeleteVolume", {"volume": volume if isinstance(volume, str) else volume.id})

    def snapshots(self) -> List[SnapshotInfo]:
        return [SnapshotInfo._from(s) for s in self._t.unary(_SNAPSHOTS, "ListSnapshots", {}).get("snapshots", [])]

    def delete_snapshot(self, snapshot: Union[str, SnapshotInfo]) -> None:
        self._t.unary(_SNAPSHOTS, "DeleteSnapshot", {"id": snapshot if isinstance(snapshot, str) else snapshot.id})

    def run_code(self, code: str, language: str = "python", **kw: Any) -> "RunCodeResult":
        """Run a program as a function call in a warm worker.

        Keywords: ``stdin``, ``files`` (name → bytes/str), ``fetch_files``,
        ``tests`` (dicts with ``stdin``/``expected_stdout``, or pairs),
        ``run_timeout``, ``compile_timeout``, ``memory_limit_mb``,
        ``max_output_bytes``, ``case_insensitive``, ``float_tolerance``,
        ``stop_on_first_failure``, ``image``, ``args`` (the program's
        arguments), ``checker`` (a special judge for ``tests``: a built-in
        name such as "float", "tokens" or "unordered_lines", or a
        ``dsec.functions.Checker`` / dict with ``language`` and ``code`` of
        a checker program). Function calls are stateless, so they are
        retried on transport failures."""
        from .functions import run_code

        return run_code(self, code, language, **kw)

    def run_code_batch(self, calls: Sequence[Mapping[str, Any]]) -> List["RunCodeResult"]:
        """Run many calls (dicts of run_code's arguments) in one request;
        results come back in order, each with its own status."""
        from .functions import run_code_batch

        return run_code_batch(self, calls)

    def capacity(self) -> Dict[str, Any]:
        """Free slots, queue depth, recent start rate and warm pools."""
        return self._t.unary(_SYSTEM, "GetCapacity", {})

    def session(self, name: str, *, heartbeat_s: float = 5, grace_s: Optional[float] = None,
                on_expire: str = "pause") -> "Session":
        """Open (or reopen) a trainer session; use it as a context manager:
        it heartbeats in a background thread. Reopening the name after a
        crash resumes the sandboxes the session paused."""
        from .session import Session

        return Session(self, name, heartbeat_s=heartbeat_s, grace_s=grace_s, on_expire=on_expire)

    def set_model_upstreams(self, upstreams: Sequence[Mapping[str, Any]], **limits: int) -> Dict[str, Any]:
        """Replace the project's own model upstreams: those every sandbox of
        the project with ``model_gateway=True`` reaches, after its
        session's (see :meth:`Session.set_model_upstreams` for the keys).
        ``[]`` removes them."""
        from .session import set_model_upstreams

        return set_model_upstreams(self, "", upstreams, **limits)

    def model_upstreams(self) -> Dict[str, Any]:
        """The project's own model upstreams, without keys."""
        return self._t.unary("dsec.v1.SessionService", "GetModelUpstreams", {}, retry=True)

    def rollout(self, sandbox_id: str, rollout_id: str) -> "Rollout":
        """Reattach to a rollout (a trainer that restarted): as it is now;
        ``.wait()`` for its outcome, ``.events()`` for its progress."""
        from .rollout import get

        return get(self, sandbox_id, rollout_id)

    def get(self, sandbox_id: str) -> Sandbox:
        """Fetch a sandbox (live or recently deleted; see ``.info.state``)."""
        m = self._t.unary(_LIFECYCLE, "GetSandbox", {"id": sandbox_id}, retry=True)
        return Sandbox(self, SandboxInfo._from(m))

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle to an existing sandbox, without a call."""
        return Sandbox(self, sandbox_id)

    def events(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None,
               types: Optional[Sequence[str]] = None, project: Optional[str] = None) -> EventStream:
        """Subscribe to the lifecycle events of your sandboxes whose labels
        match ``labels`` or ``selector`` (and, with ``types``, only those
        types: created, paused, resumed, snapshotted, forked, ended). It
        returns once the subscription is in place: every later event
        reaches it. Iterate the stream; close it when done::

            with client.events({"job": "rollout-7"}, types=["ended"]) as stream:
                for ev in stream:
                    print(ev.sandbox_id, ev.cause, ev.infra)

        An operator's key sees every project's (``project`` narrows)."""
        return subscribe(self._t, labels, selector, types, project)

    def create_webhook(self, url: str, secret: str, *, name: Optional[str] = None,
                       labels: Optional[Mapping[str, str]] = None, selector: Optional[str] = None,
                       types: Optional[Sequence[str]] = None, enabled: bool = True) -> Webhook:
        """Register ``url`` to receive the lifecycle events of your
        sandboxes (filtered as ``events`` filters) as POSTs signed with
        ``secret``; check each with ``dsec.verify_signature``. Deliveries
        are retried with backoff; a receiver that is down never slows a
        sandbox. Kept by the server until deleted."""
        return create_webhook(self._t, url, secret, name, labels, selector, types, enabled)

    def webhooks(self) -> List[Webhook]:
        return list_webhooks(self._t)

    def enable_webhook(self, webhook: Union[str, Webhook], enabled: bool = True) -> Webhook:
        return enable_webhook(self._t, webhook if isinstance(webhook, str) else webhook.id, enabled)

    def delete_webhook(self, webhook: Union[str, Webhook]) -> None:
        delete_webhook(self._t, webhook if isinstance(webhook, str) else webhook.id)

    def list(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None,
             state: Optional[str] = None) -> List[SandboxInfo]:
        """List sandboxes whose labels match ``labels`` (all must match) or a
        selector string ("k=v,k2!=v")."""
        parts = [f"{k}={v}" for k, v in (labels or {}).items()]
        if selector:
            parts.append(selector)
        out: List[SandboxInfo] = []
        token = ""
        while True:
            req: Dict[str, Any] = {"labelSelector": ",".join(parts)}
            if state:
                req["state"] = state
            if token:
                req["pageToken"] = token
            m = self._t.unary(_LIFECYCLE, "ListSandboxes", req, retry=True)
            out.extend(SandboxInfo._from(s) for s in m.get("sandboxes", []))
            token = m.get("nextPageToken", "")
            if not token:
                return out

    def delete(self, sandbox_id: Optional[str] = None, *, labels: Optional[Mapping[str, str]] = None,
               selector: Optional[str] = None) -> List[str]:
        """Delete a sandbox, or every sandbox matching labels / a selector.
        Deleting a deleted sandbox succeeds."""
        if sandbox_id is None:
            return self._bulk("DeleteSandboxes", labels, selector)
        self._t.unary(_LIFECYCLE, "DeleteSandbox", {"id": sandbox_id}, retry=True)
        return [sandbox_id]

    def info(self) -> Dict[str, Any]:
        """The deployment: nodes, substrates and their capabilities."""
        return self._t.unary(_SYSTEM, "GetInfo", {})

    def images(self) -> List[Dict[str, Any]]:
        return self._t.unary(_IMAGE, "ListImages", {}).get("images", [])

    def build_image(self, name: str, context: Optional[str] = None, *, dockerfile: Optional[str] = None,
                    dockerfile_text: Optional[str] = None, build_args: Optional[Mapping[str, str]] = None,
                    target: Optional[str] = None, no_cache: bool = False, network: Optional[str] = None,
                    step_timeout_s: Optional[int] = None, cpu: Optional[float] = None, memory_mb: Optional[int] = None,
                    image_map: Optional[Mapping[str, str]] = None,
                    on_progress: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
        """Build an image ``name`` of the caller's project from a Dockerfile
        on the server (docs/images.md): each RUN in a sandbox, each step that
        changes files a layer the server caches for later builds.

        ``context`` is the build context directory (sent minus what its
        ``.dockerignore`` excludes; None: no context). The Dockerfile is
        ``dockerfile_text``, else the file ``dockerfile`` (default
        ``Dockerfile``) in the context. ``image_map`` renames FROM images to
        dsec image names. ``on_progress`` gets each progress message: phase
        ``step`` (``message`` like ``[3/9] RUN make``, ``cached``), ``output``
        (a RUN's output as it comes). A failing step raises an
        :class:`~dsec.errors.InvalidRequest` quoting its output's tail.
        Returns the image (as :meth:`images` lists it)."""
        if dockerfile_text is None:
            if context is None:
                raise ValueError("build_image needs a context directory or dockerfile_text")
            with open(os.path.join(context, dockerfile or "Dockerfile"), encoding="utf-8") as f:
                dockerfile_text = f.read()
        req: Dict[str, Any] = {"name": name, "dockerfile": from_map(dockerfile_text, dict(image_map or {}))}
        if context is not None:
            bc = self._t.client_stream(_IMAGE, "UploadBuildContext", [{"header": {}}], context_chunks(context))
            req["contextDigest"] = bc["digest"]
        if build_args:
            req["buildArgs"] = {str(k): str(v) for k, v in build_args.items()}
        if target:
            req["target"] = target
        if no_cache:
            req["noCache"] = True
        if network:
            req["network"] = network
        if step_timeout_s:
            req["stepTimeoutS"] = str(int(step_timeout_s))
        res: Dict[str, Any] = {}
        if cpu:
            res["cpu"] = float(cpu)
        if memory_mb:
            res["memoryMb"] = str(int(memory_mb))
        if res:
            req["resources"] = res
        # A RUN may print nothing for as long as it runs: the stream waits
        # as long as a step may take.
        wait = float(step_timeout_s or 3600) + 300
        for m in self._t.stream(_IMAGE, "BuildImage", req, timeout=wait):
            if m.get("image"):
                return m["image"]
            if on_progress is not None:
                on_progress(m)
        raise make_error("unavailable", f"the build of {name} ended without its image")

    def push_image(self, name: str, ref: str, *, insecure: bool = False, username: Optional[str] = None,
                   password: Optional[str] = None, on_demand: bool = False) -> str:
        """Push the image ``name`` to a registry at ``ref`` (an OCI image
        for linux/amd64); without credentials the server uses its own.
        ``insecure`` allows plain HTTP. With ``on_demand`` the layers' EROFS
        files are pushed instead: a dsec node that pulls the image fetches
        only their metadata and reads each layer's data from the registry
        as sandboxes touch it. Returns the pushed reference by digest
        (``repository@sha256:...``)."""
        req: Dict[str, Any] = {"name": name, "ref": ref, "insecure": insecure, "onDemand": on_demand}
        if username is not None:
            req["auth"] = {"username": username, "password": password or ""}
        for m in self._t.stream(_IMAGE, "PushImage", req, timeout=3600):
            if m.get("image"):
                return m.get("message", "")
        raise make_error("unavailable", f"the push of {name} ended without an answer")

    def export_image(self, name: str, out: IO[bytes]) -> None:
        """Write the image ``name`` to the binary file ``out`` as a tar of an
        OCI image layout of its layers' EROFS files. Unpacked under a prefix
        of any HTTP server or object store that answers range requests,
        ``pull_image("https://host/prefix/", name)`` loads it on demand."""
        for m in self._t.stream(_IMAGE, "ExportImage", {"name": name}, timeout=3600):
            out.write(_wire.unb64(m.get("data")))

    def pull_image(self, ref: str, name: Optional[str] = None, *, insecure: bool = False,
                   username: Optional[str] = None, password: Optional[str] = None) -> Dict[str, Any]:
        """Import an image from a registry on every node (as ``name``,
        default ``ref``), or from the http(s) URL of an OCI image layout
        (``export_image``; ``name`` required); without credentials the
        server uses its own. Returns the image."""
        req: Dict[str, Any] = {"ref": ref, "insecure": insecure}
        if name:
            req["name"] = name
        if username is not None:
            req["auth"] = {"username": username, "password": password or ""}
        for m in self._t.stream(_IMAGE, "PullImage", req, timeout=3600):
            if m.get("image"):
                return m["image"]
        raise make_error("unavailable", f"the pull of {ref} ended without its image")

    def prune_build_cache(self) -> int:
        """Remove the project's build cache; returns how many cached steps
        went (images already built keep their layers)."""
        return _int(self._t.unary(_IMAGE, "PruneBuildCache", {}).get("removed"))

    def prune_images(self) -> Dict[str, int]:
        """Remove what the nodes keep as a cache for the project: its build
        cache and the copies of images nodes loaded from each other that no
        sandbox uses (an operator's key: every project's, and the cached
        chunks of layers loaded on demand no sandbox uses). Returns what went:
        ``build_steps``, ``copies``, ``layer_bytes``, ``chunk_bytes``."""
        r = self._t.unary(_IMAGE, "PruneBuildCache", {})
        return {
            "build_steps": _int(r.get("removed")),
            "copies": _int(r.get("copies")),
            "layer_bytes": _int(r.get("layerBytes")),
            "chunk_bytes": _int(r.get("chunkBytes")),
        }

    def _http_json(self, method: str, path: str, body: Any, headers: Dict[str, str]) -> Dict[str, Any]:
        import json

        resp = self._t.request(method, path, body, headers)
        if resp.status != 200:
            self._raise_http(resp)
        data = resp.read()
        return json.loads(data) if data else {}

    def _raise_http(self, resp: Any) -> None:
        import json

        data = resp.read()
        try:
            body = json.loads(data)
        except ValueError:
            raise make_error("unavailable" if resp.status >= 500 else "unknown", data.decode(errors="replace")[:500] or resp.reason, status=resp.status)
        raise make_error(body.get("code", ""), body.get("message", ""), infra=body.get("infra"), retryable=body.get("retryable"),
                         retry_after_s=float(resp.getheader("Retry-After")) if resp.getheader("Retry-After") else None, status=resp.status)


def quote(argv: Sequence[str]) -> str:
    """Join argv into a shell command."""
    return " ".join(shlex.quote(a) for a in argv)


def request_id(trajectory: Any, step: Any, *parts: Any) -> str:
    """A request ID derived from (trajectory, step, ...): a trainer that
    re-runs the same rollout after a restart issues the same IDs, so its
    completed calls are fast-forwarded from the trajectory log.

    ``trajectory`` must name the run instance, not only the run: a fresh run
    that derived the same IDs as an earlier one would be answered from the
    earlier run's log. :class:`dsec.RunKeys` keeps a per-run nonce in the
    run's journal and derives IDs and idempotency keys from it."""
    return "/".join(str(p) for p in (trajectory, step) + parts)


__all__ = ["Client", "Sandbox", "ExecResult", "ExecEvent", "FileInfo", "SandboxInfo", "SnapshotInfo", "DsecError",
           "SandboxGone", "NetworkPolicy", "quote", "request_id"]
