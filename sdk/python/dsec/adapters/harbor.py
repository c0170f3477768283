"""Harbor ``BaseEnvironment`` (async). One adapter that also unlocks
SkyRL-Harbor, TRL's HarborEnv, tinker's harbor_rl and rLLM Harbor tasks.

    env = DsecEnvironment(image="debian", cpus=2, memory_mb=2048)
    await env.start(force_build=False)
    res = await env.exec("bash /tests/test.sh", timeout_sec=60)   # ExecResult(stdout, stderr, return_code)
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..client import Client, Sandbox
from ..errors import DsecError, NotFound
from ..network import NetworkPolicy as DsecPolicy


@dataclass
class ExecResult:
    stdout: Optional[str]
    stderr: Optional[str]
    return_code: int


@dataclass
class NetworkPolicy:
    """Harbor's network policy. ``allowed_hosts`` (names, "*.name",
    addresses or CIDRs) make an allow-list: egress to those and nothing
    else, enforced by the node (DNS, HTTP Host, TLS SNI, addresses);
    otherwise ``allow_internet`` True is the whole internet and False no
    network."""

    allow_internet: bool = True
    allowed_hosts: List[str] = field(default_factory=list)


def _dsec_network(p: NetworkPolicy) -> Dict[str, Any]:
    """The create keywords for Harbor's policy."""
    if p.allowed_hosts:
        return {"network": "egress", "network_policy": DsecPolicy(allow=list(p.allowed_hosts))}
    return {"network": "egress" if p.allow_internet else "none"}


def _dsec_policy(p: NetworkPolicy) -> Optional[DsecPolicy]:
    """Harbor's policy for an egress sandbox at runtime (None: unrestricted)."""
    if p.allowed_hosts:
        return DsecPolicy(allow=list(p.allowed_hosts))
    return None if p.allow_internet else DsecPolicy()


def _upload_dir(sb: Sandbox, local_dir: str, remote_dir: str) -> None:
    """Upload a directory tree file by file (keeps modes)."""
    for root, _dirs, files in os.walk(local_dir):
        rel = os.path.relpath(root, local_dir)
        for f in files:
            src = os.path.join(root, f)
            dst = os.path.normpath(os.path.join(remote_dir, rel, f))
            sb.upload(src, dst)


def _download_dir(sb: Sandbox, remote_dir: str, local_dir: str) -> None:
    listing = sb.exec(["sh", "-c", 'cd "$1" && tar -cf - .', "sh", remote_dir], max_output_bytes=64 << 20)
    if listing.exit_code != 0:
        raise FileNotFoundError(remote_dir)
    with tarfile.open(fileobj=io.BytesIO(listing.stdout_bytes)) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(local_dir, filter="data")
            return
        # Older Pythons: keep regular files and directories inside local_dir.
        root = os.path.realpath(local_dir)
        safe = []
        for m in t.getmembers():
            dest = os.path.realpath(os.path.join(root, m.name))
            if (m.isfile() or m.isdir()) and (dest == root or dest.startswith(root + os.sep)):
                safe.append(m)
        t.extractall(local_dir, members=safe)


class DsecEnvironment:
    """Implements Harbor's BaseEnvironment over one dsec sandbox."""

    def __init__(self, image: str = "debian", client: Optional[Client] = None, *, cpus: Optional[float] = None,
                 memory_mb: Optional[int] = None, storage_mb: Optional[int] = None, gpus: int = 0,
                 network: Optional[NetworkPolicy] = None, kind: str = "container", **create_kwargs: Any) -> None:
        self.client = client or Client()
        self.image, self.kind = image, kind
        self.cpus, self.memory_mb, self.storage_mb, self.gpus = cpus, memory_mb, storage_mb, gpus
        self.network = network or NetworkPolicy(allow_internet=False)
        self.create_kwargs = create_kwargs
        self.sandbox: Optional[Sandbox] = None
        self._egress = False  # whether the sandbox started with network

    # capability properties Harbor reads
    is_mounted = False
    supports_gpus = False
    can_disable_internet = True
    # A sandbox started with network (allow_internet or allowed_hosts) takes
    # any policy at runtime; one started without network stays without.
    supports_dynamic_network_policy = True

    async def preflight(self) -> None:
        info = await asyncio.to_thread(self.client.info)
        kinds = {k["kind"]: k for n in info.get("nodes", []) for k in n.get("kinds", [])}
        if not kinds.get(self.kind, {}).get("available"):
            raise RuntimeError(f"dsec cannot run kind {self.kind!r}: {kinds.get(self.kind, {}).get('reason', 'unknown')}")
        if self.gpus:
            raise RuntimeError("this dsec deployment runs no GPU sandboxes")

    async def start(self, force_build: bool = False) -> None:
        if self.sandbox is not None:
            return
        net = _dsec_network(self.network)
        self.sandbox = await asyncio.to_thread(
            self.client.create, image=self.image, kind=self.kind, cpu=self.cpus, memory_mb=self.memory_mb,
            **net, **self.create_kwargs)
        self._egress = net["network"] == "egress"

    async def stop(self, delete: bool = True) -> None:
        if self.sandbox is None:
            return
        try:
            if delete:
                await asyncio.to_thread(self.sandbox.close)
            else:
                await asyncio.to_thread(self.sandbox.pause)
        except DsecError:
            pass
        if delete:
            self.sandbox = None

    def _sb(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("start() the environment first")
        return self.sandbox

    async def exec(self, command: str, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                   timeout_sec: Optional[float] = None, user: Optional[str] = None) -> ExecResult:
        r = await asyncio.to_thread(self._sb().exec, command, cwd=cwd, env=env, timeout_s=timeout_sec, user=user)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    async def upload_file(self, source_path: str, target_path: str) -> None:
        await asyncio.to_thread(self._sb().upload, str(source_path), str(target_path))

    async def upload_dir(self, source_dir: str, target_dir: str) -> None:
        await asyncio.to_thread(_upload_dir, self._sb(), str(source_dir), str(target_dir))

    async def download_file(self, source_path: str, target_path: str) -> None:
        await asyncio.to_thread(self._sb().download, str(source_path), str(target_path))

    async def download_dir(self, source_dir: str, target_dir: str) -> None:
        await asyncio.to_thread(_download_dir, self._sb(), str(source_dir), str(target_dir))

    async def is_dir(self, path: str) -> bool:
        try:
            return (await asyncio.to_thread(self._sb().stat, path)).type == "dir"
        except NotFound:
            return False

    async def is_file(self, path: str) -> bool:
        try:
            return (await asyncio.to_thread(self._sb().stat, path)).type == "file"
        except NotFound:
            return False

    async def run_healthcheck(self) -> bool:
        return await asyncio.to_thread(self._sb().alive)

    async def apply_network_policy(self, policy: NetworkPolicy) -> None:
        """Before start(): the policy to start with. After: the policy of
        the sandbox's new connections (open ones it denies are cut). A
        sandbox started without network cannot get one."""
        if self.sandbox is None:
            self.network = policy
            return
        if not self._egress:
            if _dsec_network(policy)["network"] == "none":
                self.network = policy
                return
            raise NotImplementedError("this sandbox started without network; dsec cannot add one at runtime "
                                      "(start with allow_internet=True and narrow it instead)")
        await asyncio.to_thread(self.sandbox.set_network_policy, _dsec_policy(policy))
        self.network = policy
