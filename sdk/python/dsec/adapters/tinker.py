"""dsec as a tinker-cookbook sandbox (``tinker_cookbook.sandbox.SandboxInterface``).

Written against tinker-cookbook v0.5.5+ (``tinker_cookbook/sandbox/
sandbox_interface.py``, ``tinker_cookbook/exceptions.py``, and the callers in
``recipes/harbor_rl/harbor_env.py`` and ``harbor_tools.py``). ``run_command``,
``read_file`` and ``write_file`` return tinker's ``SandboxResult``; a sandbox
that died, expired or was deleted raises tinker's ``SandboxTerminatedError``;
other failures of a call come back as ``exit_code=-1`` results, as the Modal
sandbox returns them. With tinker-cookbook installed its classes are used;
without it, structurally identical stand-ins.

The switch is the factory harbor_rl takes (``SandboxFactory = Callable[[Path,
int], Awaitable[SandboxInterface]]``)::

    from dsec.adapters.tinker import sandbox_factory
    builder = HarborDatasetBuilder(..., sandbox_factory=sandbox_factory())

It builds the task's ``environment/Dockerfile`` through dsec (cached by
content: a group shares one build) and starts a sandbox with the given
lifetime. Refused, naming it: an environment directory without a Dockerfile
when no ``image`` is given (see ``_dockerfile`` for the Dockerfile
instructions the builder refuses).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, Mapping, Optional, Union

from ..aio import AsyncClient, AsyncSandbox
from ..errors import DsecError, NotFound, PermissionDenied, SandboxGone
from ._common import UnsupportedOption, async_client
from ._dockerfile import Builder

try:
    from tinker_cookbook.sandbox.sandbox_interface import SandboxResult, SandboxTerminatedError

    TINKER = True
except ImportError:
    TINKER = False

    class SandboxError(RuntimeError):
        """tinker-cookbook's base sandbox error (a TinkerCookbookError there)."""

    class SandboxTerminatedError(SandboxError):  # type: ignore[no-redef]
        """Raised when a sandbox has been terminated or died unexpectedly."""

    @dataclass(frozen=True)
    class SandboxResult:  # type: ignore[no-redef]
        """tinker's result of a sandbox operation."""

        stdout: str
        stderr: str
        exit_code: int
        metrics: Dict[str, Any] = field(default_factory=dict)


def _gone(e: DsecError) -> bool:
    return isinstance(e, SandboxGone) or (isinstance(e, NotFound) and "sandbox" in str(e))


class DsecSandbox:
    """tinker's SandboxInterface over one dsec sandbox."""

    def __init__(self, sandbox: AsyncSandbox, shell: str = "bash") -> None:
        self._sb = sandbox
        self._shell = shell

    @classmethod
    async def create(cls, client: Optional[AsyncClient] = None, **create_kwargs: Any) -> "DsecSandbox":
        """Create a sandbox (AsyncClient.create's keywords)."""
        sb = await (client or async_client()).create(**create_kwargs)
        shell = "bash" if (await sb.exec(["sh", "-c", "command -v bash"])).exit_code == 0 else "sh"
        return cls(sb, shell)

    @property
    def sandbox_id(self) -> str:
        return self._sb.id

    @property
    def sandbox(self) -> AsyncSandbox:
        return self._sb

    async def send_heartbeat(self, timeout: int = 30) -> None:
        """Reset the sandbox's idle timer."""
        try:
            await asyncio.wait_for(self._sb.keepalive(), timeout)
        except DsecError as e:
            if _gone(e):
                raise SandboxTerminatedError(str(e)) from e
            raise

    async def run_command(self, command: str, workdir: Optional[str] = None, timeout: int = 60,
                          max_output_bytes: Optional[int] = None) -> SandboxResult:
        """Run a command with a login shell (as Modal's ``bash -lc``)."""
        try:
            r = await self._sb.exec([self._shell, "-lc", command], cwd=workdir, timeout_s=timeout,
                                    max_output_bytes=max_output_bytes)
        except DsecError as e:
            if _gone(e):
                raise SandboxTerminatedError(str(e)) from e
            return SandboxResult(stdout="", stderr=str(e), exit_code=-1, metrics={"infra": e.infra})
        metrics = {"duration_ms": r.duration_ms, "timed_out": r.timed_out, "truncated": r.truncated}
        return SandboxResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code, metrics=metrics)

    async def read_file(self, path: str, max_bytes: Optional[int] = None, timeout: int = 60) -> SandboxResult:
        """The file's content as stdout; a missing or unreadable file is a
        non-zero exit with the reason in stderr (as ``cat`` reports it)."""
        try:
            data = await asyncio.wait_for(self._sb.read_file(path, max_bytes=max_bytes), timeout)
        except DsecError as e:
            if _gone(e):
                raise SandboxTerminatedError(str(e)) from e
            if isinstance(e, (NotFound, PermissionDenied)) or e.kind == "invalid":
                return SandboxResult(stdout="", stderr=f"cat: {path}: {e.message}", exit_code=1)
            return SandboxResult(stdout="", stderr=str(e), exit_code=-1, metrics={"infra": e.infra})
        return SandboxResult(stdout=data.decode("utf-8", errors="replace"), stderr="", exit_code=0)

    async def write_file(self, path: str, content: Union[str, bytes] = "", executable: bool = False,
                         timeout: int = 60) -> SandboxResult:
        """Write a file (parents made); ``executable`` makes it 0755."""
        try:
            await asyncio.wait_for(self._sb.write_file(path, content, mode=0o755 if executable else 0o644), timeout)
        except DsecError as e:
            if _gone(e):
                raise SandboxTerminatedError(str(e)) from e
            if isinstance(e, PermissionDenied) or e.kind in ("invalid", "not_found"):
                return SandboxResult(stdout="", stderr=f"{path}: {e.message}", exit_code=1)
            return SandboxResult(stdout="", stderr=str(e), exit_code=-1, metrics={"infra": e.infra})
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        """Delete the sandbox. A sandbox already gone is not an error (cleanup
        runs in finally blocks after the sandbox may have expired)."""
        try:
            await self._sb.close()
        except DsecError as e:
            if not _gone(e):
                raise


def sandbox_factory(client: Optional[AsyncClient] = None, *, image: Optional[str] = None, kind: str = "container",
                    image_map: Optional[Mapping[str, str]] = None, build_network: str = "egress",
                    **create_kwargs: Any) -> Callable[[Path, int], Awaitable[DsecSandbox]]:
    """A tinker ``SandboxFactory``: ``(env_dir, timeout) -> SandboxInterface``.

    ``env_dir`` is the task's environment directory: its Dockerfile is built
    through dsec (once per content) and the sandbox starts from the result,
    living ``timeout`` seconds. ``image`` is used for an environment
    directory without a Dockerfile. ``create_kwargs`` are AsyncClient.create's
    (cpu, memory_mb, network, labels...)."""
    c = client or async_client()
    builder = Builder(c, kind=kind, image_map=image_map, network=build_network, prefix="tinker-build-")

    async def factory(env_dir: Union[Path, str], timeout: int) -> DsecSandbox:
        kw: Dict[str, Any] = dict(create_kwargs, kind=kind)
        if timeout:
            kw["ttl_s"] = int(timeout)
        if os.path.exists(os.path.join(str(env_dir), "Dockerfile")):
            kw.update((await builder.image_for(str(env_dir))).spec())
        elif image:
            kw["image"] = image
        else:
            raise UnsupportedOption("dsec tinker sandbox_factory", f"environment {env_dir} without a Dockerfile",
                                    "give sandbox_factory(image=...) for environments that bring none")
        return await DsecSandbox.create(c, **kw)

    return factory


__all__ = ["DsecSandbox", "SandboxResult", "SandboxTerminatedError", "sandbox_factory", "TINKER"]
