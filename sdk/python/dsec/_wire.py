"""The Connect protocol (JSON codec) over http.client, standard library only.

Unary calls POST JSON; server-streaming calls exchange enveloped messages
(1 flag byte, 4 length bytes, JSON). Connections are kept alive and reused
per thread.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import struct
import threading
import time
import urllib.parse
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence

from .errors import ConnectionFailed, DsecError, make_error


def _decode_error_info(raw: bytes) -> Dict[str, Any]:
    """Decode a dsec.v1.ErrorInfo protobuf (kind=1, infra=2, retryable=3,
    retry_after_ms=4) without a protobuf library."""
    out: Dict[str, Any] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = 0
        v = 0
        while True:
            b = raw[i]
            i += 1
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                return v
            shift += 7

    while i < len(raw):
        key = varint()
        field, wt = key >> 3, key & 7
        if wt == 0:
            v = varint()
            if field == 2:
                out["infra"] = bool(v)
            elif field == 3:
                out["retryable"] = bool(v)
            elif field == 4:
                out["retry_after_ms"] = v
        elif wt == 2:
            n = varint()
            val = raw[i : i + n]
            i += n
            if field == 1:
                out["kind"] = val.decode()
        else:
            break
    return out


def error_from_json(body: Dict[str, Any], status: Optional[int] = None, retry_after: Optional[str] = None) -> DsecError:
    code = body.get("code", "unknown")
    message = body.get("message") or code
    info: Dict[str, Any] = {}
    for d in body.get("details") or []:
        if d.get("type") == "dsec.v1.ErrorInfo":
            if isinstance(d.get("debug"), dict):
                dbg = d["debug"]
                info = {
                    "kind": dbg.get("kind", ""),
                    "infra": bool(dbg.get("infra", False)),
                    "retryable": bool(dbg.get("retryable", False)),
                    "retry_after_ms": int(dbg.get("retryAfterMs", dbg.get("retry_after_ms", 0)) or 0),
                }
            else:
                v = d.get("value", "")
                info = _decode_error_info(base64.b64decode(v + "=" * (-len(v) % 4)))
    ra = None
    if info.get("retry_after_ms"):
        ra = info["retry_after_ms"] / 1000.0
    elif retry_after:
        try:
            ra = float(retry_after)
        except ValueError:
            ra = None
    return make_error(
        info.get("kind", ""),
        message,
        code=code,
        infra=info.get("infra") if info else None,
        retryable=info.get("retryable") if info else None,
        retry_after_s=ra,
        status=status,
    )


def _envelope(msg: Dict[str, Any]) -> bytes:
    """A Connect streaming message (JSON) in its envelope."""
    payload = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


class Transport:
    """HTTP/1.1 connections to one server, one per thread, reused."""

    def __init__(self, url: str, api_key: Optional[str], timeout: float) -> None:
        u = urllib.parse.urlsplit(url)
        self.url = url
        if u.scheme not in ("http", "https"):
            raise ValueError(f"dsec URL must be http:// or https://, got {url!r}")
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = 5
        self._local = threading.local()

    def _conn(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            c = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = c
        c.timeout = timeout if timeout is not None else self.timeout
        if c.sock is not None:
            c.sock.settimeout(c.timeout)
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def close(self) -> None:
        self._drop()

    def headers(self, content_type: str) -> Dict[str, str]:
        h = {"Content-Type": content_type, "Connect-Protocol-Version": "1", "User-Agent": "dsec-python/0.1"}
        if self.api_key:
            h["Authorization"] = "Bearer " + self.api_key
        return h

    def request(self, method: str, path: str, body: Any = None, headers: Optional[Dict[str, str]] = None,
                timeout: Optional[float] = None) -> http.client.HTTPResponse:
        """Send a request, reconnecting once if a kept-alive connection went
        stale before any byte of the answer arrived."""
        for attempt in (0, 1):
            c = self._conn(timeout)
            try:
                c.request(method, self.prefix + path, body=body, headers=headers or {})
                return c.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._drop()
                # Only a stale keep-alive connection is retried, and only
                # when the body can be sent again.
                if attempt == 1 or not (body is None or isinstance(body, (bytes, str))):
                    raise ConnectionFailed(f"connection to dsec at {self.host}:{self.port} failed: {e}") from e
            except (ConnectionRefusedError, socket.gaierror, OSError) as e:
                self._drop()
                if isinstance(e, socket.timeout):
                    raise make_error("deadline_exceeded", f"no answer from dsec within {c.timeout}s") from e
                raise ConnectionFailed(f"cannot reach dsec at {self.host}:{self.port}: {e}") from e
        raise AssertionError("unreachable")

    def unary(self, service: str, method: str, msg: Dict[str, Any], timeout: Optional[float] = None,
              retry: bool = False) -> Dict[str, Any]:
        """One unary call. A refused admission (exhausted) is retried after
        the server's Retry-After: nothing happened, so it is safe for any
        call. Transport failures and unavailability are retried only when
        ``retry`` says the call is idempotent."""
        attempt = 0
        while True:
            try:
                return self._unary(service, method, msg, timeout)
            except DsecError as e:
                attempt += 1
                again = e.retryable and attempt <= self.max_retries and (e.kind == "exhausted" or retry)
                if not again:
                    raise
                wait = e.retry_after_s if e.retry_after_s else min(0.2 * 2 ** attempt, 5.0)
                time.sleep(min(wait, 30.0))

    def _unary(self, service: str, method: str, msg: Dict[str, Any], timeout: Optional[float]) -> Dict[str, Any]:
        body = json.dumps(msg).encode()
        resp = self.request("POST", f"/{service}/{method}", body, self.headers("application/json"), timeout)
        data = resp.read()
        if resp.status != 200:
            try:
                err = json.loads(data)
            except ValueError:
                err = {"code": "unavailable" if resp.status >= 500 else "unknown", "message": data.decode(errors="replace")[:500] or resp.reason}
            raise error_from_json(err, resp.status, resp.getheader("Retry-After"))
        return json.loads(data) if data else {}

    def client_stream(self, service: str, method: str, first: Sequence[Dict[str, Any]], data: Iterable[bytes]) -> Dict[str, Any]:
        """A client-streaming call: ``first`` messages, then one data message
        per chunk of ``data``, sent chunked as they come; returns the answer."""

        def body() -> Iterator[bytes]:
            for m in first:
                yield _envelope(m)
            for b in data:
                yield _envelope({"data": b64(b)})

        # http.client sends an iterable body chunked.
        resp = self.request("POST", f"/{service}/{method}", body(), self.headers("application/connect+json"))
        raw = resp.read()
        if resp.status != 200:
            try:
                err = json.loads(raw)
            except ValueError:
                err = {"code": "unknown", "message": raw.decode(errors="replace")[:500]}
            raise error_from_json(err, resp.status)
        out: Dict[str, Any] = {}
        i = 0
        while i + 5 <= len(raw):
            flags, n = struct.unpack(">BI", raw[i:i + 5])
            obj = json.loads(raw[i + 5:i + 5 + n]) if n else {}
            i += 5 + n
            if flags & 0x02:
                if obj.get("error"):
                    raise error_from_json(obj["error"])
            else:
                out = obj
        return out

    def stream(self, service: str, method: str, msg: Dict[str, Any], timeout: Optional[float] = None) -> Iterator[Dict[str, Any]]:
        """A server-streaming call; yields each message. The connection is
        used exclusively until the stream ends."""
        resp = self.request("POST", f"/{service}/{method}", _envelope(msg), self.headers("application/connect+json"), timeout)
        if resp.status != 200:
            data = resp.read()
            try:
                err = json.loads(data)
            except ValueError:
                err = {"code": "unknown", "message": data.decode(errors="replace")[:500]}
            raise error_from_json(err, resp.status)
        try:
            while True:
                head = _read_exact(resp, 5)
                if head is None:
                    raise ConnectionFailed("stream ended without an end message")
                flags, n = struct.unpack(">BI", head)
                data = _read_exact(resp, n) if n else b""
                if data is None:
                    raise ConnectionFailed("stream cut mid-message")
                obj = json.loads(data) if data else {}
                if flags & 0x02:
                    resp.read()  # the body's end, so the connection can be reused
                    if obj.get("error"):
                        raise error_from_json(obj["error"])
                    return
                yield obj
        except (socket.timeout, TimeoutError) as e:
            self._drop()
            raise make_error("deadline_exceeded", "stream timed out") from e
        except GeneratorExit:
            # Abandoned mid-stream: the connection holds unread data.
            self._drop()
            raise
        except (http.client.HTTPException, OSError) as e:
            self._drop()
            raise ConnectionFailed(f"stream broke: {e}") from e


def _read_exact(resp: http.client.HTTPResponse, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        chunk = resp.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(s: Optional[str]) -> bytes:
    if not s:
        return b""
    return base64.b64decode(s + "=" * (-len(s) % 4))


def now() -> float:
    return time.monotonic()
