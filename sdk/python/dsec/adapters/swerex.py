"""dsec as a SWE-ReX deployment and runtime (SWE-agent, mini-SWE-agent and
other code that drives ``swerex.runtime.abstract.AbstractRuntime``; ROCK's
own client, which ROLL uses, is :mod:`dsec.adapters.rock`).

Written against SWE-ReX 1.4.0 (``swerex/runtime/abstract.py``,
``swerex/deployment/abstract.py``, ``swerex/exceptions.py``) and SWE-agent
1.1.0's ``sweagent/environment/swe_env.py`` and ``sweagent/agent/agents.py``,
which use it. The methods take and return SWE-ReX's request and response
models and raise SWE-ReX's exceptions (CommandTimeoutError,
NonZeroExitCodeError, BashIncorrectSyntaxError, SessionExistsError,
SessionDoesNotExistError, DeploymentNotStartedError), the ones SWE-agent
catches; a sandbox that died raises ``SandboxTerminated``, a SwerexException
(SWE-agent exits the episode with "environment error") that also carries
dsec's ``infra`` flag. With SWE-ReX installed its classes are used; without
it, structurally identical stand-ins (same names, fields and defaults).

SWE-agent builds its deployment from a closed config union, so it takes the
deployment object directly::

    from dsec.adapters.swerex import DsecDeployment
    env = SWEEnv(deployment=DsecDeployment(image="debian"), repo=repo, post_startup_commands=[])

Every call works from any event loop (SWE-agent runs each in its own
``asyncio.run``): sessions read their output only while a command runs.

Not supported, refused with UnsupportedOption when asked for:
``BashAction.is_interactive_command``/``is_interactive_quit``/``expect``
(commands that do not return to the prompt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Union

from ..aio import AsyncSandbox
from ..errors import DeadlineExceeded, DsecError, NotFound, SandboxGone
from ..shell import AsyncShellSession
from ._common import StandInModel, UnsupportedOption, async_client, sync_client, upload_dir

_NAME = "dsec SWE-ReX runtime"

try:
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import (BashIncorrectSyntaxError, CommandTimeoutError, DeploymentNotStartedError,
                                   DeploymentStartupError, NonZeroExitCodeError, SessionDoesNotExistError,
                                   SessionExistsError, SwerexException)
    from swerex.runtime.abstract import (AbstractRuntime, BashAction, BashInterruptAction, BashObservation,
                                         CloseBashSessionRequest, CloseBashSessionResponse, CloseResponse, Command,
                                         CommandResponse, CreateBashSessionRequest, CreateBashSessionResponse,
                                         IsAliveResponse, ReadFileRequest, ReadFileResponse, UploadRequest,
                                         UploadResponse, WriteFileRequest, WriteFileResponse)

    SWEREX = True
except ImportError:
    SWEREX = False

    class SwerexException(Exception):  # type: ignore[no-redef]
        """SWE-ReX's base exception."""

    class NonZeroExitCodeError(SwerexException, RuntimeError):  # type: ignore[no-redef]
        pass

    class BashIncorrectSyntaxError(SwerexException, RuntimeError):  # type: ignore[no-redef]
        def __init__(self, message: str, *, extra_info: Optional[Dict[str, Any]] = None) -> None:
            super().__init__(message)
            self.extra_info = extra_info or {}

    class CommandTimeoutError(SwerexException, RuntimeError, TimeoutError):  # type: ignore[no-redef]
        pass

    class SessionExistsError(SwerexException, ValueError):  # type: ignore[no-redef]
        pass

    class SessionDoesNotExistError(SwerexException, ValueError):  # type: ignore[no-redef]
        pass

    class DeploymentNotStartedError(SwerexException, RuntimeError):  # type: ignore[no-redef]
        def __init__(self, message: str = "Deployment not started") -> None:
            super().__init__(message)

    class DeploymentStartupError(SwerexException, RuntimeError):  # type: ignore[no-redef]
        pass

    _Model = StandInModel

    @dataclass
    class IsAliveResponse(_Model):  # type: ignore[no-redef]
        is_alive: bool
        message: str = ""

        def __bool__(self) -> bool:
            return self.is_alive

    @dataclass
    class CreateBashSessionRequest(_Model):  # type: ignore[no-redef]
        startup_source: List[str] = field(default_factory=list)
        session: str = "default"
        session_type: str = "bash"
        startup_timeout: float = 1.0

    @dataclass
    class CreateBashSessionResponse(_Model):  # type: ignore[no-redef]
        output: str = ""
        session_type: str = "bash"

    @dataclass
    class BashAction(_Model):  # type: ignore[no-redef]
        command: str
        session: str = "default"
        timeout: Optional[float] = None
        is_interactive_command: bool = False
        is_interactive_quit: bool = False
        check: str = "raise"
        error_msg: str = ""
        expect: List[str] = field(default_factory=list)
        action_type: str = "bash"

    @dataclass
    class BashInterruptAction(_Model):  # type: ignore[no-redef]
        session: str = "default"
        timeout: float = 0.2
        n_retry: int = 3
        expect: List[str] = field(default_factory=list)
        action_type: str = "bash_interrupt"

    @dataclass
    class BashObservation(_Model):  # type: ignore[no-redef]
        output: str = ""
        exit_code: Optional[int] = None
        failure_reason: str = ""
        expect_string: str = ""
        session_type: str = "bash"

    @dataclass
    class CloseBashSessionRequest(_Model):  # type: ignore[no-redef]
        session: str = "default"
        session_type: str = "bash"

    @dataclass
    class CloseBashSessionResponse(_Model):  # type: ignore[no-redef]
        session_type: str = "bash"

    @dataclass
    class Command(_Model):  # type: ignore[no-redef]
        command: Union[str, List[str]]
        timeout: Optional[float] = None
        shell: bool = False
        check: bool = False
        error_msg: str = ""
        env: Optional[Dict[str, str]] = None
        cwd: Optional[str] = None
        merge_output_streams: bool = False

    @dataclass
    class CommandResponse(_Model):  # type: ignore[no-redef]
        stdout: str = ""
        stderr: str = ""
        exit_code: Optional[int] = None

    @dataclass
    class ReadFileRequest(_Model):  # type: ignore[no-redef]
        path: str
        encoding: Optional[str] = None
        errors: Optional[str] = None

    @dataclass
    class ReadFileResponse(_Model):  # type: ignore[no-redef]
        content: str = ""

    @dataclass
    class WriteFileRequest(_Model):  # type: ignore[no-redef]
        content: str
        path: str

    @dataclass
    class WriteFileResponse(_Model):  # type: ignore[no-redef]
        pass

    @dataclass
    class UploadRequest(_Model):  # type: ignore[no-redef]
        source_path: str
        target_path: str

    @dataclass
    class UploadResponse(_Model):  # type: ignore[no-redef]
        pass

    @dataclass
    class CloseResponse(_Model):  # type: ignore[no-redef]
        pass

    class DeploymentHook:  # type: ignore[no-redef]
        def on_custom_step(self, message: str) -> None: ...

    class CombinedDeploymentHook(DeploymentHook):  # type: ignore[no-redef]
        def __init__(self, hooks: Optional[List[Any]] = None) -> None:
            self._hooks = list(hooks or [])

        def add_hook(self, hook: Any) -> None:
            self._hooks.append(hook)

        def on_custom_step(self, message: str) -> None:
            for h in self._hooks:
                h.on_custom_step(message)

    class AbstractRuntime:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.logger: logging.Logger

    class AbstractDeployment:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.logger: logging.Logger


class SandboxTerminated(SwerexException, RuntimeError):
    """The sandbox died, expired or was deleted (a dsec infrastructure
    failure: mask the episode rather than score it)."""

    infra = True


async def _guard(aw: Any) -> Any:
    try:
        return await aw
    except (SandboxGone, NotFound) as e:
        if isinstance(e, NotFound) and "sandbox" not in str(e):
            raise
        raise SandboxTerminated(str(e)) from e


class DsecRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one dsec sandbox: bash sessions, commands,
    files. Usually made by :class:`DsecDeployment`."""

    def __init__(self, sandbox: AsyncSandbox, *, logger: Optional[logging.Logger] = None) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.logger = logger or logging.getLogger("rex-runtime")
        self.sessions: Dict[str, AsyncShellSession] = {}

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        try:
            ok = await asyncio.wait_for(self.sandbox.alive(), timeout)
        except asyncio.TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} did not answer in {timeout}s")
        return IsAliveResponse(is_alive=ok, message="" if ok else f"sandbox {self.sandbox.id} is not running")

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if getattr(request, "session_type", "bash") != "bash":
            raise ValueError(f"unknown session type: {request!r}")
        sh = await _guard(self.sandbox.shell(request.session))
        out = []
        for src in request.startup_source:
            try:
                o, _ = await sh.run(f"source {shlex.quote(src)}", timeout=request.startup_timeout)
                out.append(o)
            except DeadlineExceeded as e:
                await sh.close()
                raise CommandTimeoutError(f"timeout after {request.startup_timeout} seconds sourcing {src}") from e
        self.sessions[request.session] = sh
        return CreateBashSessionResponse(output="".join(out))

    async def run_in_session(self, action: Any) -> BashObservation:
        sh = self.sessions.get(action.session)
        if sh is None:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if getattr(action, "action_type", "bash") == "bash_interrupt":
            await sh.interrupt()
            try:
                out = await _guard(sh.recover(timeout=max(action.timeout * action.n_retry, 1.0)))
            except DeadlineExceeded as e:
                raise CommandTimeoutError("Failed to interrupt session") from e
            return BashObservation(output=out.strip(), exit_code=0)
        for opt in ("is_interactive_command", "is_interactive_quit"):
            if getattr(action, opt, False):
                raise UnsupportedOption(_NAME, f"BashAction.{opt}", "commands must return to the prompt")
        if action.expect:
            raise UnsupportedOption(_NAME, "BashAction.expect", "commands must return to the prompt")
        await self._check_syntax(action.command)
        try:
            out, code = await _guard(sh.run(action.command, timeout=action.timeout))
        except DeadlineExceeded as e:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                      f"{action.command!r}") from e
        if action.check == "ignore":
            return BashObservation(output=out, exit_code=None)
        if action.check == "raise" and code != 0:
            msg = f"Command {action.command!r} failed with exit code {code}. Here is the output:\n{out!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=out, exit_code=code)

    async def _check_syntax(self, command: str) -> None:
        r = await _guard(self.sandbox.exec(["bash", "-n"], stdin=command, timeout_s=30))
        if r.exit_code not in (0, 127):  # 127: an image without bash (the session would fail too)
            raise BashIncorrectSyntaxError(
                f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
                f"---- Stderr ----\n{r.stderr}\n---- Stdout ----\n{r.stdout}",
                extra_info={"bash_stdout": r.stdout, "bash_stderr": r.stderr})

    async def close_session(self, request: CloseBashSessionRequest) -> CloseBashSessionResponse:
        sh = self.sessions.pop(request.session, None)
        if sh is None:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        await sh.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """A command in a subprocess, as subprocess.run would run it:
        ``shell`` runs the string with /bin/sh -c; ``env`` replaces the
        environment (it is not added to it)."""
        argv: List[str]
        if command.shell:
            argv = ["/bin/sh", "-c", command.command if isinstance(command.command, str) else shlex.join(command.command)]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        if command.env is not None:
            argv = ["env", "-i", *[f"{k}={v}" for k, v in command.env.items()], *argv]
        if command.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        r = await _guard(self.sandbox.exec(argv, cwd=command.cwd, timeout_s=command.timeout))
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        resp = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return resp

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await _guard(self.sandbox.read_file(request.path))
        except NotFound as e:
            raise FileNotFoundError(request.path) from e
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await _guard(self.sandbox.write_file(request.path, request.content))
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory to the target path (a directory becomes
        the target, as shutil.copytree makes it)."""
        if os.path.isdir(request.source_path):
            await _guard(upload_dir(self.sandbox, request.source_path, request.target_path))
        else:
            await _guard(self.sandbox.upload(request.source_path, request.target_path))
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Close the sessions (the sandbox is the deployment's to end)."""
        for name in list(self.sessions):
            await self.sessions.pop(name).close()
        return CloseResponse()


class DsecDeployment(AbstractDeployment):
    """SWE-ReX's deployment on a dsec sandbox: ``start()`` creates it,
    ``runtime`` drives it, ``stop()`` deletes it."""

    def __init__(self, *, image: str = "debian", url: Optional[str] = None, api_key: Optional[str] = None,
                 kind: str = "container", cpu: Optional[float] = None, memory_mb: Optional[int] = None,
                 network: str = "none", ttl_s: Optional[int] = None, idle_ttl_s: Optional[int] = None,
                 labels: Optional[Mapping[str, str]] = None, startup_timeout: float = 180.0,
                 logger: Optional[logging.Logger] = None) -> None:
        super().__init__()
        self.logger = logger or logging.getLogger("rex-deploy")
        self._client = async_client(url, api_key)
        self._url, self._api_key = url, api_key
        self._spec: Dict[str, Any] = {"image": image, "kind": kind, "network": network}
        for k, v in (("cpu", cpu), ("memory_mb", memory_mb), ("ttl_s", ttl_s), ("idle_ttl_s", idle_ttl_s),
                     ("labels", dict(labels) if labels else None)):
            if v:
                self._spec[k] = v
        self._startup_timeout = startup_timeout
        self._hooks = CombinedDeploymentHook()
        self._runtime: Optional[DsecRuntime] = None
        self._sandbox: Optional[AsyncSandbox] = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime is not None:
            return
        self._hooks.on_custom_step("Starting dsec sandbox")
        try:
            self._sandbox = await self._client.create(timeout_s=self._startup_timeout, **self._spec)
        except DsecError as e:
            raise DeploymentStartupError(f"dsec could not start the sandbox: {e}") from e
        self._runtime = DsecRuntime(self._sandbox, logger=self.logger)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Close the runtime and delete the sandbox. Idempotent."""
        rt, sb = self._runtime, self._sandbox
        self._runtime = self._sandbox = None
        if rt is not None:
            try:
                await rt.close()
            except DsecError:
                pass
        if sb is not None:
            try:
                await sb.close()
            except (SandboxGone, NotFound):
                pass

    @property
    def runtime(self) -> DsecRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def sandbox(self) -> Optional[AsyncSandbox]:
        return self._sandbox

    def __del__(self) -> None:
        # SWE-ReX's deployments stop when garbage collected. Without awaiting
        # in a finalizer: the sandbox is deleted with a synchronous call.
        sb = getattr(self, "_sandbox", None)
        if sb is not None:
            try:
                sync_client(self._url, self._api_key).delete(sb.id)
            except Exception:
                pass


__all__ = ["DsecDeployment", "DsecRuntime", "SandboxTerminated", "SWEREX", "IsAliveResponse",
           "CreateBashSessionRequest", "CreateBashSessionResponse", "BashAction", "BashInterruptAction",
           "BashObservation", "CloseBashSessionRequest", "CloseBashSessionResponse", "Command", "CommandResponse",
           "ReadFileRequest", "ReadFileResponse", "WriteFileRequest", "WriteFileResponse", "UploadRequest",
           "UploadResponse", "CloseResponse", "SwerexException", "NonZeroExitCodeError", "BashIncorrectSyntaxError",
           "CommandTimeoutError", "SessionExistsError", "SessionDoesNotExistError", "DeploymentNotStartedError",
           "DeploymentStartupError"]
