"""The asyncio client: natively asynchronous, standard library only.

Calls go over pooled HTTP/1.1 connections driven by the running event loop
(see ``_aiowire``): a thousand calls in flight are a thousand sockets and
no threads. The client is not bound to a loop: it works from any loop,
including several in turn (``asyncio.run`` per call, as SWE-agent does).

Cancellation ends the remote work: a cancelled (or timed-out) ``exec``
drops its connection, then kills the process it started (found by the
call's own tag); an ``exec_stream`` closed before its exit closes its
stream, then kills the process. The server records no result for a call
whose connection went away, so repeating a cancelled call's request_id
runs it again.

Backpressure: at most ``max_connections`` calls are in flight (default:
half the file descriptor limit, at most 8192); the rest wait for a
connection. Streams are read only as fast as they are consumed.

Methods not implemented natively here (screen, VNC, replay, sessions) run
the synchronous client's in a worker thread, as the whole client used to.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import secrets
import urllib.parse
from typing import IO, Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _wire
from ._aiowire import AsyncTransport, Sent, Stream, _http_error, bounded
from .compose import interpolate
from .client import (_FILES, _IMAGE, _LIFECYCLE, _LOGS, _PROCESS, _SNAPSHOTS, _SYSTEM, DEFAULT_URL, Client, Command,
                     ExecEvent, ExecResult, FileInfo, Sandbox, SandboxInfo, SnapshotInfo, _build_spec, _call,
                     _event_of, _exec_request, _int)
from .errors import ConnectionFailed, DsecError, NotFound, make_error
from .functions import _FUNCTION, RunCodeResult, _request as _run_code_request

#: how long a cancelled call waits for each step of killing its process
_KILL_WAIT_S = 10.0
#: how often, and how far apart, a cancelled exec looks for the process it started
_KILL_POLLS = 10
_KILL_POLL_S = 0.1


_tags = itertools.count()
_tag_prefix = "aio-" + secrets.token_hex(4) + "-"


def _tag() -> str:
    """A process tag unique to this call (it names the process in
    ListProcesses; request-ID replay ignores it)."""
    return _tag_prefix + str(next(_tags))


def _wrap_sync(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    async def call(*a: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(f, *a, **kw)

    return call


class AsyncSandbox:
    """A handle to one sandbox. ``close()`` deletes it and is idempotent;
    ``async with`` closes it on exit."""

    def __init__(self, client: "AsyncClient", info: Union[SandboxInfo, Sandbox, str]) -> None:
        self._client = client
        self._t = client._t
        if isinstance(info, Sandbox):
            info = info._info or info.id
        if isinstance(info, str):
            self.id = info
            self._info: Optional[SandboxInfo] = None
        else:
            self.id = info.id
            self._info = info
        self._closed = False
        self._container = ""  # see container()

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    def container(self, name: str) -> "AsyncSandbox":
        """A handle whose exec, process and file calls act in the sidecar
        ``name`` ("" or "main": the main container); its other calls act on
        the whole sandbox."""
        c = AsyncSandbox(self._client, self._info if self._info is not None else self.id)
        c._container = name
        c._closed = True  # closing is the sandbox's handle's to do
        return c

    def _req(self, **kw: Any) -> Dict[str, Any]:
        return _call(self.id, self._container, **kw)

    def logs(self, *, timeout_s: float = 3600) -> "ExecEvents":
        """A sidecar's output (call it on :meth:`container`): what it
        printed so far, then what it prints, until its process exits."""
        return ExecEvents(self._attach_events(self._req(tag="service"), timeout_s))

    async def _attach_events(self, req: Dict[str, Any], timeout_s: float) -> AsyncIterator[ExecEvent]:
        pid = ""
        st = await self._t.stream(_PROCESS, "ConnectProcess", req, timeout=timeout_s)
        try:
            async for m in st:
                ev = _event_of(m, pid)
                if ev is None:
                    continue
                pid = ev.process_id
                yield ev
                if ev.kind == "exit":
                    return
        finally:
            if not st.done:
                st.close()

    @property
    def sync(self) -> Sandbox:
        """A synchronous handle to the same sandbox (and container)."""
        sb = Sandbox(self._client.sync, self._info or self.id)
        return sb.container(self._container) if self._container else sb

    @property
    def _sb(self) -> Sandbox:  # the name adapters used before the client was native
        return self.sync

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.sync, name)
        return _wrap_sync(attr) if callable(attr) else attr

    @property
    def info(self) -> Optional[SandboxInfo]:
        """The status as last fetched (``await refresh()`` updates it)."""
        return self._info

    async def refresh(self) -> SandboxInfo:
        m = await self._t.unary(_LIFECYCLE, "GetSandbox", {"id": self.id}, retry=True)
        self._info = SandboxInfo._from(m)
        return self._info

    async def alive(self) -> bool:
        """Whether the sandbox is running (or paused). Never raises."""
        try:
            return (await self.refresh()).state in ("running", "paused")
        except Exception:
            return False

    # Processes.

    async def exec(self, cmd: Command, *, timeout_s: Optional[float] = None, stdin: Union[bytes, str, None] = None,
                   env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
                   max_output_bytes: Optional[int] = None, request_id: Optional[str] = None) -> ExecResult:
        """Run a command to completion: the synchronous ``exec``'s contract
        (a string runs with /bin/sh -c; a non-zero exit or a timeout is a
        result, with the head and tail of each stream; ``request_id`` makes
        it exactly-once). Cancelling the call, or its timing out, kills the
        process."""
        req = _exec_request(self.id, cmd, timeout_s=timeout_s, stdin=stdin, env=env, cwd=cwd, user=user,
                            max_output_bytes=max_output_bytes, request_id=request_id, container=self._container)
        tag = req["tag"] = _tag()
        sent = Sent()
        try:
            m = await self._t.unary(_PROCESS, "Exec", req, timeout=(timeout_s or 600) + 30,
                                    retry=request_id is not None, sent=sent)
        except BaseException:
            if sent.sent:
                await self._kill_tagged(tag)
            raise
        return ExecResult._from(m)

    async def _kill_tagged(self, tag: str) -> None:
        """Kill the process a cancelled exec started, found by its tag. It
        may start an instant after the call went away: look for it a few
        times. Best effort; never raises."""
        try:
            for _ in range(_KILL_POLLS):
                for p in await bounded(self.processes(), _KILL_WAIT_S):
                    if p.get("tag") == tag:
                        if p.get("running"):
                            await bounded(self.signal(p.get("processId", ""), "KILL"), _KILL_WAIT_S)
                        return
                await asyncio.sleep(_KILL_POLL_S)
        except (DsecError, OSError, asyncio.CancelledError):
            pass

    def exec_stream(self, cmd: Command, *, timeout_s: Optional[float] = None,
                    stdin: Union[bytes, str, None] = None, env: Optional[Mapping[str, str]] = None,
                    cwd: Optional[str] = None, user: Optional[str] = None,
                    max_output_bytes: Optional[int] = None, pty: bool = False, tag: Optional[str] = None,
                    request_id: Optional[str] = None) -> "ExecEvents":
        """Run a command and iterate its events as they happen ("started",
        "stdout", "stderr", "exit"). Output is read only as fast as it is
        consumed. Closing the events before "exit" kills the process: leave
        an ``async with sb.exec_stream(...) as events`` block, cancel, or
        ``await events.aclose()`` (a plain ``async for`` left with ``break``
        closes them when they are garbage collected)."""
        req = _exec_request(self.id, cmd, timeout_s=timeout_s, stdin=stdin, env=env, cwd=cwd, user=user,
                            max_output_bytes=max_output_bytes, pty=pty, tag=tag, request_id=request_id, container=self._container)
        req.setdefault("tag", _tag())
        return ExecEvents(self._events(req))

    async def _events(self, req: Dict[str, Any]) -> AsyncIterator[ExecEvent]:
        async with _ProcessStream(self, req) as ps:
            yield ExecEvent("started", process_id=ps.process_id)
            while True:
                m = await ps.next()
                if "stdout" in m:
                    yield ExecEvent("stdout", _wire.unb64(m["stdout"]), process_id=ps.process_id)
                elif "stderr" in m:
                    yield ExecEvent("stderr", _wire.unb64(m["stderr"]), process_id=ps.process_id)
                elif "exit" in m:
                    yield ExecEvent("exit", result=ExecResult._from(m["exit"]), process_id=ps.process_id)
                    return

    async def write_stdin(self, process_id: str, data: Union[bytes, str], *, close: bool = False) -> None:
        """Write to (and optionally close) a process's stdin (started with
        stdin open, e.g. a shell session)."""
        b = data.encode() if isinstance(data, str) else bytes(data)
        await self._t.unary(_PROCESS, "WriteStdin", {**self._req(), "processId": process_id,
                                                     "data": _wire.b64(b), "close": close})

    async def signal(self, process_id: str, signal: str = "TERM") -> None:
        """Send a signal ("TERM", "KILL", "INT" or a number) to a process's group."""
        await self._t.unary(_PROCESS, "SignalProcess", {**self._req(), "processId": process_id,
                                                        "signal": str(signal)}, retry=True)

    async def processes(self) -> List[Dict[str, Any]]:
        """The processes the sandbox's agent started, running or recently finished."""
        m = await self._t.unary(_PROCESS, "ListProcesses", self._req(), retry=True)
        return list(m.get("processes", []))

    async def shell(self, name: str = "default", *, startup: Optional[str] = None,
                    split_stderr: bool = False) -> "AsyncShellSession":
        """A persistent bash session (cwd and environment carry over). With
        ``split_stderr`` each command's stderr comes back on its own."""
        from .shell import AsyncShellSession

        return await AsyncShellSession.open(self, name, startup=startup, split_stderr=split_stderr)

    # Files.

    def _files_path(self, q: Mapping[str, str]) -> str:
        if self._container:
            q = {**q, "container": self._container}
        return f"/v1/sandboxes/{urllib.parse.quote(self.id)}/files?" + urllib.parse.urlencode(q)

    async def write_file(self, path: str, data: Union[bytes, str, IO[bytes]], *, mode: Optional[int] = None,
                         request_id: Optional[str] = None) -> FileInfo:
        """Write a file (parents are created); ``data`` may be a binary file
        object, which is streamed. With ``request_id`` the write is
        exactly-once."""
        q = {"path": path}
        if mode is not None:
            q["mode"] = format(mode, "o")
        if request_id:
            q["request_id"] = request_id
        body: Any = data.encode() if isinstance(data, str) else data
        m = await self._rest_json("PUT", self._files_path(q), body, retry=request_id is not None)
        return FileInfo(path=m.get("path", path), name=os.path.basename(path), type="file", size=_int(m.get("size")),
                        mode=_int(m.get("mode")), replayed=bool(m.get("replayed")))

    async def _rest_json(self, method: str, path: str, body: Any, retry: bool = False) -> Dict[str, Any]:
        import json

        attempt = 0
        while True:
            try:
                resp = await bounded(self._t.request(method, path, body, "application/octet-stream"), self._t.timeout)
                data = await bounded(resp.read(), self._t.timeout)
                if resp.status != 200:
                    raise _http_error(resp, data)
                return json.loads(data) if data else {}
            except DsecError as e:
                attempt += 1
                resendable = isinstance(body, (bytes, bytearray))
                if not (e.retryable and attempt <= self._t.max_retries and resendable and (e.kind == "exhausted" or retry)):
                    raise
                await asyncio.sleep(min(e.retry_after_s or 0.2 * 2 ** attempt, 5.0))

    async def read_file(self, path: str, *, max_bytes: Optional[int] = None) -> bytes:
        """Read a whole file (or its first ``max_bytes``)."""
        chunks = [c async for c in self.read_file_stream(path, max_bytes=max_bytes)]
        return b"".join(chunks)

    async def read_file_stream(self, path: str, *, max_bytes: Optional[int] = None) -> AsyncIterator[bytes]:
        """A file's bytes as they arrive."""
        q: Dict[str, str] = {"path": path}
        if max_bytes:
            q["max_bytes"] = str(max_bytes)
        resp = await bounded(self._t.request("GET", self._files_path(q), b"", "application/octet-stream"),
                               self._t.timeout)
        try:
            if resp.status != 200:
                raise _http_error(resp, await resp.read())
            while True:
                chunk = await resp.read_some()
                if not chunk:
                    return
                yield chunk
        finally:
            resp.close()

    async def upload(self, local_path: str, remote_path: str) -> FileInfo:
        """Stream a local file into the sandbox (its mode kept)."""
        with open(local_path, "rb") as f:
            return await self.write_file(remote_path, f, mode=os.stat(local_path).st_mode & 0o777)

    async def download(self, remote_path: str, local_path: str) -> None:
        """Stream a sandbox file to a local path (written whole or not at all)."""
        tmp = local_path + ".dsec-part"
        try:
            with open(tmp, "wb") as f:
                async for chunk in self.read_file_stream(remote_path):
                    f.write(chunk)
            os.replace(tmp, local_path)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise

    async def stat(self, path: str, *, user: Optional[str] = None) -> FileInfo:
        """A path's info (as ``user``, when given: a path that user cannot
        reach is PermissionDenied)."""
        req = self._req(path=path)
        if user:
            req["user"] = user
        return FileInfo._from(await self._t.unary(_FILES, "Stat", req, retry=True))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFound:
            return False

    async def list_dir(self, path: str, depth: int = 1) -> List[FileInfo]:
        m = await self._t.unary(_FILES, "ListDir", self._req(path=path, depth=depth), retry=True)
        return [FileInfo._from(e) for e in m.get("entries", [])]

    async def make_dir(self, path: str) -> FileInfo:
        return FileInfo._from(await self._t.unary(_FILES, "MakeDir", self._req(path=path)))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._t.unary(_FILES, "Remove", self._req(path=path, recursive=recursive))

    async def rename(self, src: str, dst: str) -> FileInfo:
        return FileInfo._from(await self._t.unary(_FILES, "Rename", self._req(**{"from": src, "to": dst})))

    # Lifecycle.

    async def keepalive(self, extend_ttl_s: Optional[int] = None) -> SandboxInfo:
        req: Dict[str, Any] = {"id": self.id}
        if extend_ttl_s:
            req["extendTtlS"] = str(int(extend_ttl_s))
        self._info = SandboxInfo._from(await self._t.unary(_LIFECYCLE, "Keepalive", req))
        return self._info

    async def pause(self, *, keep_memory: bool = True) -> SandboxInfo:
        """See dsec.Sandbox.pause (``keep_memory=False``: filesystem-only)."""
        req: Dict[str, Any] = {"id": self.id}
        if not keep_memory:
            req["filesystemOnly"] = True
        self._info = SandboxInfo._from(await self._t.unary(_LIFECYCLE, "PauseSandbox", req))
        return self._info

    async def resume(self) -> SandboxInfo:
        self._info = SandboxInfo._from(await self._t.unary(_LIFECYCLE, "ResumeSandbox", {"id": self.id}))
        return self._info

    async def snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        req: Dict[str, Any] = {"sandboxId": self.id}
        if name:
            req["name"] = name
        return SnapshotInfo._from(await self._t.unary(_SNAPSHOTS, "Snapshot", req, timeout=600))

    async def fork(self, n: int, *, labels: Optional[Mapping[str, str]] = None,
                   idempotency_key: Optional[str] = None) -> List["AsyncSandbox"]:
        return await self._client.fork(self, n, labels=labels, idempotency_key=idempotency_key)

    async def log(self, from_seq: int = 0) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        seq = from_seq
        while True:
            m = await self._t.unary(_LOGS, "GetLog", {"sandboxId": self.id, "fromSeq": str(seq)}, retry=True)
            entries = m.get("entries", [])
            out.extend(entries)
            nxt = _int(m.get("nextSeq"))
            if not entries or nxt <= seq:
                return out
            seq = nxt

    async def close(self) -> None:
        """Delete the sandbox. Idempotent."""
        if self._closed:
            return
        await self._client.delete(self.id)
        self._closed = True


class ExecEvents:
    """The events of a streaming exec: an async iterator, and an async
    context manager that kills the process if it is left before "exit"."""

    def __init__(self, gen: AsyncIterator[ExecEvent]) -> None:
        self._gen = gen

    def __aiter__(self) -> "ExecEvents":
        return self

    async def __anext__(self) -> ExecEvent:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """End the call (killing the process if it still runs). Idempotent."""
        await self._gen.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> "ExecEvents":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class _ProcessStream:
    """An ExecStream call whose process is killed if the call ends before
    the process does (cancellation, a timeout, an abandoned stream)."""

    def __init__(self, sb: AsyncSandbox, req: Dict[str, Any]) -> None:
        self.sb, self.req = sb, req
        self.st: Optional[Stream] = None
        self.process_id = ""
        self.exited = False
        self._opening: Optional["asyncio.Future[Stream]"] = None

    async def __aenter__(self) -> "_ProcessStream":
        # Shielded: a cancellation while the call is being opened must still
        # learn the process it started, to end it.
        self._opening = asyncio.ensure_future(self.sb._t.stream(_PROCESS, "ExecStream", self.req))
        try:
            self.st = await asyncio.shield(self._opening)
            m = await self.st.next()
            while m is not None and "keepalive" in m:
                m = await self.st.next()
            if m is None or "started" not in m:
                raise ConnectionFailed("exec stream did not start with the process")
            self.process_id = m["started"].get("processId", "")
        except BaseException:
            await self._end()
            raise
        return self

    async def next(self) -> Dict[str, Any]:
        assert self.st is not None
        while True:
            m = await self.st.next()
            if m is None:
                raise ConnectionFailed("exec stream ended without an exit")
            if "keepalive" in m:
                continue
            if "exit" in m:
                self.exited = True
            return m

    async def __aexit__(self, et: Any, e: Any, tb: Any) -> None:
        if self.exited:
            if self.st is not None and not self.st.done:
                try:  # read the end message so the connection is reused
                    await self.st.next()
                except BaseException:
                    self.st.close()
                    raise
            return
        await self._end()

    async def _end(self) -> None:
        """Close the stream first (the server then records nothing for the
        call), then kill the process."""
        try:
            if self.st is None and self._opening is not None:
                try:
                    self.st = await asyncio.wait_for(self._opening, _KILL_WAIT_S)
                except BaseException:
                    return
            if self.st is not None and not self.process_id and not self.st.done:
                try:
                    m = await asyncio.wait_for(self.st.next(), _KILL_WAIT_S)
                    if m and "started" in m:
                        self.process_id = m["started"].get("processId", "")
                except BaseException:
                    pass
            if self.st is not None:
                self.st.close()
            if self.process_id:
                await asyncio.wait_for(self.sb.signal(self.process_id, "KILL"), _KILL_WAIT_S)
        except (DsecError, OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            if self.st is not None:
                self.st.close()


class AsyncClient:
    """``await client.create(...)``, ``await sb.exec(...)``,
    ``await client.run_code(...)``: the synchronous Client's calls,
    awaitable, over pooled connections with no thread per call.

    ``url`` defaults to ``$DSEC_URL`` or http://127.0.0.1:7070, ``api_key``
    to ``$DSEC_API_KEY``. ``max_connections`` bounds calls in flight."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, *, timeout: float = 120.0,
                 max_connections: Optional[int] = None) -> None:
        self.url = url or os.environ.get("DSEC_URL") or DEFAULT_URL
        self._api_key = api_key if api_key is not None else os.environ.get("DSEC_API_KEY")
        self._timeout = timeout
        self._t = AsyncTransport(self.url, self._api_key, timeout, max_connections)
        self._sync: Optional[Client] = None

    @property
    def sync(self) -> Client:
        """A synchronous client for the same server."""
        if self._sync is None:
            self._sync = Client(self.url, self._api_key, timeout=self._timeout)
        return self._sync

    @property
    def max_connections(self) -> int:
        return self._t.max_connections

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.sync, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        async def call(*a: Any, **kw: Any) -> Any:
            a = tuple(x.sync if isinstance(x, AsyncSandbox) else x for x in a)
            out = await asyncio.to_thread(attr, *a, **kw)
            if isinstance(out, Sandbox):
                return AsyncSandbox(self, out)
            return out

        return call

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close idle connections (and the synchronous client's)."""
        self._t.close()
        if self._sync is not None:
            self._sync.close()

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle to an existing sandbox, without a call."""
        return AsyncSandbox(self, sandbox_id)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        m = await self._t.unary(_LIFECYCLE, "GetSandbox", {"id": sandbox_id}, retry=True)
        return AsyncSandbox(self, SandboxInfo._from(m))

    async def create(self, image: Optional[str] = None, *, count: Optional[int] = None,
                     idempotency_key: Optional[str] = None, timeout_s: float = 300,
                     compose: Union[str, Sequence[str], None] = None, compose_env: Optional[Mapping[str, str]] = None,
                     **spec: Any) -> Any:
        """Create a sandbox (the synchronous ``create``'s keywords)."""
        body = _build_spec(image, **spec)
        if count is not None and compose is not None:
            raise ValueError("compose creates one sandbox at a time")
        if count is not None:
            results = await self._create_many(body, int(count), idempotency_key, timeout_s)
            ok = [r for r in results if isinstance(r, AsyncSandbox)]
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
        m = await self._t.unary(_LIFECYCLE, "CreateSandbox", req, timeout=timeout_s, retry=idempotency_key is not None)
        return AsyncSandbox(self, SandboxInfo._from(m))

    async def create_many(self, image: Optional[str], n: int, *, idempotency_key: Optional[str] = None,
                          timeout_s: float = 600, **spec: Any) -> List[Union[AsyncSandbox, DsecError]]:
        return await self._create_many(_build_spec(image, **spec), n, idempotency_key, timeout_s)

    async def _create_many(self, spec: Dict[str, Any], n: int, key: Optional[str], timeout_s: float) -> List[Any]:
        req: Dict[str, Any] = {"spec": spec, "count": n}
        if key:
            req["idempotencyKey"] = key
        return self._results(await self._t.unary(_LIFECYCLE, "CreateSandboxes", req, timeout=timeout_s,
                                                 retry=key is not None))

    def _results(self, m: Dict[str, Any]) -> List[Any]:
        out: List[Any] = []
        for r in sorted(m.get("results", []), key=lambda r: _int(r.get("index"))):
            if r.get("error"):
                e = r["error"]
                out.append(make_error(e.get("kind", ""), e.get("message", ""), infra=e.get("infra"),
                                      retryable=e.get("retryable")))
            else:
                out.append(AsyncSandbox(self, SandboxInfo._from(r["sandbox"])))
        return out

    async def fork(self, sandbox: Union[str, AsyncSandbox, Sandbox], n: int, *,
                   labels: Optional[Mapping[str, str]] = None, idempotency_key: Optional[str] = None,
                   session: Optional[str] = None) -> List[AsyncSandbox]:
        sid = sandbox if isinstance(sandbox, str) else sandbox.id
        req: Dict[str, Any] = {"sandboxId": sid, "count": n}
        if labels:
            req["labels"] = {str(k): str(v) for k, v in labels.items()}
        if idempotency_key:
            req["idempotencyKey"] = idempotency_key
        if session:
            req["session"] = session
        results = self._results(await self._t.unary(_SNAPSHOTS, "Fork", req, timeout=600))
        ok = [r for r in results if isinstance(r, AsyncSandbox)]
        if not ok and results:
            raise results[0]
        return ok

    async def list(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None,
                   state: Optional[str] = None) -> List[SandboxInfo]:
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
            m = await self._t.unary(_LIFECYCLE, "ListSandboxes", req, retry=True)
            out.extend(SandboxInfo._from(s) for s in m.get("sandboxes", []))
            token = m.get("nextPageToken", "")
            if not token:
                return out

    async def delete(self, sandbox_id: Optional[str] = None, *, labels: Optional[Mapping[str, str]] = None,
                     selector: Optional[str] = None) -> List[str]:
        if sandbox_id is None:
            return await self._bulk("DeleteSandboxes", labels, selector)
        await self._t.unary(_LIFECYCLE, "DeleteSandbox", {"id": sandbox_id}, retry=True)
        return [sandbox_id]

    async def pause(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None,
                    keep_memory: bool = True) -> List[str]:
        return await self._bulk("PauseSandboxes", labels, selector, {} if keep_memory else {"filesystemOnly": True})

    async def resume(self, labels: Optional[Mapping[str, str]] = None, *, selector: Optional[str] = None) -> List[str]:
        return await self._bulk("ResumeSandboxes", labels, selector)

    async def _bulk(self, method: str, labels: Optional[Mapping[str, str]], selector: Optional[str],
                    extra: Optional[Dict[str, Any]] = None) -> List[str]:
        parts = [f"{k}={v}" for k, v in (labels or {}).items()]
        if selector:
            parts.append(selector)
        if not parts:
            raise ValueError("labels or selector is required")
        m = await self._t.unary(_LIFECYCLE, method, {"labelSelector": ",".join(parts), **(extra or {})}, timeout=600)
        fails = m.get("failures") or []
        if fails:
            f = fails[0]
            e = f.get("error", {})
            raise make_error(e.get("kind", ""), f"{len(fails)} sandboxes failed; first {f.get('id')}: {e.get('message', '')}",
                             infra=e.get("infra"), retryable=e.get("retryable"))
        return list(m.get("ids", []))

    async def info(self) -> Dict[str, Any]:
        return await self._t.unary(_SYSTEM, "GetInfo", {}, retry=True)

    async def capacity(self) -> Dict[str, Any]:
        return await self._t.unary(_SYSTEM, "GetCapacity", {}, retry=True)

    async def images(self) -> List[Dict[str, Any]]:
        return (await self._t.unary(_IMAGE, "ListImages", {}, retry=True)).get("images", [])

    async def snapshots(self) -> List[SnapshotInfo]:
        m = await self._t.unary(_SNAPSHOTS, "ListSnapshots", {}, retry=True)
        return [SnapshotInfo._from(s) for s in m.get("snapshots", [])]

    async def delete_snapshot(self, snapshot: Union[str, SnapshotInfo]) -> None:
        await self._t.unary(_SNAPSHOTS, "DeleteSnapshot", {"id": snapshot if isinstance(snapshot, str) else snapshot.id})

    async def run_code(self, code: str, language: str = "python", **kw: Any) -> RunCodeResult:
        """The synchronous ``run_code`` (a function call in a warm worker)."""
        timeout = (kw.get("compile_timeout") or 10) + (kw.get("run_timeout") or 10) * max(1, len(kw.get("tests") or [])) + 60
        m = await self._t.unary(_FUNCTION, "RunCode", _run_code_request(code, language, **kw), timeout=timeout, retry=True)
        return RunCodeResult._from(m)

    async def run_code_batch(self, calls: Sequence[Mapping[str, Any]]) -> List[RunCodeResult]:
        reqs = []
        for c in calls:
            c = dict(c)
            code = c.pop("code")
            language = c.pop("language", "python")
            reqs.append(_run_code_request(code, language, **c))
        m = await self._t.unary(_FUNCTION, "RunCodeBatch", {"calls": reqs}, timeout=3600, retry=True)
        return [RunCodeResult._from(r) for r in m.get("results", [])]

    async def run_code_many(self, calls: List[dict], concurrency: int = 64) -> List[RunCodeResult]:
        """Run calls concurrently (one request each), at most ``concurrency``
        in flight; results in order."""
        sem = asyncio.Semaphore(concurrency)

        async def one(c: dict) -> RunCodeResult:
            async with sem:
                c = dict(c)
                return await self.run_code(c.pop("code"), c.pop("language", "python"), **c)

        return list(await asyncio.gather(*(one(c) for c in calls)))


__all__ = ["AsyncClient", "AsyncSandbox", "ExecEvents"]
