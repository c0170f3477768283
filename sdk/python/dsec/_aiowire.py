"""The Connect protocol (JSON codec) over HTTP/1.1 for asyncio, standard
library only.

A connection is a non-blocking socket driven by whichever event loop awaits
it (``loop.sock_recv`` / ``loop.sock_sendall``); no asyncio transport or
stream object is tied to it. So one pool of kept-alive connections serves
every loop and thread in turn: an AsyncClient is not bound to a loop, and a
connection kept alive after one ``asyncio.run`` is reused by the next.

Every parse step consumes bytes only once a whole unit (a header line, a
chunk size, an envelope) is buffered, and awaits only to read more: a call
cancelled at any await leaves the connection's buffer consistent. Unary
calls close the connection on cancellation (its answer is unknown); a
stream can be read on after a timed-out ``next()``, which is what a shell
session does between commands.

Backpressure: at most ``max_connections`` connections are in use at once
across the client (further calls wait for one); a stream is read only as
fast as its consumer asks, so a slow consumer slows the server's sender
through TCP flow control instead of buffering without bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, List, Optional, Tuple

from ._wire import error_from_json
from .errors import ConnectionFailed, DsecError, make_error

_USER_AGENT = "dsec-python-aio/0.1"
#: how long an idle connection is kept for reuse (the server keeps it 5 min)
_IDLE_S = 120.0
_READ = 65536


def default_max_connections() -> int:
    """Half the process's file descriptor limit, between 16 and 8192: more
    calls in flight than that wait for a connection instead of failing
    with EMFILE."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):  # pragma: no cover - exotic platforms
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, min(8192, soft // 2))


class Sent:
    """Set once a request may have reached the server."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


class _EOF(Exception):
    """The peer closed the connection."""


class _Slots:
    """A counting limit shared by every loop and thread (an asyncio
    semaphore belongs to one loop). ``acquire`` waits in FIFO order."""

    def __init__(self, n: int) -> None:
        self._mu = threading.RLock()  # release() may run from a finalizer
        self._free = n
        self._waiters: Deque[Tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]] = deque()

    async def acquire(self) -> None:
        with self._mu:
            if self._free > 0 and not self._waiters:
                self._free -= 1
                return
            loop = asyncio.get_running_loop()
            fut: "asyncio.Future[None]" = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            await fut
        except BaseException:
            with self._mu:
                try:
                    self._waiters.remove((loop, fut))
                except ValueError:  # already handed a slot: pass it on
                    self._release_locked()
            raise

    def release(self) -> None:
        with self._mu:
            self._release_locked()

    def _release_locked(self) -> None:
        while self._waiters:
            loop, fut = self._waiters.popleft()
            if loop.is_closed():
                continue
            loop.call_soon_threadsafe(_wake, fut)
            return
        self._free += 1


def _wake(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class _Conn:
    """One HTTP/1.1 connection. Used by one call at a time."""

    __slots__ = ("sock", "tls", "inc", "out", "buf", "idle_since", "closed")

    def __init__(self, sock: socket.socket, tls: Optional[ssl.SSLObject] = None,
                 inc: Optional[ssl.MemoryBIO] = None, out: Optional[ssl.MemoryBIO] = None) -> None:
        self.sock = sock
        self.tls, self.inc, self.out = tls, inc, out
        self.buf = bytearray()
        self.idle_since = 0.0
        self.closed = False

    @classmethod
    async def dial(cls, host: str, port: int, tls: Optional[ssl.SSLContext], infos: List[Any]) -> "_Conn":
        loop = asyncio.get_running_loop()
        err: Optional[BaseException] = None
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
            except BaseException as e:
                sock.close()
                if not isinstance(e, OSError):
                    raise
                err = e
                continue
            if tls is None:
                return cls(sock)
            inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
            c = cls(sock, tls.wrap_bio(inc, out, server_hostname=host), inc, out)
            try:
                await c._handshake()
            except BaseException:
                c.close()
                raise
            return c
        raise err or OSError(f"no address for {host}")

    def stale(self) -> bool:
        """Whether a kept-alive connection was closed by the server (or has
        unexpected bytes): then it must not be reused."""
        if time.monotonic() - self.idle_since > _IDLE_S:
            return True
        if self.tls is not None:
            # TLS 1.3 servers send session tickets after the handshake: a
            # readable socket is not a sign of closure. A closed one is
            # caught when the request fails (retried once).
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # EOF, or bytes nobody asked for
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    # Raw I/O, TLS underneath when configured.

    async def _handshake(self) -> None:
        assert self.tls is not None
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush_tls()
                data = await asyncio.get_running_loop().sock_recv(self.sock, _READ)
                if not data:
                    raise _EOF()
                self.inc.write(data)  # type: ignore[union-attr]
        await self._flush_tls()

    async def _flush_tls(self) -> None:
        data = self.out.read()  # type: ignore[union-attr]
        if data:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send(self, data: bytes) -> None:
        if self.tls is None:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
            return
        self.tls.write(data)
        await self._flush_tls()

    async def fill(self) -> None:
        """Read more into the buffer; raises _EOF at the end."""
        loop = asyncio.get_running_loop()
        if self.tls is None:
            data = await loop.sock_recv(self.sock, _READ)
            if not data:
                raise _EOF()
            self.buf += data
            return
        while True:
            try:
                data = self.tls.read(_READ)
                if not data:
                    raise _EOF()
                self.buf += data
                return
            except ssl.SSLWantReadError:
                await self._flush_tls()
                raw = await loop.sock_recv(self.sock, _READ)
                if not raw:
                    raise _EOF()
                self.inc.write(raw)  # type: ignore[union-attr]
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                raise _EOF()


class Response:
    """An HTTP response whose body is read on demand. ``release()`` returns
    the connection to the pool when the body was read to its end, else
    closes it; it is idempotent."""

    def __init__(self, t: "AsyncTransport", conn: _Conn, status: int, headers: Dict[str, str]) -> None:
        self._t = t
        self._conn: Optional[_Conn] = conn
        self.status = status
        self.headers = headers
        self.reason = ""
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        cl = headers.get("content-length")
        self._left = int(cl) if cl is not None and not self._chunked else -1  # -1: until close or chunked
        self._chunk_left = 0
        self._done = self._left == 0 or status in (204, 304)
        self._keep = headers.get("connection", "").lower() != "close" and (self._chunked or self._left >= 0)
        self._body = bytearray()  # decoded body bytes not yet handed out

    def header(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    # Decoding moves complete units from the connection's buffer into
    # self._body without awaiting, so a cancelled read loses nothing.

    def _decode(self) -> None:
        c = self._conn
        assert c is not None
        buf = c.buf
        if not self._chunked:
            if buf:
                n = len(buf) if self._left < 0 else min(len(buf), self._left)
                self._body += buf[:n]
                del buf[:n]
                if self._left >= 0:
                    self._left -= n
                    self._done = self._left == 0
            return
        while buf and not self._done:
            if self._chunk_left > 0:  # data
                n = min(len(buf), self._chunk_left)
                self._body += buf[:n]
                del buf[:n]
                self._chunk_left -= n
                if self._chunk_left == 0:
                    self._chunk_left = -1
            elif self._chunk_left == -1:  # the CRLF after a chunk's data
                if len(buf) < 2:
                    return
                del buf[:2]
                self._chunk_left = 0
            else:  # a size line; size 0 ends the body after its trailers
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                size = int(bytes(buf[:i]).split(b";", 1)[0].strip() or b"0", 16)
                if size > 0:
                    del buf[:i + 2]
                    self._chunk_left = size
                    continue
                j = buf.find(b"\r\n\r\n", i)
                if j < 0:
                    return
                del buf[:j + 4]
                self._done = True

    async def _pull(self) -> None:
        """Add body bytes to self._body, or reach the body's end."""
        c = self._conn
        if c is None:
            raise ConnectionFailed("the response was closed")
        n = len(self._body)
        while True:
            self._decode()
            if self._done or len(self._body) > n:
                return
            try:
                await c.fill()
            except _EOF:
                if self._left < 0 and not self._chunked:  # delimited by the close
                    self._done, self._keep = True, False
                    return
                self.close()
                raise ConnectionFailed("the connection closed mid-response") from None
            except OSError as e:
                self.close()
                raise ConnectionFailed(f"the connection broke: {e}") from e

    async def read_some(self) -> bytes:
        """The next piece of the body (b"" at its end)."""
        while not self._body:
            if self._done:
                self.release()
                return b""
            await self._pull()
        out = bytes(self._body)
        self._body.clear()
        if self._done:
            self.release()
        return out

    async def read(self) -> bytes:
        """The rest of the body."""
        while not self._done:
            await self._pull()
        out = bytes(self._body)
        self._body.clear()
        self.release()
        return out

    async def message(self) -> Optional[Tuple[int, bytes]]:
        """The next Connect envelope (flags, payload), or None at the body's
        end. Consumes the envelope only once all of it is buffered."""
        b = self._body
        while True:
            if len(b) >= 5:
                flags, n = struct.unpack_from(">BI", b)
                if len(b) >= 5 + n:
                    data = bytes(b[5:5 + n])
                    del b[:5 + n]
                    return flags, data
            if self._done:
                if b:
                    self.close()
                    raise ConnectionFailed("stream cut mid-message")
                self.release()
                return None
            await self._pull()

    def release(self) -> None:
        c = self._conn
        if c is None:
            return
        self._conn = None
        if self._done and self._keep and not c.buf and not self._body:
            self._t._put(c)
        else:
            c.close()
            self._t._slots.release()

    def close(self) -> None:
        """Drop the connection (the body is abandoned)."""
        c = self._conn
        if c is None:
            return
        self._conn = None
        c.close()
        self._t._slots.release()

    def __del__(self) -> None:  # an abandoned response gives its slot back
        self.close()


class Stream:
    """A server-streaming call's messages. ``next()`` returns the next
    message, or None after the end message; an error in the end message is
    raised. A ``next()`` cancelled by a timeout can be called again."""

    def __init__(self, resp: Response) -> None:
        self._resp = resp
        self.done = False

    async def next(self) -> Optional[Dict[str, Any]]:
        if self.done:
            return None
        m = await self._resp.message()
        if m is None:
            self.done = True
            raise ConnectionFailed("stream ended without an end message")
        flags, data = m
        obj = json.loads(data) if data else {}
        if flags & 0x02:
            self.done = True
            await self._resp.read()  # the body's end, so the connection can be reused
            if obj.get("error"):
                raise error_from_json(obj["error"])
            return None
        return obj

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Dict[str, Any]:
        m = await self.next()
        if m is None:
            raise StopAsyncIteration
        return m

    def close(self) -> None:
        """Abandon the stream: its connection is closed."""
        self.done = True
        self._resp.close()


class AsyncTransport:
    """Pooled HTTP/1.1 connections to one server, shared by every loop and
    thread. Safe for concurrent use."""

    def __init__(self, url: str, api_key: Optional[str], timeout: float,
                 max_connections: Optional[int] = None) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"dsec URL must be http:// or https://, got {url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = 5
        self.max_connections = max_connections or default_max_connections()
        self._tls = ssl.create_default_context() if u.scheme == "https" else None
        hostport = self.host if self.port in (80, 443) else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            hostport = f"[{self.host}]:{self.port}"
        self._base_headers = f"Host: {hostport}\r\nUser-Agent: {_USER_AGENT}\r\nConnect-Protocol-Version: 1\r\n"
        if api_key:
            self._base_headers += f"Authorization: Bearer {api_key}\r\n"
        self._mu = threading.Lock()
        self._idle: List[_Conn] = []
        self._slots = _Slots(self.max_connections)
        self._addrs: Optional[List[Any]] = None

    # The pool. A connection taken holds a slot until it is put back or
    # closed (Response.release / close).

    def _put(self, c: _Conn) -> None:
        c.idle_since = time.monotonic()
        with self._mu:
            self._idle.append(c)
        self._slots.release()

    async def _get(self) -> Tuple[_Conn, bool]:
        await self._slots.acquire()
        try:
            while True:
                with self._mu:
                    c = self._idle.pop() if self._idle else None
                if c is None:
                    break
                if c.stale():
                    c.close()
                    continue
                return c, True
            if self._addrs is None:
                self._addrs = await _resolve(self.host, self.port)
            try:
                return await _Conn.dial(self.host, self.port, self._tls, self._addrs), False
            except OSError:
                self._addrs = None  # resolve again next time
                raise
        except BaseException as e:
            self._slots.release()
            if isinstance(e, OSError):
                raise ConnectionFailed(f"cannot reach dsec at {self.host}:{self.port}: {e}") from e
            raise

    def close(self) -> None:
        """Close the idle connections (calls in flight keep theirs)."""
        with self._mu:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    @property
    def idle(self) -> int:
        return len(self._idle)

    # HTTP.

    async def request(self, method: str, path: str, body: Any = b"", content_type: Optional[str] = None,
                      extra: str = "", sent: Optional["Sent"] = None) -> Response:
        """Send a request and read the response's head. A kept-alive
        connection that turns out closed before any byte of the answer is
        replaced once, when the body can be sent again (bytes). ``sent`` is
        marked as soon as the server may have received the request."""
        for attempt in (0, 1):
            c, reused = await self._get()
            try:
                if sent is not None:
                    sent.sent = True
                await self._send(c, method, path, body, content_type, extra)
                return await self._head(c)
            except (_EOF, ConnectionResetError, BrokenPipeError) as e:
                c.close()
                self._slots.release()
                if attempt == 0 and reused and isinstance(body, (bytes, bytearray)):
                    continue
                raise ConnectionFailed(f"connection to dsec at {self.host}:{self.port} failed: {e or 'closed'}") from e
            except OSError as e:
                c.close()
                self._slots.release()
                raise ConnectionFailed(f"connection to dsec at {self.host}:{self.port} failed: {e}") from e
            except BaseException:
                c.close()
                self._slots.release()
                raise
        raise AssertionError("unreachable")

    async def _send(self, c: _Conn, method: str, path: str, body: Any, content_type: Optional[str], extra: str) -> None:
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._base_headers}{extra}"
        if content_type:
            head += f"Content-Type: {content_type}\r\n"
        if isinstance(body, (bytes, bytearray)):
            if body or method not in ("GET", "HEAD"):
                head += f"Content-Length: {len(body)}\r\n"
            await c.send(head.encode("latin-1") + b"\r\n" + bytes(body))
            return
        # A binary file object: its length when it has one, else chunked.
        size = _remaining(body)
        if size is not None:
            await c.send(head.encode("latin-1") + f"Content-Length: {size}\r\n\r\n".encode())
            while True:
                chunk = body.read(1 << 20)
                if not chunk:
                    return
                await c.send(chunk)
        await c.send(head.encode("latin-1") + b"Transfer-Encoding: chunked\r\n\r\n")
        while True:
            chunk = body.read(1 << 20)
            if not chunk:
                await c.send(b"0\r\n\r\n")
                return
            await c.send(b"%x\r\n" % len(chunk) + chunk + b"\r\n")

    async def _head(self, c: _Conn) -> Response:
        while True:
            i = c.buf.find(b"\r\n\r\n")
            if i >= 0:
                break
            if len(c.buf) > 1 << 20:
                raise ConnectionFailed("response head larger than 1 MiB")
            await c.fill()
        lines = bytes(c.buf[:i]).decode("latin-1").split("\r\n")
        del c.buf[:i + 4]
        parts = lines[0].split(" ", 2)
        status = int(parts[1])
        headers: Dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        r = Response(self, c, status, headers)
        r.reason = parts[2] if len(parts) > 2 else ""
        if status == 100:  # pragma: no cover - we never send Expect
            return await self._head(c)
        return r

    # Connect.

    async def unary(self, service: str, method: str, msg: Dict[str, Any], timeout: Optional[float] = None,
                    retry: bool = False, sent: Optional["Sent"] = None) -> Dict[str, Any]:
        """One unary call, bounded by ``timeout`` (default: the client's).
        A refused admission (exhausted) is retried after the server's
        Retry-After; transport failures and unavailability only when
        ``retry`` says the call is idempotent."""
        body = json.dumps(msg).encode()
        attempt = 0
        while True:
            try:
                return await bounded(self._unary(service, method, body, sent), timeout or self.timeout)
            except DsecError as e:
                attempt += 1
                if not (e.retryable and attempt <= self.max_retries and (e.kind == "exhausted" or retry)):
                    raise
                wait = e.retry_after_s if e.retry_after_s else min(0.2 * 2 ** attempt, 5.0)
                await asyncio.sleep(min(wait, 30.0))

    async def _unary(self, service: str, method: str, body: bytes, sent: Optional["Sent"]) -> Dict[str, Any]:
        resp = await self.request("POST", f"/{service}/{method}", body, "application/json", sent=sent)
        try:
            data = await resp.read()
        except BaseException:
            resp.close()
            raise
        if resp.status != 200:
            raise _http_error(resp, data)
        return json.loads(data) if data else {}

    async def stream(self, service: str, method: str, msg: Dict[str, Any], timeout: Optional[float] = None) -> Stream:
        """Open a server-streaming call: returns once the response's head
        arrived (errors before the first message are raised here), within
        ``timeout`` (None: no bound of its own)."""
        payload = json.dumps(msg).encode()
        body = struct.pack(">BI", 0, len(payload)) + payload
        attempt = 0
        while True:
            try:
                resp = await bounded(self.request("POST", f"/{service}/{method}", body, "application/connect+json"),
                                     timeout)
                if resp.status != 200:
                    data = await resp.read()
                    raise _http_error(resp, data)
                return Stream(resp)
            except DsecError as e:
                attempt += 1
                if not (e.kind == "exhausted" and attempt <= self.max_retries):
                    raise
                await asyncio.sleep(min(e.retry_after_s or min(0.2 * 2 ** attempt, 5.0), 30.0))


async def _resolve(host: str, port: int) -> List[Any]:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
    return list(await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM))


async def bounded(aw: Any, timeout: Optional[float]) -> Any:
    """Await aw for at most timeout seconds (None: no bound); past it, aw is
    cancelled and DeadlineExceeded raised. asyncio.timeout where the Python
    has it (3.11): no task per call."""
    if timeout is None:
        return await aw
    try:
        if _timeout is not None:
            async with _timeout(timeout):
                return await aw
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise make_error("deadline_exceeded", f"no answer from dsec within {timeout:g}s") from None


_timeout = getattr(asyncio, "timeout", None)


def _http_error(resp: Response, data: bytes) -> DsecError:
    """The error an HTTP answer other than 200 carries (Connect or REST)."""
    try:
        body = json.loads(data)
    except ValueError:
        body = {"code": "unavailable" if resp.status >= 500 else "unknown",
                "message": data.decode(errors="replace")[:500] or resp.reason}
    if not isinstance(body, dict):
        body = {"code": "unknown", "message": str(body)[:500]}
    if "infra" in body or "retryable" in body:  # the REST endpoints' shape
        ra = resp.header("Retry-After")
        return make_error(body.get("code", ""), body.get("message", ""), infra=body.get("infra"),
                          retryable=body.get("retryable"), retry_after_s=float(ra) if ra else None, status=resp.status)
    return error_from_json(body, resp.status, resp.header("Retry-After"))


def _remaining(f: Any) -> Optional[int]:
    """Bytes left in a file object, when knowable."""
    try:
        return os.fstat(f.fileno()).st_size - f.tell()
    except (AttributeError, OSError, ValueError):
        pass
    try:
        pos = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(pos)
        return end - pos
    except (AttributeError, OSError, ValueError):
        return None


async def messages(stream: Stream) -> AsyncIterator[Dict[str, Any]]:  # pragma: no cover - convenience
    async for m in stream:
        yield m
