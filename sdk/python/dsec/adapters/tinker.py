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
    asyncio.run(cli_main(cli_config, tasks, sandbox_factory=sandbox_factory()))

It builds the task's ``environment/Dockerfile`` through dsec (cached by
content: a group shares one build) and starts a sandbox with the given
lifetime. The factory pickles, as tinker's EnvGroupBuilders must. Refused,
naming it: an environment directory without a Dockerfile when no ``image``
is given (see ``_dockerfile`` for the Dockerfile instructions the builder
refuses).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

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

    def __init__(self, sandbox: AsyncSandbox, shell: str = "bash", max_output_bytes: int = 128 * 1024) -> None:
        self._sb = sandbox
        self._shell = shell
        self._max_output_bytes = max_output_bytes

    @classmethod
    async def create(cls, client: Optional[AsyncClient] = None, *, max_output_bytes: int = 128 * 1024,
                     **create_kwargs: Any) -> "DsecSandbox":
        """Create a sandbox (AsyncClient.create's keywords). Commands' output
        is capped at ``max_output_bytes`` per stream unless a call says
        otherwise (Modal's default, 128 KiB)."""
        sb = await (client or async_client()).create(**create_kwargs)
        try:
            shell = "bash" if (await sb.exec(["sh", "-c", "command -v bash"])).exit_code == 0 else "sh"
        except BaseException:
            await sb.close()
            raise
        return cls(sb, shell, max_output_bytes)

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
                                    max_output_bytes=max_output_bytes or self._max_output_bytes)
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


class DsecSandboxFactory:
    """A tinker ``SandboxFactory``: ``await factory(env_dir, timeout)``
    returns a DsecSandbox. Picklable (tinker pickles its EnvGroupBuilders,
    which hold the factory): it keeps the server's URL and key, not a
    connection.

    ``env_dir`` is the task's environment directory: its Dockerfile is built
    through dsec (once per content, see ``_dockerfile``) and the sandbox
    starts from the result, living ``timeout`` seconds. ``image`` is used
    for an environment directory without a Dockerfile; without one, that is
    refused. ``create_kwargs`` are AsyncClient.create's (cpu, memory_mb,
    network, labels...); ``network`` defaults to ``egress``, as a Modal
    sandbox has the internet."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, *, image: Optional[str] = None,
                 kind: str = "container", image_map: Optional[Mapping[str, str]] = None,
                 build_network: str = "egress", max_output_bytes: int = 128 * 1024,
                 client: Optional[AsyncClient] = None, **create_kwargs: Any) -> None:
        self.url, self.api_key = url, api_key
        self.image, self.kind, self.image_map = image, kind, dict(image_map or {})
        self.build_network, self.max_output_bytes = build_network, max_output_bytes
        self.create_kwargs = {"network": "egress", **create_kwargs}
        self._client = client

    def __getstate__(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_client"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = None

    def client(self) -> AsyncClient:
        return self._client or async_client(self.url, self.api_key)

    async def __call__(self, env_dir: Union[Path, str], timeout: int) -> DsecSandbox:
        c = self.client()
        kw: Dict[str, Any] = dict(self.create_kwargs, kind=self.kind)
        if timeout:
            kw["ttl_s"] = int(timeout)
        if os.path.exists(os.path.join(str(env_dir), "Dockerfile")):
            builder = Builder(c, kind=self.kind, image_map=self.image_map, network=self.build_network,
                              prefix="tinker-build-")
            kw.update((await builder.image_for(str(env_dir))).spec())
        elif self.image:
            kw["image"] = self.image_map.get(self.image, self.image)
        else:
            raise UnsupportedOption("dsec tinker sandbox factory", f"environment {env_dir} without a Dockerfile",
                                    "give DsecSandboxFactory(image=...) for environments that bring none")
        return await DsecSandbox.create(c, max_output_bytes=self.max_output_bytes, **kw)


def sandbox_factory(url: Optional[str] = None, api_key: Optional[str] = None, **kwargs: Any) -> DsecSandboxFactory:
    """The factory for harbor_rl's ``sandbox_factory`` (see DsecSandboxFactory)."""
    if isinstance(url, AsyncClient):  # sandbox_factory(client, ...)
        return DsecSandboxFactory(client=url, api_key=api_key, **kwargs)
    return DsecSandboxFactory(url, api_key, **kwargs)


__all__ = ["DsecSandbox", "DsecSandboxFactory", "SandboxResult", "SandboxTerminatedError", "sandbox_factory", "TINKER"]
