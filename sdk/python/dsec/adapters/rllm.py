"""rLLM ``Sandbox`` protocol (synchronous).

    sb = DsecRllmSandbox(image="debian")
    out = sb.exec("ls /")          # stdout; raises on a non-zero exit
    sb.upload_dir("./task", "/task")
"""

from __future__ import annotations

from typing import Any, Optional

from ..client import Client, Sandbox
from ..errors import DsecError


class CommandFailed(RuntimeError):
    def __init__(self, command: str, exit_code: int, stdout: str, stderr: str) -> None:
        super().__init__(f"command exited {exit_code}: {command}\n{stderr or stdout}")
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr


class DsecRllmSandbox:
    def __init__(self, image: str = "debian", client: Optional[Client] = None, sandbox: Optional[Sandbox] = None,
                 **create_kwargs: Any) -> None:
        self.client = client or Client()
        self.sandbox = sandbox or self.client.create(image=image, **create_kwargs)

    def exec(self, command: str, timeout: Optional[float] = None, user: Optional[str] = None) -> str:
        r = self.sandbox.exec(command, timeout_s=timeout, user=user)
        if r.exit_code != 0 or r.timed_out:
            raise CommandFailed(command, r.exit_code, r.stdout, r.stderr)
        return r.stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        self.sandbox.upload(local_path, remote_path)

    def upload_dir(self, local_dir: str, remote_dir: str) -> None:
        from .harbor import _upload_dir

        _upload_dir(self.sandbox, local_dir, remote_dir)

    def is_alive(self) -> bool:
        return self.sandbox.alive()

    def close(self) -> None:
        try:
            self.sandbox.close()
        except DsecError:
            pass


def create_sandbox(backend: str = "dsec", task: Any = None, **kw: Any) -> DsecRllmSandbox:
    """rLLM-style constructor; ``task`` may carry an ``image`` attribute or key."""
    image = kw.pop("image", None) or getattr(task, "image", None) or (task.get("image") if isinstance(task, dict) else None) or "debian"
    return DsecRllmSandbox(image=image, **kw)


__all__ = ["DsecRllmSandbox", "CommandFailed", "create_sandbox"]
