"""A SWE-ReX-style runtime: bash sessions, one-shot commands, files.

    rt = DsecRuntime(image="debian")
    await rt.create_session(CreateBashSessionRequest(session="main"))
    obs = await rt.run_in_session(BashAction(command="cd /repo && export X=1", session="main"))
    obs = await rt.run_in_session(BashAction(command="echo $X; pwd", session="main"))   # "1\\n/repo\\n"
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ..client import Client, Sandbox
from ..errors import DeadlineExceeded, DsecError


@dataclass
class CreateBashSessionRequest:
    session: str = "default"
    startup_source: list = field(default_factory=list)
    startup_timeout: float = 10.0


@dataclass
class BashAction:
    command: str
    session: str = "default"
    timeout: Optional[float] = None
    is_interactive_command: bool = False
    check: str = "silent"  # "silent" | "raise" | "ignore"
    expect: list = field(default_factory=list)


@dataclass
class BashObservation:
    output: str = ""
    exit_code: Optional[int] = None
    failure_reason: str = ""
    expect_string: str = ""


@dataclass
class Command:
    command: Any
    timeout: Optional[float] = None
    shell: bool = False
    check: bool = False
    env: Optional[Dict[str, str]] = None
    cwd: Optional[str] = None
    merge_output_streams: bool = False


@dataclass
class CommandResponse:
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None


class CommandTimeoutError(RuntimeError):
    pass


class NonZeroExitCodeError(RuntimeError):
    pass


class DsecRuntime:
    def __init__(self, image: str = "debian", client: Optional[Client] = None, sandbox: Optional[Sandbox] = None,
                 **create_kwargs: Any) -> None:
        self.client = client or Client()
        self.sandbox = sandbox or self.client.create(image=image, **create_kwargs)
        self.sessions: Dict[str, Any] = {}

    async def is_alive(self, timeout: Optional[float] = None) -> bool:
        return await asyncio.to_thread(self.sandbox.alive)

    async def create_session(self, request: CreateBashSessionRequest) -> None:
        def make() -> Any:
            sh = self.sandbox.shell(request.session)
            for src in request.startup_source:
                sh.run(f"source {src}", timeout=request.startup_timeout)
            return sh

        self.sessions[request.session] = await asyncio.to_thread(make)

    async def run_in_session(self, action: BashAction) -> BashObservation:
        sh = self.sessions.get(action.session)
        if sh is None:
            raise KeyError(f"no session {action.session!r}: create_session first")
        try:
            out, code = await asyncio.to_thread(sh.run, action.command, timeout=action.timeout)
        except DeadlineExceeded as e:
            raise CommandTimeoutError(str(e)) from e
        if action.check == "raise" and code != 0:
            raise NonZeroExitCodeError(f"{action.command!r} exited {code}: {out[-2000:]}")
        return BashObservation(output=out, exit_code=code)

    async def close_session(self, session: str) -> None:
        sh = self.sessions.pop(session, None)
        if sh is not None:
            await asyncio.to_thread(sh.close)

    async def execute(self, command: Command) -> CommandResponse:
        cmd = command.command
        if command.merge_output_streams:
            cmd = (cmd if isinstance(cmd, str) else " ".join(cmd)) + " 2>&1"
        r = await asyncio.to_thread(self.sandbox.exec, cmd, timeout_s=command.timeout, env=command.env, cwd=command.cwd)
        if r.timed_out:
            raise CommandTimeoutError(f"{cmd!r} timed out")
        if command.check and r.exit_code != 0:
            raise NonZeroExitCodeError(f"{cmd!r} exited {r.exit_code}: {r.stderr[-2000:]}")
        return CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)

    async def read_file(self, path: str) -> str:
        return (await asyncio.to_thread(self.sandbox.read_file, path)).decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: str) -> None:
        await asyncio.to_thread(self.sandbox.write_file, path, content)

    async def close(self) -> None:
        for name in list(self.sessions):
            await self.close_session(name)
        try:
            await asyncio.to_thread(self.sandbox.close)
        except DsecError:
            pass
