"""asyncio client. It is not bound to an event loop: each call runs the
synchronous client in a worker thread (asyncio.to_thread), so one
AsyncClient works from any loop, including several loops in turn."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, List, Optional

from .client import Client, Sandbox


class AsyncSandbox:
    """The async face of a Sandbox: the same methods, awaitable."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb
        self.id = sb.id

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._sb, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        async def call(*a: Any, **kw: Any) -> Any:
            out = await asyncio.to_thread(attr, *a, **kw)
            return _wrap(out)

        return call

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self._sb.close)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"


def _wrap(out: Any) -> Any:
    if isinstance(out, Sandbox):
        return AsyncSandbox(out)
    if isinstance(out, list) and out and all(isinstance(x, Sandbox) for x in out):
        return [AsyncSandbox(x) for x in out]
    return out


class AsyncClient:
    """``await client.create(...)``, ``await sb.exec(...)``,
    ``await client.run_code(...)``: every Client method, awaitable."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, *, timeout: float = 120.0) -> None:
        self._c = Client(url, api_key, timeout=timeout)
        self.url = self._c.url

    @property
    def sync(self) -> Client:
        """The underlying synchronous client."""
        return self._c

    def __getattr__(self, name: str) -> Callable[..., Any]:
        attr = getattr(self._c, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        async def call(*a: Any, **kw: Any) -> Any:
            a = tuple(x._sb if isinstance(x, AsyncSandbox) else x for x in a)
            out = await asyncio.to_thread(attr, *a, **kw)
            return _wrap(out)

        return call

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._c.sandbox(sandbox_id))

    async def run_code_many(self, calls: List[dict], concurrency: int = 64) -> List[Any]:
        """Run calls concurrently (one request each), at most ``concurrency``
        in flight."""
        sem = asyncio.Semaphore(concurrency)

        async def one(c: dict) -> Any:
            async with sem:
                c = dict(c)
                return await asyncio.to_thread(self._c.run_code, c.pop("code"), c.pop("language", "python"), **c)

        return await asyncio.gather(*(one(c) for c in calls))

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._c.close()
