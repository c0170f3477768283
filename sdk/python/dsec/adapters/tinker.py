"""tinker-cookbook ``SandboxInterface``.

    from dsec.adapters.tinker import DsecSandbox, sandbox_factory
    sandbox = await DsecSandbox.create(image="debian")   # or pass sandbox_factory(...) as a SandboxFactory
    result = await sandbox.run_command("pytest -q", workdir="/repo", timeout=120)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Union

from ..client import Client, Sandbox
from ..errors import DsecError, NotFound, SandboxGone


class SandboxTerminatedError(Exception):
    """The sandbox is gone (died, expired or deleted): the rollout cannot go on."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int
    metrics: Dict[str, Any] = field(default_factory=dict)


def _terminated(e: DsecError) -> bool:
    return isinstance(e, (SandboxGone, NotFound))


class DsecSandbox:
    """Implements tinker's SandboxInterface over one dsec sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    @classmethod
    async def create(cls, client: Optional[Client] = None, **create_kwargs: Any) -> "DsecSandbox":
        client = client or Client()
        sb = await asyncio.to_thread(client.create, **create_kwargs)
        return cls(sb)

    @property
    def sandbox_id(self) -> str:
        return self._sb.id

    async def _call(self, f: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return await asyncio.to_thread(f, *a, **kw)
        except DsecError as e:
            if _terminated(e):
                raise SandboxTerminatedError(str(e)) from e
            raise

    async def send_heartbeat(self, timeout: float = 30) -> None:
        await asyncio.wait_for(self._call(self._sb.keepalive), timeout)

    async def run_command(self, command: str, workdir: Optional[str] = None, timeout: float = 60,
                          max_output_bytes: Optional[int] = None) -> SandboxResult:
        try:
            r = await self._call(self._sb.exec, command, cwd=workdir, timeout_s=timeout, max_output_bytes=max_output_bytes)
        except SandboxTerminatedError:
            raise
        except DsecError as e:
            # tinker's convention: an infrastructure hiccup is an exit_code -1 result
            return SandboxResult(stdout="", stderr=str(e), exit_code=-1, metrics={"infra": e.infra})
        metrics = {"duration_ms": r.duration_ms, "timed_out": r.timed_out, "truncated": r.truncated}
        return SandboxResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code, metrics=metrics)

    async def read_file(self, path: str, max_bytes: Optional[int] = None, timeout: float = 60) -> str:
        data = await asyncio.wait_for(self._call(self._sb.read_file, path, max_bytes=max_bytes), timeout)
        return data.decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: Union[str, bytes], executable: bool = False, timeout: float = 60) -> None:
        await asyncio.wait_for(self._call(self._sb.write_file, path, content, mode=0o755 if executable else 0o644), timeout)

    async def cleanup(self) -> None:
        # Never raises: cleanup runs in finally blocks after the sandbox may
        # already have expired (tinker-cookbook PR #501).
        try:
            await asyncio.to_thread(self._sb.close)
        except DsecError:
            pass


def sandbox_factory(client: Optional[Client] = None, image: str = "debian", **create_kwargs: Any) -> Callable[..., Any]:
    """A tinker ``SandboxFactory``: ``(env_dir, timeout) -> SandboxInterface``.
    ``env_dir`` is uploaded to /workspace when given."""

    async def factory(env_dir: Optional[str] = None, timeout: Optional[float] = None) -> DsecSandbox:
        kw = dict(create_kwargs)
        if timeout:
            kw.setdefault("ttl_s", int(timeout))
        sb = await DsecSandbox.create(client, image=image, **kw)
        if env_dir:
            from .harbor import _upload_dir

            await asyncio.to_thread(_upload_dir, sb._sb, env_dir, "/workspace")
        return sb

    return factory
