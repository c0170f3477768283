"""What every adapter shares: the error for an option dsec cannot honour,
keyword checking, shared clients, and directory transfer."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..aio import AsyncClient, AsyncSandbox
from ..client import Client

#: kinds whose sandboxes enforce resources.disk_mb (a container's writable
#: layer is a file system of that size, a machine's disk has it; a function
#: sandbox has no disk of its own: a storage request there is refused)
DISK_KINDS = ("container", "microvm", "vm")
#: kinds whose sandboxes take an egress policy and may change it while they
#: run (function sandboxes have no network: docs/egress.md)
POLICY_KINDS = ("container", "microvm", "vm")


class UnsupportedOption(ValueError):
    """A requested option (a network policy, a storage size, a resource, a
    compose file...) that dsec cannot honour. Adapters raise it rather than
    drop the option or grant something wider."""

    def __init__(self, adapter: str, option: str, why: str) -> None:
        self.adapter, self.option = adapter, option
        super().__init__(f"{adapter}: {option} is not supported by dsec: {why}")


def reject_unknown(adapter: str, kwargs: Mapping[str, Any], known: Iterable[str] = ()) -> None:
    """Raise TypeError naming the keywords an adapter does not understand
    (an adapter never forwards what it does not understand)."""
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"{adapter}: unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(dsec does not forward options it does not understand)")


_clients: Dict[Tuple[str, str, str], Any] = {}
_clients_mu = threading.Lock()


def async_client(url: Optional[str] = None, api_key: Optional[str] = None) -> AsyncClient:
    """One AsyncClient per server and key in the process, so every
    environment a framework builds shares one connection pool."""
    url = url or os.environ.get("DSEC_URL") or ""
    key = api_key if api_key is not None else os.environ.get("DSEC_API_KEY") or ""
    with _clients_mu:
        c = _clients.get(("aio", url, key))
        if c is None:
            c = _clients[("aio", url, key)] = AsyncClient(url or None, key or None)
        return c


def sync_client(url: Optional[str] = None, api_key: Optional[str] = None) -> Client:
    """The synchronous counterpart of :func:`async_client`."""
    url = url or os.environ.get("DSEC_URL") or ""
    key = api_key if api_key is not None else os.environ.get("DSEC_API_KEY") or ""
    with _clients_mu:
        c = _clients.get(("sync", url, key))
        if c is None:
            c = _clients[("sync", url, key)] = Client(url or None, key or None)
        return c


async def upload_dir(sb: AsyncSandbox, local_dir: str, remote_dir: str, concurrency: int = 16) -> None:
    """Copy a local directory tree into the sandbox (modes kept, empty
    directories made), a few files at a time."""
    local_dir = os.fspath(local_dir)
    files = []
    dirs = [remote_dir]
    for root, ds, fs in os.walk(local_dir):
        rel = os.path.relpath(root, local_dir)
        for d in ds:
            dirs.append(os.path.normpath(os.path.join(remote_dir, rel, d)))
        for f in fs:
            files.append((os.path.join(root, f), os.path.normpath(os.path.join(remote_dir, rel, f))))
    for i in range(0, len(dirs), 500):
        await sb.exec(["mkdir", "-p", *dirs[i:i + 500]])
    sem = asyncio.Semaphore(concurrency)

    async def one(src: str, dst: str) -> None:
        async with sem:
            await sb.upload(src, dst)

    await asyncio.gather(*(one(s, d) for s, d in files))


async def download_dir(sb: AsyncSandbox, remote_dir: str, local_dir: str, concurrency: int = 16,
                       skip: Optional[Callable[[str], bool]] = None) -> None:
    """Copy a sandbox directory tree to a local directory (regular files
    and directories, modes kept; existing files are overwritten; symbolic
    links are not followed out of the tree and are skipped; so are the
    paths, relative to remote_dir, for which ``skip`` is true)."""
    local_dir = os.fspath(local_dir)
    root = os.path.realpath(local_dir)
    os.makedirs(root, exist_ok=True)
    entries = await sb.list_dir(remote_dir, depth=64)
    base = remote_dir.rstrip("/") + "/"
    sem = asyncio.Semaphore(concurrency)
    todo = []
    for e in entries:
        rel = e.path[len(base):] if e.path.startswith(base) else e.name
        if skip is not None and (skip(rel) or any(skip(p) for p in _parents(rel))):
            continue
        dest = os.path.realpath(os.path.join(root, rel))
        if not (dest == root or dest.startswith(root + os.sep)):
            continue
        if e.type == "dir":
            os.makedirs(dest, exist_ok=True)
        elif e.type == "file":
            todo.append((e.path, dest, e.mode))

    async def one(src: str, dst: str, mode: int) -> None:
        async with sem:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            await sb.download(src, dst)
            if mode:
                os.chmod(dst, stat.S_IMODE(mode))

    await asyncio.gather(*(one(*t) for t in todo))


def _parents(rel: str) -> List[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


class StandInModel:
    """A stand-in for a framework's pydantic model when the framework is not
    installed: a dataclass with pydantic's ``model_dump``."""

    def model_dump(self, **_: Any) -> Dict[str, Any]:
        return dict(self.__dict__)
