"""dsec as an rLLM sandbox backend (``rllm.sandbox.protocol.Sandbox``).

Written against rLLM 0.3.0.pre (``rllm/sandbox/protocol.py``,
``rllm/sandbox/sandboxed_flow.py``'s ``create_sandbox`` backend table,
``rllm/eval/_resolution.py`` which calls it, and ``backends/docker.py``),
and the protocol before rLLM #633, which also had ``start_agent_process``
and ``get_endpoint``. rLLM selects backends by name in ``create_sandbox``'s
if/elif table; the smallest registration step wraps that function::

    import dsec.adapters.rllm
    dsec.adapters.rllm.register()            # backend "dsec" (keywords: image_map, kind, url, ...)
    # then: Runner(..., sandbox_backend="dsec"), or a task's metadata sandbox_backend = "dsec"

``exec`` returns stdout and raises RuntimeError on a non-zero exit, as the
Docker backend does (rLLM's ``_safe_exec`` catches RuntimeError); ``is_alive``
never raises. ``get_endpoint`` is refused (UnsupportedOption): dsec does not
forward ports into sandboxes. rLLM passes no task resources to backends other
than modal and daytona; give cpu/memory_mb to ``register()``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Mapping, Optional, Tuple

from ..client import Client, Sandbox
from ..errors import NotFound, SandboxGone
from ._common import UnsupportedOption, sync_client

_NAME = "dsec rLLM sandbox"

#: polls /proc/net/tcp{,6} for a socket listening on port $1 (no tools needed)
_LISTENING = ('p=$(printf "%04X" "$1"); for f in /proc/net/tcp /proc/net/tcp6; do '
              '[ -r "$f" ] && grep -q ":$p [0-9A-F:]* 0A " "$f" && exit 0; done; exit 1')


class DsecRllmSandbox:
    """An rLLM sandbox on one dsec sandbox, constructed as rLLM constructs
    backends: ``(name=, image=, **kwargs)``."""

    def __init__(self, name: str, image: str = "debian", *, url: Optional[str] = None, api_key: Optional[str] = None,
                 kind: str = "container", image_map: Optional[Mapping[str, str]] = None, cpu: Optional[float] = None,
                 memory_mb: Optional[int] = None, network: str = "none", ttl_s: Optional[int] = None,
                 idle_ttl_s: Optional[int] = None, client: Optional[Client] = None,
                 sandbox: Optional[Sandbox] = None) -> None:
        self.name = name
        self.client = client or sync_client(url, api_key)
        image = dict(image_map or {}).get(image, image)
        self.image = image
        if sandbox is None:
            kw: Dict[str, Any] = {"image": image, "kind": kind, "network": network, "labels": {"rllm-sandbox": name[:63]}}
            for k, v in (("cpu", cpu), ("memory_mb", memory_mb), ("ttl_s", ttl_s), ("idle_ttl_s", idle_ttl_s)):
                if v:
                    kw[k] = v
            sandbox = self.client.create(**kw)
        self.sandbox = sandbox
        self._shell = "bash" if self.sandbox.exec(["sh", "-c", "command -v bash"]).exit_code == 0 else "sh"

    def exec(self, command: str, timeout: Optional[float] = None, user: Optional[str] = None) -> str:
        """Run a shell command; its stdout, or RuntimeError on a non-zero exit
        or a timeout."""
        r = self.sandbox.exec([self._shell, "-c", command], timeout_s=timeout, user=user)
        if r.exit_code != 0 or r.timed_out:
            tail = r.stderr[-600:]
            why = "timed out" if r.timed_out else f"exit {r.exit_code}"
            raise RuntimeError(f"Command failed ({why}) in sandbox {self.name}: {command}\nstderr (tail):\n{tail}")
        return r.stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        self.sandbox.upload(local_path, remote_path)

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        """The directory's tree becomes remote_path (as the Docker backend's
        tar upload makes it)."""
        dirs = [remote_path]
        for root, ds, fs in os.walk(local_path):
            rel = os.path.relpath(root, local_path)
            dirs += [os.path.normpath(os.path.join(remote_path, rel, d)) for d in ds]
            for f in fs:
                self.sandbox.upload(os.path.join(root, f), os.path.normpath(os.path.join(remote_path, rel, f)))
        for i in range(0, len(dirs), 500):
            self.sandbox.exec(["mkdir", "-p", *dirs[i:i + 500]])

    def is_alive(self) -> bool:
        """Whether the sandbox is usable. Never raises."""
        return self.sandbox.alive()

    def close(self) -> None:
        """Delete the sandbox. A sandbox already gone is not an error."""
        try:
            self.sandbox.close()
        except (SandboxGone, NotFound):
            pass

    # The protocol before rLLM #633.

    def start_agent_process(self, command: str, port: int, timeout: float = 30.0) -> None:
        """Start a long-running process in the background and wait until it
        listens on ``port`` (TimeoutError otherwise, as rLLM's backends)."""
        self.sandbox.exec([self._shell, "-c", f"nohup {command} > /tmp/worker.log 2>&1 &"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sandbox.exec(["sh", "-c", _LISTENING, "sh", str(int(port))]).exit_code == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"Worker server did not start within {timeout}s in sandbox {self.name}")

    def get_endpoint(self, port: int) -> Tuple[str, Dict[str, str]]:
        raise UnsupportedOption(_NAME, f"get_endpoint({port})",
                                "dsec does not forward ports into sandboxes; reach the process with exec")


def create_dsec_sandbox(name: str, image: str = "debian", **kwargs: Any) -> DsecRllmSandbox:
    """Factory in the shape of rLLM's ``create_docker_sandbox``."""
    return DsecRllmSandbox(name=name, image=image, **kwargs)


def register(backend: str = "dsec", **defaults: Any) -> None:
    """Make ``rllm.sandbox.sandboxed_flow.create_sandbox(backend, ...)``
    return a dsec sandbox for ``backend`` (keywords of DsecRllmSandbox as
    defaults); other names go to rLLM's own table. Idempotent. rLLM's callers
    import ``create_sandbox`` from its module at call time, so replacing the
    module attribute is enough."""
    mod = sys.modules.get("rllm.sandbox.sandboxed_flow")
    if mod is None:
        import importlib

        mod = importlib.import_module("rllm.sandbox.sandboxed_flow")
    orig = mod.create_sandbox
    if getattr(orig, "_dsec_backends", None) is not None:
        orig._dsec_backends[backend] = defaults
        return
    backends: Dict[str, Dict[str, Any]] = {backend: defaults}

    def create_sandbox(backend: str, name: str, image: str, **kwargs: Any) -> Any:
        if backend in backends:
            return DsecRllmSandbox(name=name, image=image, **{**backends[backend], **kwargs})
        return orig(backend, name, image, **kwargs)

    create_sandbox._dsec_backends = backends  # type: ignore[attr-defined]
    create_sandbox.__doc__ = orig.__doc__
    mod.create_sandbox = create_sandbox


__all__ = ["DsecRllmSandbox", "create_dsec_sandbox", "register"]
