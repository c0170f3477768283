"""dsec as an open-instruct sandbox backend
(``open_instruct.environments.backends.SandboxBackend``).

Written against open-instruct's ``open_instruct/environments/backends.py``
(``SandboxBackend``, ``ExecutionResult``, ``DockerBackend``,
``create_backend``) and ``generic_sandbox.py``, which builds its backend with
``create_backend(backend_type, timeout=..., **backend_kwargs)``. The backend
name table is ``create_backend``'s if/else; the smallest registration step
wraps it where open-instruct's modules hold it::

    import dsec.adapters.open_instruct
    dsec.adapters.open_instruct.register()   # backend "dsec"
    # then the environment config: backend: dsec, image: debian
    # (or keep open-instruct's image and register(image_map={"python:3.12-slim": "debian"}))

``run_command`` behaves as DockerBackend's: each command a fresh ``bash -c``
with stdout and stderr apart, at most 1 MB each, a timeout is exit code 124
with "Command timed out after Ns." before stderr. ``persistent_shell=True``
keeps cwd and exported variables between commands in one bash session (its
stderr still apart). ``read_file`` of a missing file raises
FileNotFoundError, of a directory IsADirectoryError. With open-instruct
installed ``ExecutionResult`` is its own; without it, a stand-in with the
same fields. Refused, naming it: ``mem_limit`` a size dsec cannot parse, and
any keyword DockerBackend does not take besides dsec's own.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from ..client import Client, Sandbox
from ..errors import DeadlineExceeded, NotFound, SandboxGone
from ._common import UnsupportedOption, sync_client

_NAME = "dsec open-instruct backend"
_MAX_OUTPUT_BYTES = 1_000_000

try:
    from open_instruct.environments.backends import ExecutionResult, SandboxBackend

    OPEN_INSTRUCT = True
except ImportError:
    OPEN_INSTRUCT = False
    SandboxBackend = object  # type: ignore[assignment,misc]

    @dataclass
    class ExecutionResult:  # type: ignore[no-redef]
        """open-instruct's result of code or command execution."""

        stdout: str
        stderr: str
        exit_code: int


def _mem_mb(limit: Optional[str]) -> Optional[int]:
    """Docker's mem_limit ("4g", "512m", bytes) in MiB."""
    if limit is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*", str(limit).lower())
    if not m:
        raise UnsupportedOption(_NAME, f"mem_limit={limit!r}", "give a size such as 4g or 512m")
    n, unit = float(m.group(1)), m.group(2)
    return max(16, int(n * {"": 1 / (1 << 20), "b": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024}[unit]))


class DsecBackend(SandboxBackend):  # type: ignore[misc,valid-type]
    """open-instruct's SandboxBackend on one dsec sandbox, constructed as
    DockerBackend is: ``(image=, timeout=, mem_limit=)``, plus dsec's keywords."""

    def __init__(self, image: str = "debian", timeout: int = 1800, mem_limit: Optional[str] = "4g", *,
                 url: Optional[str] = None, api_key: Optional[str] = None, kind: str = "container",
                 cpu: Optional[float] = None, network: str = "none", ttl_s: Optional[int] = None,
                 image_map: Optional[Dict[str, str]] = None, persistent_shell: bool = False,
                 client: Optional[Client] = None) -> None:
        self.client = client or sync_client(url, api_key)
        self.image, self.timeout = image, timeout
        self._spec: Dict[str, Any] = {"image": dict(image_map or {}).get(image, image), "kind": kind, "network": network}
        mem = _mem_mb(mem_limit)
        for k, v in (("memory_mb", mem), ("cpu", cpu), ("ttl_s", ttl_s)):
            if v:
                self._spec[k] = v
        self.persistent_shell = persistent_shell
        self.sandbox: Optional[Sandbox] = None
        self._shell: Any = None

    def start(self) -> None:
        if self.sandbox is None:
            self.sandbox = self.client.create(**self._spec)

    def _sb(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("Container not started. Call start() first.")
        return self.sandbox

    def run_command(self, command: str) -> ExecutionResult:
        sb = self._sb()
        if self.persistent_shell:
            if self._shell is None:
                self._shell = sb.shell("open-instruct", split_stderr=True)
            try:
                out, err, code = self._shell.run_split(command, timeout=self.timeout)
            except DeadlineExceeded:
                return ExecutionResult(stdout="", stderr=f"Command timed out after {self.timeout}s.\n", exit_code=124)
            return ExecutionResult(stdout=out[:_MAX_OUTPUT_BYTES], stderr=err[:_MAX_OUTPUT_BYTES], exit_code=code)
        r = sb.exec(["bash", "-c", command], timeout_s=self.timeout, max_output_bytes=_MAX_OUTPUT_BYTES)
        stderr, code = r.stderr, r.exit_code
        if r.timed_out:
            stderr, code = f"Command timed out after {self.timeout}s.\n" + stderr, 124
        return ExecutionResult(stdout=r.stdout, stderr=stderr, exit_code=code)

    def write_file(self, path: str, content: Union[str, bytes]) -> None:
        self._sb().write_file(path, content)

    def read_file(self, path: str, binary: bool = False) -> Union[str, bytes]:
        sb = self._sb()
        try:
            info = sb.stat(path)
        except NotFound as e:
            if "sandbox" in str(e):
                raise
            raise FileNotFoundError(f"File not found in container: '{path}'") from e
        if info.type == "dir":
            raise IsADirectoryError(f"Path '{path}' is a directory, not a file.")
        data = sb.read_file(path)
        return data if binary else data.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._shell is not None:
            self._shell.close()
            self._shell = None
        if self.sandbox is not None:
            try:
                self.sandbox.close()
            except (SandboxGone, NotFound):
                pass
            self.sandbox = None


def register(backend: str = "dsec", **defaults: Any) -> None:
    """Make open-instruct's ``create_backend(backend, **kwargs)`` return a
    DsecBackend (``defaults`` are its keywords); other names go to
    open-instruct's own table. Replaces the function in every open-instruct
    module that imported it (``generic_sandbox`` imports it by name).
    Idempotent."""
    import importlib

    mod = importlib.import_module("open_instruct.environments.backends")
    orig = mod.create_backend
    if getattr(orig, "_dsec_backends", None) is not None:
        orig._dsec_backends[backend] = defaults
        return
    backends: Dict[str, Dict[str, Any]] = {backend: defaults}

    def create_backend(backend_type: str, **kwargs: Any) -> Any:
        if backend_type in backends:
            return DsecBackend(**{**backends[backend_type], **kwargs})
        return orig(backend_type, **kwargs)

    create_backend._dsec_backends = backends  # type: ignore[attr-defined]
    create_backend.__doc__ = orig.__doc__
    for name, m in list(sys.modules.items()):
        if (name == "open_instruct" or name.startswith("open_instruct.")) and getattr(m, "create_backend", None) is orig:
            m.create_backend = create_backend


__all__ = ["DsecBackend", "ExecutionResult", "register", "OPEN_INSTRUCT"]
