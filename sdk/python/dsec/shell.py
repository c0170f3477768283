"""A persistent bash session in a sandbox: cwd, environment variables and
shell state carry over between commands, as in SWE-ReX and SWE-agent.

The session is one long-running ``bash`` started with stdin open; each
command is written to its stdin followed by a marker echo carrying the exit
status, and the output up to the marker is the command's output (stdout
and stderr merged, as a terminal would show them)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

from . import _wire
from .errors import DeadlineExceeded, DsecError, SandboxGone

if TYPE_CHECKING:  # pragma: no cover
    from .client import Sandbox

# The sandbox API, one service per role (api/dsec/v1/sandbox.proto).
_LIFECYCLE = "dsec.v1.LifecycleService"
_PROCESS = "dsec.v1.ProcessService"
_FILES = "dsec.v1.FilesystemService"
_SNAPSHOTS = "dsec.v1.SnapshotService"
_LOGS = "dsec.v1.LogService"
_SCREEN = "dsec.v1.ScreenService"


class ShellSession:
    """Created by :meth:`Sandbox.shell`."""

    def __init__(self, sandbox: "Sandbox", name: str = "default", *, startup: Optional[str] = None,
                 shell: str = "bash") -> None:
        self.sandbox = sandbox
        self.name = name
        # A transport of its own: the output stream holds a connection.
        t = sandbox._client._t
        self._t = _wire.Transport(sandbox._client.url, t.api_key, t.timeout)
        self._cv = threading.Condition()
        self._buf = ""
        self._closed: Optional[BaseException] = None
        self.process_id = ""
        req = {"sandboxId": sandbox.id, "argv": [shell, "--noprofile", "--norc"], "stdinOpen": True,
               "tag": "shell:" + name, "env": {"PS1": "", "PS2": "", "TERM": "dumb"}, "timeoutS": 86400}
        self._stream = self._t.stream(_PROCESS, "ExecStream", req, timeout=None)
        first = next(self._stream)
        self.process_id = first.get("started", {}).get("processId", "")
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"dsec-shell-{name}")
        self._reader.start()
        self._send("exec 2>&1\n")
        if startup:
            self.run(startup, timeout=120)

    def _read(self) -> None:
        try:
            for m in self._stream:
                data = _wire.unb64(m.get("stdout") or m.get("stderr"))
                if data:
                    with self._cv:
                        self._buf += data.decode("utf-8", errors="replace")
                        self._cv.notify_all()
                if "exit" in m:
                    raise SandboxGone("the shell session exited")
        except BaseException as e:  # noqa: BLE001 - handed to waiters
            with self._cv:
                self._closed = e
                self._cv.notify_all()

    def _send(self, text: str) -> None:
        self.sandbox._client._t.unary(_PROCESS, "WriteStdin", {"sandboxId": self.sandbox.id, "processId": self.process_id,
                                                                "data": _wire.b64(text.encode())})

    def run(self, command: str, *, timeout: Optional[float] = 120) -> Tuple[str, int]:
        """Run a command in the session; returns (output, exit_code). On a
        timeout the session is interrupted and DeadlineExceeded is raised."""
        marker = "__DSEC_" + secrets.token_hex(8)
        # The marker is printed on its own line even if the output lacks a
        # final newline.
        self._send(f"{command}\nprintf '\\n{marker}:%s\\n' \"$?\"\n")
        deadline = None if timeout is None else time.monotonic() + timeout
        needle = "\n" + marker + ":"
        with self._cv:
            while True:
                i = self._buf.find(needle)
                if i >= 0:
                    j = self._buf.find("\n", i + len(needle))
                    if j >= 0:
                        code = int(self._buf[i + len(needle):j] or "0")
                        out = self._buf[:i]
                        self._buf = self._buf[j + 1:]
                        return out, code
                if self._closed is not None:
                    if isinstance(self._closed, DsecError):
                        raise self._closed
                    raise SandboxGone(f"shell session broke: {self._closed}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.interrupt()
                    raise DeadlineExceeded(f"command did not finish within {timeout}s: {command[:80]}")
                self._cv.wait(left if left is not None else 1.0)

    def interrupt(self) -> None:
        """Send SIGINT to what the session runs."""
        try:
            self.sandbox._client._t.unary(_PROCESS, "SignalProcess", {"sandboxId": self.sandbox.id,
                                                                      "processId": self.process_id, "signal": "INT"})
        except DsecError:
            pass

    def close(self) -> None:
        try:
            self._send("exit\n")
        except DsecError:
            pass
        self._t.close()

    def __enter__(self) -> "ShellSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__: List[str] = ["ShellSession"]
