"""open-instruct ``SandboxBackend``.

    backend = DsecBackend(image="debian")
    backend.start()
    result = backend.run_command("python -c 'print(1)'")    # ExecutionResult(stdout, stderr, exit_code)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..client import Client, Sandbox
from ..errors import DsecError, NotFound, SandboxGone


class SandboxDiedError(RuntimeError):
    """The sandbox is gone: terminal for the rollout (mask it, open-instruct PR #1887)."""


@dataclass
class ExecutionResult:
    stdout: str
    stderr: str
    exit_code: int


class DsecBackend:
    """Implements open-instruct's SandboxBackend. The shell state between
    calls (cwd, exported variables) persists, which open-instruct's Docker
    backend emulates by re-sourcing a file."""

    def __init__(self, image: str = "debian", client: Optional[Client] = None, timeout: float = 300,
                 persistent_shell: bool = True, **create_kwargs: Any) -> None:
        self.client = client or Client()
        self.image = image
        self.timeout = timeout
        self.persistent_shell = persistent_shell
        self.create_kwargs = create_kwargs
        self.sandbox: Optional[Sandbox] = None
        self._shell: Any = None

    def start(self) -> None:
        if self.sandbox is None:
            self.sandbox = self.client.create(image=self.image, **self.create_kwargs)

    def _sb(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("start() the backend first")
        return self.sandbox

    def run_command(self, command: str) -> ExecutionResult:
        try:
            if self.persistent_shell:
                if self._shell is None:
                    self._shell = self._sb().shell("open-instruct")
                out, code = self._shell.run(command, timeout=self.timeout)
                return ExecutionResult(stdout=out, stderr="", exit_code=code)
            r = self._sb().exec(command, timeout_s=self.timeout)
            return ExecutionResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)
        except (SandboxGone, NotFound) as e:
            raise SandboxDiedError(str(e)) from e

    def write_file(self, path: str, content: Union[str, bytes]) -> None:
        try:
            self._sb().write_file(path, content)
        except (SandboxGone, NotFound) as e:
            raise SandboxDiedError(str(e)) from e

    def read_file(self, path: str, binary: bool = False) -> Union[str, bytes]:
        try:
            data = self._sb().read_file(path)
        except (SandboxGone, NotFound) as e:
            if isinstance(e, NotFound) and "sandbox" not in str(e):
                raise FileNotFoundError(path) from e
            raise SandboxDiedError(str(e)) from e
        return data if binary else data.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._shell is not None:
            self._shell.close()
            self._shell = None
        if self.sandbox is not None:
            try:
                self.sandbox.close()
            except DsecError:
                pass
            self.sandbox = None
