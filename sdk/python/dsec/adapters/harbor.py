"""dsec as a Harbor environment (``harbor.environments.base.BaseEnvironment``).

Written against Harbor's ``src/harbor/environments/base.py``, ``factory.py``,
``trial/trial.py`` and ``verifier/verifier.py`` (see docs/rl.md for the
revisions read). Harbor builds it the way it builds any environment given by
import path::

    # job or trial config
    environment:
      import_path: "dsec.adapters.harbor:DsecEnvironment"
      kwargs: {kind: container}          # optional: url, api_key, kind, image_map, build_network, ttl_s

and calls it as its trial does: ``preflight()`` (a classmethod),
``start(force_build)``, ``run_healthcheck()`` (raises HealthcheckError),
``exec``/``upload_*``/``download_*``/``is_dir``/``is_file``, ``stop(delete)``.
When Harbor is installed the class subclasses Harbor's BaseEnvironment and
returns Harbor's ExecResult; without it, structurally identical stand-ins
(same names, fields and constructor) keep the module importable.

The task's own environment is used: ``docker_image`` names an image the dsec
server has (or ``image_map`` maps it); otherwise ``environment/Dockerfile`` is
built through dsec and cached by content (see ``_dockerfile``), so a GRPO
group of trials shares one build. What dsec cannot honour is refused at
construction, naming it, never widened: ``environment/docker-compose.yaml``
(multi-container environments are not supported yet), network_mode
``allowlist`` (allowed_hosts), a storage size on kind container (its writable
layer is not limited), GPUs, TPUs, Windows, ``extra_docker_compose``, resource
enforcement ``request``/``guarantee``, and any keyword Harbor's constructor
does not define.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from ..aio import AsyncSandbox
from ..errors import DsecError, NotFound, PermissionDenied, SandboxGone
from ._common import DISK_KINDS, UnsupportedOption, async_client, download_dir, reject_unknown, sync_client
from ._dockerfile import Builder, BuildFailed, Image

_NAME = "dsec Harbor environment"

try:  # Harbor's own types when it is installed
    from harbor.environments.base import BaseEnvironment as _Base
    from harbor.environments.base import ExecResult

    HARBOR = True
except ImportError:  # pragma: no cover - exercised where Harbor is installed
    HARBOR = False
    _Base = object  # type: ignore[assignment,misc]

try:
    from harbor.environments.base import HealthcheckError
except ImportError:

    class HealthcheckError(RuntimeError):  # type: ignore[no-redef]
        """Harbor's: the environment's healthcheck failed."""


try:
    from harbor.models.task.config import NetworkMode, NetworkPolicy
except ImportError:
    import enum

    class NetworkMode(str, enum.Enum):  # type: ignore[no-redef]
        """Harbor's network modes."""

        PUBLIC = "public"
        NO_NETWORK = "no-network"
        ALLOWLIST = "allowlist"

    @dataclass
    class NetworkPolicy:  # type: ignore[no-redef]
        """Harbor's network policy."""

        network_mode: NetworkMode = NetworkMode.PUBLIC
        allowed_hosts: List[str] = field(default_factory=list)

try:
    from harbor.models.task.config import EnvironmentConfig, HealthcheckConfig
except ImportError:

    @dataclass
    class HealthcheckConfig:  # type: ignore[no-redef]
        """Harbor's healthcheck configuration (Docker HEALTHCHECK semantics)."""

        command: str
        interval_sec: float = 5.0
        timeout_sec: float = 30.0
        start_period_sec: float = 0.0
        start_interval_sec: float = 5.0
        retries: int = 3

    class EnvironmentConfig:  # type: ignore[no-redef]
        """Harbor's task ``[environment]`` table: the same field names and
        defaults; ``model_fields_set`` names the fields the task set."""

        _DEFAULTS: Dict[str, Any] = dict(build_timeout_sec=600.0, docker_image=None, cpus=1, memory_mb=2048,
                                         storage_mb=10240, gpus=0, gpu_types=None, allow_internet=True,
                                         network_mode=None, allowed_hosts=[], mcp_servers=[], env={}, skills_dir=None,
                                         healthcheck=None, workdir=None, os="linux", tpu=None)

        def __init__(self, **kw: Any) -> None:
            unknown = set(kw) - set(self._DEFAULTS)
            if unknown:
                raise TypeError(f"EnvironmentConfig: unknown field(s) {', '.join(sorted(unknown))}")
            for k, v in self._DEFAULTS.items():
                setattr(self, k, kw.get(k, v if not isinstance(v, (list, dict)) else type(v)()))
            if isinstance(self.healthcheck, dict):
                self.healthcheck = HealthcheckConfig(**self.healthcheck)
            if self.network_mode is not None:
                self.network_mode = NetworkMode(self.network_mode)
            if self.allowed_hosts and self.network_mode is None:
                self.network_mode = NetworkMode.ALLOWLIST
            self.model_fields_set = set(kw)

        def resolve_baseline(self) -> NetworkPolicy:
            if self.network_mode is not None:
                return NetworkPolicy(network_mode=self.network_mode, allowed_hosts=list(self.allowed_hosts))
            if not self.allow_internet:
                return NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
            return NetworkPolicy(network_mode=NetworkMode.PUBLIC)

try:
    from harbor.environments.capabilities import EnvironmentCapabilities
except ImportError:
    EnvironmentCapabilities = None  # type: ignore[assignment,misc]

try:
    from harbor.environments.base import SandboxBuildFailedError
except ImportError:
    SandboxBuildFailedError = BuildFailed  # type: ignore[assignment,misc]

if not HARBOR:

    @dataclass
    class ExecResult:  # type: ignore[no-redef]
        """Harbor's ExecResult."""

        stdout: Optional[str] = None
        stderr: Optional[str] = None
        return_code: int = 0


class _TypeName(str):
    """The environment type: a str (newer Harbor) with ``.value`` (older
    Harbor formats ``type().value`` into its messages)."""

    @property
    def value(self) -> str:
        return str(self)


@dataclass
class _Capabilities:
    gpus: bool = False
    disable_internet: bool = True
    mounted: bool = False
    network_allowlist: bool = False
    dynamic_network_policy: bool = False
    windows: bool = False
    tpus: bool = False
    docker_compose: bool = False


def _capabilities() -> Any:
    values = dict(_Capabilities().__dict__)
    if EnvironmentCapabilities is None:
        return _Capabilities(**values)
    names = getattr(EnvironmentCapabilities, "model_fields", None) or getattr(EnvironmentCapabilities, "__dataclass_fields__", {})
    return EnvironmentCapabilities(**{k: v for k, v in values.items() if k in names})


#: keywords Harbor's BaseEnvironment constructor defines (any version read);
#: anything else is refused, never forwarded
_HARBOR_KWARGS = ("override_cpus", "override_memory_mb", "override_storage_mb", "override_gpus", "override_tpu",
                  "suppress_override_warnings", "cpu_enforcement_policy", "memory_enforcement_policy",
                  "persistent_env", "mounts", "network_policy", "extra_docker_compose", "has_dynamic_network_policy")
_ENV_PATHS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")


def _mode_value(x: Any) -> str:
    return str(getattr(x, "value", x) or "")


class DsecEnvironment(_Base):  # type: ignore[misc,valid-type]
    """A Harbor environment on one dsec sandbox. Harbor constructs it with
    its own keywords; dsec's (``url``, ``api_key``, ``kind``, ``image_map``,
    ``build_network``, ``ttl_s``, ``idle_ttl_s``, ``labels``) come from the
    environment config's ``kwargs``."""

    def __init__(self, environment_dir: Union[Path, str], environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, logger: Optional[logging.Logger] = None, *, url: Optional[str] = None,
                 api_key: Optional[str] = None, kind: str = "container", image_map: Optional[Mapping[str, str]] = None,
                 build_network: str = "egress", ttl_s: Optional[int] = None, idle_ttl_s: Optional[int] = None,
                 labels: Optional[Mapping[str, str]] = None, **harbor_kwargs: Any) -> None:
        reject_unknown(_NAME, harbor_kwargs, _HARBOR_KWARGS)
        # Set before Harbor's constructor, which validates through them.
        self._kind = kind
        self._client = async_client(url, api_key)
        self._url, self._api_key = url, api_key
        self._image_map = dict(image_map or {})
        self._build_network = build_network
        self._ttl_s, self._idle_ttl_s = ttl_s, idle_ttl_s
        self._labels = dict(labels or {})
        self._sb: Optional[AsyncSandbox] = None
        self._shell = "sh"
        self._refuse(harbor_kwargs, Path(environment_dir), environment_name)
        self._requested_policy = harbor_kwargs.get("network_policy")
        self._mount_targets = [m.get("target") for m in (harbor_kwargs.get("mounts") or []) if m.get("target")]
        base = {k: v for k, v in harbor_kwargs.items() if k not in ("has_dynamic_network_policy",)}
        if HARBOR:
            super().__init__(environment_dir=Path(environment_dir), environment_name=environment_name,
                             session_id=session_id, trial_paths=trial_paths, task_env_config=task_env_config,
                             logger=logger, **base)
        else:
            self._init_like_harbor(Path(environment_dir), environment_name, session_id, trial_paths, task_env_config,
                                   logger, **base)
        self._mode = self._network_mode()
        self._resources = self._resource_spec(harbor_kwargs)

    # -- construction ---------------------------------------------------

    @staticmethod
    def _refuse(kw: Mapping[str, Any], environment_dir: Path, name: str) -> None:
        if kw.get("override_tpu") is not None:
            raise UnsupportedOption(_NAME, "override_tpu", "dsec has no TPUs")
        if kw.get("extra_docker_compose"):
            raise UnsupportedOption(_NAME, "extra_docker_compose", "dsec does not run Docker Compose files yet")
        if kw.get("has_dynamic_network_policy"):
            raise UnsupportedOption(_NAME, "has_dynamic_network_policy", "a sandbox's network is set when it is created")
        for k in ("cpu_enforcement_policy", "memory_enforcement_policy"):
            v = _mode_value(kw.get(k)).lower()
            if v in ("request", "guarantee"):
                raise UnsupportedOption(_NAME, f"{k}={v}", "dsec enforces cpu and memory as limits (use auto, limit or ignore)")
        for f in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"):
            if (environment_dir / f).exists():
                raise UnsupportedOption(_NAME, f"task {name}'s environment/{f} (a multi-container environment)",
                                        "multi-container sandboxes are not implemented yet; "
                                        "a task with a single Dockerfile or docker_image runs")

    def _init_like_harbor(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                          task_env_config: Any, logger: Optional[logging.Logger], override_cpus: Optional[int] = None,
                          override_memory_mb: Optional[int] = None, override_storage_mb: Optional[int] = None,
                          override_gpus: Optional[int] = None, persistent_env: Optional[Dict[str, str]] = None,
                          network_policy: Any = None, **_: Any) -> None:
        """What Harbor's BaseEnvironment constructor does, for when Harbor
        is not installed."""
        self.environment_dir, self.environment_name, self.session_id = environment_dir, environment_name, session_id
        self.trial_paths, self.task_env_config = trial_paths, task_env_config
        self.default_user: Union[str, int, None] = None
        self.logger = (logger or logging.getLogger("harbor")).getChild(__name__)
        for attr, v in (("cpus", override_cpus), ("memory_mb", override_memory_mb), ("storage_mb", override_storage_mb),
                        ("gpus", override_gpus)):
            if v is not None:
                setattr(task_env_config, attr, v)
        self._override_storage_mb = override_storage_mb
        self._persistent_env = dict(persistent_env or {})
        if getattr(task_env_config, "env", None):
            self._persistent_env = {**_resolve_env(task_env_config.env), **self._persistent_env}
        self._network_policy = network_policy or task_env_config.resolve_baseline()
        self._validate_definition()
        if (getattr(task_env_config, "gpus", 0) or 0) > 0:
            raise RuntimeError(f"Task requires {task_env_config.gpus} GPU(s) but {self.type()} environment does "
                               "not support GPU allocation.")

    def _network_mode(self) -> str:
        cfg = self.task_env_config
        policy = self._requested_policy
        if policy is None:
            policy = cfg.resolve_baseline() if hasattr(cfg, "resolve_baseline") else None
        mode = _mode_value(getattr(policy, "network_mode", None)) or ("public" if getattr(cfg, "allow_internet", True) else "no-network")
        if mode == "allowlist":
            hosts = ", ".join(getattr(policy, "allowed_hosts", []) or []) or "none"
            raise UnsupportedOption(_NAME, f"network_mode='allowlist' (allowed_hosts: {hosts})",
                                    "dsec's network is none or egress, and allowing the internet would allow all of it")
        if mode not in ("public", "no-network"):
            raise UnsupportedOption(_NAME, f"network_mode={mode!r}", "dsec's network is none or egress")
        if HARBOR and NetworkPolicy is not None and hasattr(self, "_network_policy"):
            self._network_policy = NetworkPolicy(network_mode=NetworkMode(mode))
        return "egress" if mode == "public" else "none"

    def _resource_spec(self, kw: Mapping[str, Any]) -> Dict[str, Any]:
        cfg = self.task_env_config
        spec: Dict[str, Any] = {}
        if _mode_value(kw.get("cpu_enforcement_policy")).lower() != "ignore" and getattr(cfg, "cpus", None):
            spec["cpu"] = float(cfg.cpus)
        if _mode_value(kw.get("memory_enforcement_policy")).lower() != "ignore" and getattr(cfg, "memory_mb", None):
            spec["memory_mb"] = int(cfg.memory_mb)
        if getattr(cfg, "tpu", None) is not None:
            raise UnsupportedOption(_NAME, "tpu", "dsec has no TPUs")
        if _mode_value(getattr(cfg, "os", "linux")).lower() not in ("", "linux"):
            raise UnsupportedOption(_NAME, f"os={_mode_value(cfg.os)}", "dsec sandboxes run Linux")
        storage = getattr(cfg, "storage_mb", None)
        if storage:
            if self._kind in DISK_KINDS:
                spec["disk_mb"] = int(storage)
            else:
                fields_set = getattr(cfg, "model_fields_set", set()) or set()
                asked = kw.get("override_storage_mb") is not None or "storage_mb" in fields_set or "storage" in fields_set
                if asked:
                    raise UnsupportedOption(_NAME, f"storage_mb={storage} on kind {self._kind}",
                                            f"a {self._kind}'s writable layer is not limited; "
                                            f"use kind microvm or vm for a storage size")
        return spec

    # -- what Harbor reads -----------------------------------------------

    @staticmethod
    def type() -> str:
        return _TypeName("dsec")

    @property
    def capabilities(self) -> Any:
        return _capabilities()

    @property
    def supports_dynamic_network_policy(self) -> bool:
        return False

    @classmethod
    def preflight(cls) -> None:
        """Harbor calls this once before queueing trials: the server named by
        $DSEC_URL must answer and run containers."""
        try:
            info = sync_client().info()
        except DsecError as e:
            raise SystemExit(f"dsec at {os.environ.get('DSEC_URL') or 'http://127.0.0.1:7070'} is not reachable: {e} "
                             "(set DSEC_URL and DSEC_API_KEY)")
        kinds = {k.get("kind"): k for n in info.get("nodes", []) for k in n.get("kinds", [])}
        if not any(k.get("available") for k in kinds.values()):
            raise SystemExit("dsec has no available sandbox kind")

    def _validate_definition(self) -> None:
        d = Path(self.environment_dir)
        self._refuse({}, d, self.environment_name)
        if not getattr(self.task_env_config, "docker_image", None) and not (d / "Dockerfile").exists():
            raise FileNotFoundError(f"{d / 'Dockerfile'} not found and the task names no docker_image")

    def _merge_env(self, env: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
        if HARBOR:
            return super()._merge_env(env)
        merged = {**self._persistent_env, **(env or {})}
        return merged or None

    def _resolve_user(self, user: Union[str, int, None]) -> Union[str, int, None]:
        return user if user is not None else self.default_user

    # -- lifecycle -------------------------------------------------------

    async def _image(self, force_build: bool) -> Image:
        cfg = self.task_env_config
        d = Path(self.environment_dir)
        if getattr(cfg, "docker_image", None) and not (force_build and (d / "Dockerfile").exists()):
            name = self._image_map.get(cfg.docker_image, cfg.docker_image)
            if name not in {i.get("name") for i in await self._client.images()}:
                raise UnsupportedOption(_NAME, f"docker_image {cfg.docker_image}",
                                        f"the dsec server has no image {name!r}; import it under that name or map it with image_map")
            return Image(image=name)
        b = Builder(self._client, kind=self._kind, image_map=self._image_map, network=self._build_network,
                    cpu=self._resources.get("cpu"), memory_mb=self._resources.get("memory_mb"),
                    timeout_s=float(getattr(cfg, "build_timeout_sec", 600) or 600), prefix="harbor-build-")
        try:
            return await b.image_for(str(d), force=force_build)
        except BuildFailed as e:
            raise SandboxBuildFailedError(str(e)) from e

    async def start(self, force_build: bool) -> None:
        """Start the sandbox from the task's image (built if needed)."""
        if self._sb is not None:
            return
        img = await self._image(force_build)
        kw = {**img.spec(), **self._resources, "kind": self._kind, "network": self._mode}
        workdir = getattr(self.task_env_config, "workdir", None)
        if workdir:
            kw["workdir"] = workdir
        labels = {"harbor-env": _label(self.environment_name), "harbor-session": _label(self.session_id), **self._labels}
        kw["labels"] = labels
        if self._ttl_s:
            kw["ttl_s"] = self._ttl_s
        if self._idle_ttl_s:
            kw["idle_ttl_s"] = self._idle_ttl_s
        sb = await self._client.create(**kw)
        self._sb = sb
        try:
            self._shell = "bash" if (await sb.exec(["sh", "-c", "command -v bash"])).exit_code == 0 else "sh"
            dirs = list(_ENV_PATHS) + [t for t in self._mount_targets if t not in _ENV_PATHS]
            r = await sb.exec(["sh", "-c", 'mkdir -p "$@" && chmod 777 "$@"', "sh", *dirs], user="root")
            if r.exit_code != 0:
                raise RuntimeError(f"cannot make Harbor's directories: {r.stderr}")
            hook = getattr(self, "_upload_environment_dir_after_start", None)
            if HARBOR and hook is not None:
                await hook()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        """Delete the sandbox (``delete``) or pause it. A sandbox already gone
        is not an error."""
        sb = self._sb
        if sb is None:
            return
        try:
            if delete:
                await sb.close()
            else:
                await sb.pause()
        except (SandboxGone, NotFound):
            pass
        if delete:
            self._sb = None

    def _require(self) -> AsyncSandbox:
        if self._sb is None:
            raise RuntimeError("start() the environment first")
        return self._sb

    # -- commands and files ----------------------------------------------

    async def exec(self, command: str, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                   timeout_sec: Optional[int] = None, user: Union[str, int, None] = None) -> ExecResult:
        """Run a shell command (bash when the image has it). A timeout raises
        RuntimeError, as Harbor's Docker environment does."""
        u = self._resolve_user(user)
        r = await self._require().exec([self._shell, "-c", command], cwd=cwd, env=self._merge_env(env),
                                       timeout_s=timeout_sec, user=None if u is None else str(u))
        if r.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    async def upload_file(self, source_path: Union[Path, str], target_path: str) -> None:
        await self._require().upload(str(source_path), str(target_path))

    async def upload_dir(self, source_dir: Union[Path, str], target_dir: str) -> None:
        from ._common import upload_dir

        await upload_dir(self._require(), str(source_dir), str(target_dir))

    async def download_file(self, source_path: str, target_path: Union[Path, str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(str(target_path))), exist_ok=True)
        await self._require().download(str(source_path), str(target_path))

    async def download_dir(self, source_dir: str, target_dir: Union[Path, str]) -> None:
        await download_dir(self._require(), str(source_dir), str(target_dir))

    async def is_dir(self, path: str, user: Union[str, int, None] = None) -> bool:
        return await self._is(path, "dir", user)

    async def is_file(self, path: str, user: Union[str, int, None] = None) -> bool:
        return await self._is(path, "file", user)

    async def _is(self, path: str, kind: str, user: Union[str, int, None]) -> bool:
        u = self._resolve_user(user)
        try:
            return (await self._require().stat(path, user=None if u is None else str(u))).type == kind
        except (NotFound, PermissionDenied):
            return False

    # -- network ---------------------------------------------------------

    async def apply_network_policy(self, policy: Any) -> None:
        """The network is fixed when the sandbox is created: a policy equal to
        it is accepted, any other refused (Harbor's older trial API)."""
        mode = _mode_value(getattr(policy, "network_mode", policy))
        if ("egress" if mode == "public" else "none" if mode == "no-network" else "") != self._mode:
            raise ValueError(f"network_mode={mode!r} after start is not supported by dsec: "
                             f"the sandbox was created with network {self._mode!r}")

    async def _apply_network_policy(self, policy: Any) -> None:  # newer Harbor's hook
        await self.apply_network_policy(policy)

    async def run_healthcheck(self) -> None:
        """Harbor's: run the task's healthcheck until it passes; raise
        HealthcheckError after ``retries`` consecutive failures past the
        start period."""
        if HARBOR:
            return await super().run_healthcheck()
        hc = getattr(self.task_env_config, "healthcheck", None)
        if hc is None:
            return
        start_period_end = time.monotonic() + hc.start_period_sec
        failures = 0
        while True:
            in_start = time.monotonic() < start_period_end
            r = await self.exec(hc.command, timeout_sec=int(hc.timeout_sec))
            if r.return_code == 0:
                return
            if in_start:
                await asyncio.sleep(hc.start_interval_sec)
                continue
            failures += 1
            if failures >= hc.retries:
                raise HealthcheckError(f"Healthcheck failed after {hc.retries} consecutive retries: {hc.command}")
            await asyncio.sleep(hc.interval_sec)

    @property
    def sandbox(self) -> Optional[AsyncSandbox]:
        """The dsec sandbox, once started."""
        return self._sb


def _label(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", s)[:63] or "x"


def _resolve_env(env: Mapping[str, str]) -> Dict[str, str]:
    """Harbor's ${VAR} and ${VAR:-default} templates, from the host."""
    def sub(m: "re.Match[str]") -> str:
        v = os.environ.get(m.group(1))
        return v if v else (m.group(2) or "")

    return {k: re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, str(v)) for k, v in env.items()}


# Harbor before its `capabilities` property declared these abstract; newer
# Harbor warns when a subclass declares them, so they are added only where
# the installed Harbor asks for them.
if HARBOR and "is_mounted" in getattr(_Base, "__abstractmethods__", ()):  # pragma: no cover - older Harbor only
    DsecEnvironment.is_mounted = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.supports_gpus = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.can_disable_internet = property(lambda self: True)  # type: ignore[attr-defined]
    abc.update_abstractmethods(DsecEnvironment)  # type: ignore[attr-defined]
elif not HARBOR:
    DsecEnvironment.is_mounted = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.supports_gpus = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.can_disable_internet = property(lambda self: True)  # type: ignore[attr-defined]


__all__ = ["DsecEnvironment", "ExecResult", "EnvironmentConfig", "HealthcheckConfig", "HealthcheckError",
           "NetworkMode", "NetworkPolicy", "UnsupportedOption", "SandboxBuildFailedError", "HARBOR"]
