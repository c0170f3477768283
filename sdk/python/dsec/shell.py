"""A persistent bash session in a sandbox: cwd, environment variables and
shell state carry over between commands, as in SWE-ReX and SWE-agent.

The session is one long-running ``bash`` started with stdin open; each
command is written to its stdin followed by a marker line carrying the exit
status, and the output up to the marker is the command's output. By
default stderr is merged into it, as a terminal would show it; with
``split_stderr`` the shell also prints the marker on stderr, and each
command's stderr comes back on its own.

The shell traps SIGINT (``trap : INT``): an interrupt, sent to the
session's process group, ends the command running in it and the shell
goes on. A timed-out ``run`` interrupts the command and waits for its
marker, so the next command starts clean; if the command ignores the
interrupt, the session refuses further commands (Conflict).

``ShellSession`` is synchronous (a reader thread per session);
``AsyncShellSession`` reads its stream only while a command runs, inside
the caller's event loop, so it works from any loop, one after another."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from . import _wire
from .errors import Conflict, DeadlineExceeded, DsecError, SandboxGone

if TYPE_CHECKING:  # pragma: no cover
    from .aio import AsyncSandbox
    from .client import Sandbox

_PROCESS = "dsec.v1.ProcessService"
#: how long a timed-out command gets to end after the interrupt
_DRAIN_S = 5.0
#: kills every process whose parent is $1 (the field after the command name in /proc/PID/stat)
_KILL_CHILDREN = ('for s in /proc/[0-9]*/stat; do pp=$(sed "s/.*) //" "$s" 2>/dev/null | cut -d" " -f2); '
                  '[ "$pp" = "$1" ] && p=${s#/proc/} && kill -9 "${p%/stat}" 2>/dev/null; done; true')


def _shell_request(sandbox_id: str, name: str, shell: str) -> Dict[str, Any]:
    return {"sandboxId": sandbox_id, "argv": [shell, "--noprofile", "--norc"], "stdinOpen": True,
            "tag": "shell:" + name, "env": {"PS1": "", "PS2": "", "TERM": "dumb"}, "timeoutS": 86400}


def _setup(split_stderr: bool) -> str:
    return "trap : INT\n" + ("" if split_stderr else "exec 2>&1\n")


def _framed(command: str, marker: str, split_stderr: bool) -> str:
    """The command followed by its marker lines. The marker is printed on a
    line of its own even if the output lacks a final newline."""
    s = f"{command}\nprintf '\\n{marker}:%s\\n' \"$?\"\n"
    if split_stderr:
        s += f"printf '\\n{marker}\\n' >&2\n"
    return s


class _Output:
    """What the shell printed, and the markers that cut it into commands."""

    def __init__(self, split_stderr: bool) -> None:
        self.split = split_stderr
        self.out = bytearray()
        self.err = bytearray()

    def add(self, m: Dict[str, Any]) -> None:
        if m.get("stdout"):
            self.out += _wire.unb64(m["stdout"])
        elif m.get("stderr"):
            self.err += _wire.unb64(m["stderr"])

    def take(self, marker: str) -> Optional[Tuple[str, str, int]]:
        """(stdout, stderr, exit code) of the command whose marker this is,
        once every stream has reached it; consumed from the buffers."""
        needle = b"\n" + marker.encode() + b":"
        i = self.out.find(needle)
        if i < 0:
            return None
        j = self.out.find(b"\n", i + len(needle))
        if j < 0:
            return None
        k = -1
        if self.split:
            eneedle = b"\n" + marker.encode() + b"\n"
            k = self.err.find(eneedle)
            if k < 0:
                return None
        code = int(bytes(self.out[i + len(needle):j]) or b"0")
        out = bytes(self.out[:i]).decode("utf-8", errors="replace")
        del self.out[:j + 1]
        err = ""
        if self.split:
            err = bytes(self.err[:k]).decode("utf-8", errors="replace")
            del self.err[:k + len(marker) + 2]
        return out, err, code


class ShellSession:
    """Created by :meth:`Sandbox.shell`. Commands run one at a time."""

    def __init__(self, sandbox: "Sandbox", name: str = "default", *, startup: Optional[str] = None,
                 shell: str = "bash", split_stderr: bool = False) -> None:
        self.sandbox = sandbox
        self.name = name
        self.split_stderr = split_stderr
        # A transport of its own: the output stream holds a connection.
        t = sandbox._client._t
        self._t = _wire.Transport(sandbox._client.url, t.api_key, t.timeout)
        self._cv = threading.Condition()
        self._buf = _Output(split_stderr)
        self._closed: Optional[BaseException] = None
        self._stuck = ""
        self.process_id = ""
        self._stream = self._t.stream(_PROCESS, "ExecStream", _shell_request(sandbox.id, name, shell), timeout=None)
        first = next(self._stream)
        self.process_id = first.get("started", {}).get("processId", "")
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"dsec-shell-{name}")
        self._reader.start()
        self._send(_setup(split_stderr))
        if startup:
            self.run(startup, timeout=120)

    def _read(self) -> None:
        try:
            for m in self._stream:
                with self._cv:
                    self._buf.add(m)
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
        """Run a command in the session; returns (output, exit_code): stdout
        and stderr merged, or stdout alone with ``split_stderr``. On a
        timeout the command is interrupted and DeadlineExceeded is raised."""
        out, _, code = self.run_split(command, timeout=timeout)
        return out, code

    def run_split(self, command: str, *, timeout: Optional[float] = 120) -> Tuple[str, str, int]:
        """Run a command; returns (stdout, stderr, exit_code). stderr is
        empty unless the session was opened with ``split_stderr``."""
        if self._stuck:
            raise Conflict(f"the shell session is still running {self._stuck[:80]!r}, which ignored the interrupt")
        marker = "__DSEC_" + secrets.token_hex(8)
        self._send(_framed(command, marker, self.split_stderr))
        got = self._wait(marker, None if timeout is None else time.monotonic() + timeout)
        if got is not None:
            return got
        self.interrupt()
        if self._wait(marker, time.monotonic() + _DRAIN_S) is None:
            self._stuck = command
        raise DeadlineExceeded(f"command did not finish within {timeout}s: {command[:80]}")

    def _wait(self, marker: str, deadline: Optional[float]) -> Optional[Tuple[str, str, int]]:
        with self._cv:
            while True:
                got = self._buf.take(marker)
                if got is not None:
                    return got
                if self._closed is not None:
                    if isinstance(self._closed, DsecError):
                        raise self._closed
                    raise SandboxGone(f"shell session broke: {self._closed}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cv.wait(left if left is not None else 1.0)

    def interrupt(self) -> None:
        """Send SIGINT to what the session runs (the shell survives it)."""
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


class AsyncShellSession:
    """Created by ``await AsyncSandbox.shell()``. Commands run one at a
    time (a lock serialises them)."""

    def __init__(self, sandbox: "AsyncSandbox", name: str, split_stderr: bool) -> None:
        self.sandbox = sandbox
        self.name = name
        self.split_stderr = split_stderr
        self.process_id = ""
        self.pid = 0  # the shell's pid in the sandbox
        self._st: Any = None
        self._buf = _Output(split_stderr)
        self._closed: Optional[BaseException] = None
        self._stuck = ""
        self._stuck_marker = ""
        self._busy = False

    @classmethod
    async def open(cls, sandbox: "AsyncSandbox", name: str = "default", *, startup: Optional[str] = None,
                   shell: str = "bash", split_stderr: bool = False) -> "AsyncShellSession":
        s = cls(sandbox, name, split_stderr)
        s._st = await sandbox._t.stream(_PROCESS, "ExecStream", _shell_request(sandbox.id, name, shell), timeout=60)
        first = await asyncio.wait_for(s._st.next(), 60)
        s.process_id = (first or {}).get("started", {}).get("processId", "")
        s.pid = int((first or {}).get("started", {}).get("pid") or 0)
        if not s.process_id:
            s._st.close()
            raise SandboxGone("the shell session did not start")
        await sandbox.write_stdin(s.process_id, _setup(split_stderr))
        if startup:
            await s.run(startup, timeout=120)
        return s

    async def run(self, command: str, *, timeout: Optional[float] = 120) -> Tuple[str, int]:
        """Run a command; returns (output, exit_code): stdout and stderr
        merged, or stdout alone with ``split_stderr``. On a timeout the
        command is interrupted and DeadlineExceeded is raised."""
        out, _, code = await self.run_split(command, timeout=timeout)
        return out, code

    async def run_split(self, command: str, *, timeout: Optional[float] = 120) -> Tuple[str, str, int]:
        """Run a command; returns (stdout, stderr, exit_code)."""
        if self._busy:
            raise Conflict("the shell session runs one command at a time")
        if self._stuck:
            raise Conflict(f"the shell session is still running {self._stuck[:80]!r}, which ignored the interrupt")
        self._busy = True
        try:
            marker = "__DSEC_" + secrets.token_hex(8)
            await self.sandbox.write_stdin(self.process_id, _framed(command, marker, self.split_stderr))
            loop = asyncio.get_running_loop()
            got = await self._wait(marker, None if timeout is None else loop.time() + timeout)
            if got is not None:
                return got
            await self.interrupt()
            if await self._wait(marker, loop.time() + _DRAIN_S) is None:
                self._stuck, self._stuck_marker = command, marker
            raise DeadlineExceeded(f"command did not finish within {timeout}s: {command[:80]}")
        finally:
            self._busy = False

    async def recover(self, timeout: float = _DRAIN_S) -> str:
        """Make a session whose command ignored the interrupt usable again:
        interrupt it once more, then kill the shell's children, and return
        what the command printed meanwhile. Raises DeadlineExceeded if the
        shell still does not come back."""
        if not self._stuck:
            return ""
        loop = asyncio.get_running_loop()
        await self.interrupt()
        got = await self._wait(self._stuck_marker, loop.time() + timeout)
        if got is None and self.pid:
            # The shell traps SIGINT; its children are killed outright.
            await self.sandbox.exec(["sh", "-c", _KILL_CHILDREN, "sh", str(self.pid)], user="root", timeout_s=30)
            got = await self._wait(self._stuck_marker, loop.time() + timeout)
        if got is None:
            raise DeadlineExceeded(f"the shell session did not come back from {self._stuck[:80]!r}")
        self._stuck = self._stuck_marker = ""
        return got[0] + got[1]

    async def _wait(self, marker: str, deadline: Optional[float]) -> Optional[Tuple[str, str, int]]:
        loop = asyncio.get_running_loop()
        while True:
            got = self._buf.take(marker)
            if got is not None:
                return got
            if self._closed is not None:
                if isinstance(self._closed, DsecError):
                    raise self._closed
                raise SandboxGone(f"shell session broke: {self._closed}")
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            try:
                # A next() cut short by the deadline leaves the stream intact.
                m = await asyncio.wait_for(self._st.next(), left)
            except asyncio.TimeoutError:
                return None
            except DsecError as e:
                self._closed = e
                continue
            if m is None:
                self._closed = SandboxGone("the shell session ended")
                continue
            self._buf.add(m)
            if "exit" in m:
                self._closed = SandboxGone("the shell session exited")

    async def interrupt(self) -> None:
        """Send SIGINT to what the session runs (the shell survives it)."""
        try:
            await self.sandbox.signal(self.process_id, "INT")
        except DsecError:
            pass

    async def close(self) -> None:
        """End the shell. Idempotent; never raises for a sandbox that is gone."""
        if self._st is None:
            return
        try:
            await self.sandbox.write_stdin(self.process_id, "exit\n")
        except DsecError:
            pass
        self._st.close()
        self._st = None

    async def __aenter__(self) -> "AsyncShellSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__: List[str] = ["ShellSession", "AsyncShellSession"]
