"""dsec as a Harbor environment (``harbor.environments.base.BaseEnvironment``).

Written against Harbor 0.13.1 (``src/harbor/environments/base.py``,
``capabilities.py``, ``factory.py``, ``definition.py``,
``trial/trial.py``, ``verifier/verifier.py``, ``models/task/config.py``,
``models/trial/config.py``; see docs/rl.md for the commit) and, for the
older abstract properties, Harbor 0.1's ``base.py``. Harbor builds it the way
it builds any environment given by import path::

    # job or trial config
    environment:
      import_path: "dsec.adapters.harbor:DsecEnvironment"
      kwargs: {kind: container}   # optional: url, api_key, kind, image_map, build_network, ttl_s, idle_ttl_s, labels

and calls it as its trial does: the classmethods ``preflight()`` and
``resource_capabilities()``, then ``start(force_build)``,
``run_healthcheck()`` (raises HealthcheckError), ``with_default_user``,
``exec``, ``upload_*``/``download_*``, ``is_dir``/``is_file``,
``ensure_dirs``/``empty_dirs``, ``set_network_policy``, ``stop(delete)``.
When Harbor is installed the class subclasses Harbor's BaseEnvironment and
returns Harbor's ExecResult; without it, the class subclasses a stand-in
with the same constructor, attributes and trial-facing methods, so the
module imports and works on its own.

The task's own environment is used: ``docker_image`` names an image the dsec
server has (or ``image_map`` maps it); otherwise ``environment/Dockerfile`` is
built through dsec and cached by content (see ``_dockerfile``), so a GRPO
group of trials shares one build.

Harbor's network policies become dsec egress policies (kinds container, microvm, vm):
``public`` is unrestricted egress, ``allowlist`` a policy allowing exactly
``allowed_hosts`` (names, ``*.name`` wildcards, addresses) and denying the
rest, ``no-network`` a policy denying everything; the trial's phase changes
(agent, verifier) go through ``set_network_policy`` while the sandbox runs.
``storage_mb`` is the sandbox's disk size (``disk_mb``).

A task whose environment has a ``docker-compose.yaml`` runs as one sandbox
of several containers on kind container: the compose file's ``main``
service is the main container (its image built from the Dockerfile or
named by ``docker_image``, as for any task, unless the file names one),
the other services its sidecars, sharing its network namespace (they reach
each other on localhost and by service name; the task's network policy is
the group's). Variables in the file are substituted as Harbor does: the
process environment, under the task's and persistent environment, under
Harbor's infrastructure variables (``CONTEXT_DIR``, ``MAIN_IMAGE_NAME``,
``PREBUILT_IMAGE_NAME``, ``CPUS``, ``MEMORY``). Compose keys dsec cannot
honour (``build`` of a sidecar, volumes, privileged, ...) are refused by the
server, naming them.

What dsec cannot honour is refused at construction, naming it, never
widened: a compose file or ``extra_docker_compose`` (a job's overlays,
laid over the task's file as Harbor does) on kinds other than container,
an allowlist or a change
of network policy on kind function (no network there), a storage
size on a kind without a disk of its own, GPUs, TPUs, Windows, resource
enforcement ``request``/``guarantee``, mounts other than Harbor's own log
directories (a host directory cannot be bind-mounted into a remote
sandbox), and any keyword Harbor's constructor does not define.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import fnmatch
import logging
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ..aio import AsyncSandbox
from ..errors import DsecError, NotFound, PermissionDenied, SandboxGone
from ..network import NetworkPolicy as DsecPolicy
from ._common import (DISK_KINDS, POLICY_KINDS, UnsupportedOption, async_client, download_dir, reject_unknown,
                      sync_client, upload_dir)
from ._dockerfile import Builder, BuildFailed, Image

_NAME = "dsec Harbor environment"

try:  # Harbor's own types when it is installed
    from harbor.environments.base import BaseEnvironment as _HarborBase
    from harbor.environments.base import ExecResult, HealthcheckError

    HARBOR = True
except ImportError:
    HARBOR = False

try:
    from harbor.environments.base import SandboxBuildFailedError
except ImportError:

    class SandboxBuildFailedError(Exception):  # type: ignore[no-redef]
        """Harbor's: the task's environment definition does not build (not retried)."""


try:
    from harbor.models.task.config import NetworkMode, NetworkPolicy
except ImportError:

    class NetworkMode(str, enum.Enum):  # type: ignore[no-redef]
        """Harbor's network modes."""

        NO_NETWORK = "no-network"
        PUBLIC = "public"
        ALLOWLIST = "allowlist"

    @dataclass(frozen=True)
    class NetworkPolicy:  # type: ignore[no-redef]
        """Harbor's resolved network policy for one role (agent or verifier)."""

        network_mode: NetworkMode = NetworkMode.PUBLIC
        allowed_hosts: List[str] = field(default_factory=list)

        def __post_init__(self) -> None:
            object.__setattr__(self, "network_mode", NetworkMode(self.network_mode))
            object.__setattr__(self, "allowed_hosts", list(self.allowed_hosts))
            if (self.network_mode == NetworkMode.ALLOWLIST) != bool(self.allowed_hosts):
                raise ValueError("allowed_hosts is given exactly when network_mode='allowlist'")

        def __hash__(self) -> int:
            return hash((self.network_mode, tuple(self.allowed_hosts)))

try:
    from harbor.models.task.config import TaskOS
except ImportError:

    class TaskOS(str, enum.Enum):  # type: ignore[no-redef]
        LINUX = "linux"
        WINDOWS = "windows"

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
        """Harbor's task ``[environment]`` table (0.13): the same field names
        and defaults; ``model_fields_set`` names the fields the task set."""

        _DEFAULTS: Dict[str, Any] = dict(build_timeout_sec=600.0, docker_image=None, os="linux", cpus=None,
                                         memory_mb=None, storage_mb=None, gpus=None, gpu_types=None, tpu=None,
                                         mcp_servers=[], env={}, skills_dir=None, healthcheck=None, workdir=None,
                                         allow_internet=None, network_mode="public", allowed_hosts=None)

        def __init__(self, **kw: Any) -> None:
            unknown = set(kw) - set(self._DEFAULTS)
            if unknown:
                raise TypeError(f"EnvironmentConfig: unknown field(s) {', '.join(sorted(unknown))}")
            for k, v in self._DEFAULTS.items():
                setattr(self, k, kw[k] if k in kw else (type(v)() if isinstance(v, (list, dict)) else v))
            if isinstance(self.healthcheck, dict):
                self.healthcheck = HealthcheckConfig(**self.healthcheck)
            self.os = TaskOS(str(self.os).lower())
            self.network_mode = NetworkMode(self.network_mode)
            if "network_mode" not in kw and self.allow_internet is False:
                self.network_mode = NetworkMode.NO_NETWORK
            self.model_fields_set = set(kw)

        def resolve_baseline(self) -> NetworkPolicy:
            return NetworkPolicy(network_mode=self.network_mode, allowed_hosts=list(self.allowed_hosts or []))

try:
    from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
except ImportError:

    @dataclass(frozen=True)
    class EnvironmentCapabilities:  # type: ignore[no-redef]
        """Harbor's capability flags."""

        gpus: bool = False
        tpus: bool = False
        disable_internet: bool = False
        network_allowlist: bool = False
        dynamic_network_policy: bool = False
        windows: bool = False
        mounted: bool = False
        docker_compose: bool = False

    @dataclass(frozen=True)
    class EnvironmentResourceCapabilities:  # type: ignore[no-redef]
        """Harbor's resource policy capabilities."""

        cpu_limit: bool = False
        cpu_request: bool = False
        memory_limit: bool = False
        memory_request: bool = False

if not HARBOR:

    class HealthcheckError(RuntimeError):  # type: ignore[no-redef]
        """Harbor's: the environment's healthcheck failed."""

    @dataclass
    class ExecResult:  # type: ignore[no-redef]
        """Harbor's ExecResult."""

        stdout: Optional[str] = None
        stderr: Optional[str] = None
        return_code: int = 0

    class _HarborBase(abc.ABC):  # type: ignore[no-redef]
        """What Harbor's BaseEnvironment gives its subclasses and its trial
        calls, for when Harbor is not installed: the same constructor
        (keywords, overrides, validation order), ``default_user`` and
        ``with_default_user``, ``network_policy`` and its validation,
        ``ensure_dirs``/``empty_dirs``/``reset_dirs``, ``run_healthcheck``,
        ``download_dir_with_exclusions``. Subclasses supply the rest."""

        def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                     task_env_config: Any, logger: Optional[logging.Logger] = None,
                     override_cpus: Optional[int] = None, override_memory_mb: Optional[int] = None,
                     override_storage_mb: Optional[int] = None, override_gpus: Optional[int] = None,
                     override_tpu: Any = None, cpu_enforcement_policy: Any = "auto",
                     memory_enforcement_policy: Any = "auto", persistent_env: Optional[Dict[str, str]] = None,
                     mounts: Optional[List[Mapping[str, Any]]] = None, network_policy: Any = None,
                     extra_docker_compose: Optional[Sequence[Union[Path, str]]] = None, **kwargs: Any) -> None:
            kwargs.pop("suppress_override_warnings", None)
            if kwargs:
                raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(kwargs))}")
            self.environment_dir, self.environment_name, self.session_id = environment_dir, environment_name, session_id
            self.trial_paths, self.task_env_config = trial_paths, task_env_config
            self.default_user: Union[str, int, None] = None
            self.extra_docker_compose_paths = [Path(p) for p in (extra_docker_compose or [])]
            if self.extra_docker_compose_paths and not self.capabilities.docker_compose:
                raise ValueError(f"{self.type()} environment does not support --extra-docker-compose.")
            for attr, v in (("cpus", override_cpus), ("memory_mb", override_memory_mb),
                            ("storage_mb", override_storage_mb), ("gpus", override_gpus), ("tpu", override_tpu)):
                if v is not None:
                    setattr(task_env_config, attr, v)
            self._cpu_resource_mode = _mode_value(cpu_enforcement_policy) or "auto"
            self._memory_resource_mode = _mode_value(memory_enforcement_policy) or "auto"
            self._persistent_env: Dict[str, str] = dict(persistent_env or {})
            self._mounts = list(mounts or [])
            self._network_policy = network_policy if network_policy is not None else NetworkPolicy()
            self.logger = (logger or logging.getLogger("harbor")).getChild(__name__)
            if getattr(task_env_config, "env", None):
                self._persistent_env = {**_resolve_env(task_env_config.env), **self._persistent_env}
            self._validate_definition()
            caps = type(self).resource_capabilities()
            for label, mode, limit, request in (("CPU", self._cpu_resource_mode, caps.cpu_limit, caps.cpu_request),
                                                ("memory", self._memory_resource_mode, caps.memory_limit,
                                                 caps.memory_request)):
                if mode in ("limit", "guarantee") and not limit:
                    raise ValueError(f"{self.type()} environment does not support {label} resource limits.")
                if mode in ("request", "guarantee") and not request:
                    raise ValueError(f"{self.type()} environment does not support {label} resource requests.")
            if (getattr(task_env_config, "gpus", None) or 0) > 0 and not self.capabilities.gpus:
                raise RuntimeError(f"Task requires {task_env_config.gpus} GPU(s) but {self.type()} environment "
                                   "does not support GPU allocation.")
            if getattr(task_env_config, "tpu", None) is not None and not self.capabilities.tpus:
                raise RuntimeError(f"Task requires a TPU slice but {self.type()} environment does not support TPUs.")
            self.validate_network_policy_support()
            if self.os == TaskOS.WINDOWS and not self.capabilities.windows:
                raise RuntimeError(f"Task declares [environment].os = 'windows' but the {self.type()} environment "
                                   "does not support Windows containers.")

        @property
        def os(self) -> Any:
            return TaskOS(_mode_value(getattr(self.task_env_config, "os", "linux")) or "linux")

        @property
        def network_policy(self) -> Any:
            return self._network_policy

        @classmethod
        def resource_capabilities(cls) -> Any:
            return None

        def validate_network_policy_support(self, network_policy: Any = None) -> None:
            mode = _mode_value((network_policy or self._network_policy).network_mode)
            if mode == "no-network" and not self.capabilities.disable_internet:
                raise ValueError(f"network_mode='no-network' is not supported by {self.type()} environment.")
            if mode == "allowlist" and not self.capabilities.network_allowlist:
                raise ValueError(f"network_mode='allowlist' is not supported by {self.type()} environment.")

        async def set_network_policy(self, network_policy: Any) -> None:
            self.validate_network_policy_support(network_policy)
            if network_policy == self._network_policy:
                return
            if not self.capabilities.dynamic_network_policy:
                raise ValueError(f"{self.type()} environment cannot change network policy after start.")
            await self._apply_network_policy(network_policy)
            self._network_policy = network_policy

        async def _apply_network_policy(self, network_policy: Any) -> None:
            raise NotImplementedError

        def _resolve_user(self, user: Union[str, int, None]) -> Union[str, int, None]:
            return user if user is not None else self.default_user

        @contextlib.contextmanager
        def with_default_user(self, user: Union[str, int, None]) -> Iterator[None]:
            previous, self.default_user = self.default_user, user
            try:
                yield
            finally:
                self.default_user = previous

        def _merge_env(self, env: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
            merged = {**self._persistent_env, **(env or {})}
            return merged or None

        def _mount_targets(self, *, writable_only: bool = False) -> List[str]:
            out: List[str] = []
            for m in self._mounts:
                t = m.get("target")
                if t and t not in out and not (writable_only and m.get("read_only")):
                    out.append(t)
            return out

        async def ensure_dirs(self, dirs: Sequence[Any], *, chmod: bool = True) -> Optional[ExecResult]:
            if not dirs:
                return None
            q = " ".join(shlex.quote(str(d)) for d in dirs)
            return await self.exec(f"mkdir -p {q}" + (f" && chmod 777 {q}" if chmod else ""),
                                   user="root" if chmod else None)

        async def empty_dirs(self, dirs: Sequence[Any], *, chmod: bool = True) -> Optional[ExecResult]:
            if not dirs:
                return None
            steps = []
            for d in dirs:
                q = shlex.quote(str(d))
                steps += [f"{{ [ ! -L {q} ] && [ -d {q} ] || rm -rf {q}; }}", f"mkdir -p {q}",
                          f"find {q} -mindepth 1 -maxdepth 1 -exec rm -rf -- {{}} +"]
                if chmod:
                    steps.append(f"chmod 777 {q}")
            return await self.exec(" && ".join(steps), user="root")

        async def reset_dirs(self, *, remove_dirs: Sequence[Any], create_dirs: Sequence[Any],
                             chmod_dirs: Optional[Sequence[Any]] = None) -> ExecResult:
            steps = []
            for verb, ds in (("rm -rf", remove_dirs), ("mkdir -p", create_dirs), ("chmod 777", chmod_dirs or [])):
                if ds:
                    steps.append(verb + " " + " ".join(shlex.quote(str(d)) for d in ds))
            return await self.exec(" && ".join(steps) or "true", user="root")

        async def prepare_logs_for_host(self) -> None:
            """Nothing to do: the logs are downloaded, not mounted."""

        async def _upload_environment_dir_after_start(self) -> None:
            """A task with a docker_image and no Dockerfile gets its
            environment/ directory in the workdir, as Harbor's does."""
            d = Path(self.environment_dir)
            if not getattr(self.task_env_config, "docker_image", None) or (d / "Dockerfile").exists():
                return
            if any((d / f).exists() for f in _COMPOSE_FILES) or not d.is_dir() or not any(d.iterdir()):
                return
            workdir = getattr(self.task_env_config, "workdir", None)
            if not workdir:
                workdir = ((await self.exec("pwd")).stdout or "/").strip()
            await self.upload_dir(d, workdir)

        async def run_healthcheck(self, healthcheck: Any = None) -> None:
            """Run the healthcheck until it passes; HealthcheckError after
            ``retries`` consecutive failures past the start period."""
            hc = healthcheck if healthcheck is not None else getattr(self.task_env_config, "healthcheck", None)
            if hc is None:
                return
            start_period_end = time.monotonic() + hc.start_period_sec
            failures = 0
            while True:
                in_start = time.monotonic() < start_period_end
                if (await self.exec(hc.command, timeout_sec=int(hc.timeout_sec))).return_code == 0:
                    return
                if in_start:
                    await asyncio.sleep(hc.start_interval_sec)
                    continue
                failures += 1
                if failures >= hc.retries:
                    raise HealthcheckError(f"Healthcheck failed after {hc.retries} consecutive retries: {hc.command}")
                await asyncio.sleep(hc.interval_sec)

        async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Union[Path, str],
                                               exclude: List[str]) -> None:
            await self.download_dir(source_dir, target_dir, exclude=exclude)  # type: ignore[call-arg]

        async def attach(self) -> None:
            raise NotImplementedError("This environment does not support attaching.")


@dataclass(frozen=True)
class _ResourceModes:
    cpu: str
    memory: str


class _TypeName(str):
    """The environment type: a str (Harbor 0.13) with ``.value`` (Harbor 0.1
    formats ``type().value`` into its messages)."""

    @property
    def value(self) -> str:
        return str(self)


#: keywords Harbor's BaseEnvironment constructor defines (0.1 to 0.13);
#: anything else is refused, never forwarded
_HARBOR_KWARGS = ("override_cpus", "override_memory_mb", "override_storage_mb", "override_gpus", "override_tpu",
                  "suppress_override_warnings", "cpu_enforcement_policy", "memory_enforcement_policy",
                  "persistent_env", "mounts", "network_policy", "extra_docker_compose")
#: Harbor's own directories (EnvironmentPaths on Linux); the trial passes
#: them as bind mounts and, for an environment that is not mounted,
#: downloads and uploads them itself
_LOG_DIRS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")
_COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def _compose_file(environment_dir: Path) -> Optional[Path]:
    """The task environment's compose file, if it has one."""
    for f in _COMPOSE_FILES:
        if (environment_dir / f).exists():
            return environment_dir / f
    return None


def _mode_value(x: Any) -> str:
    return str(getattr(x, "value", x) or "")


class DsecEnvironment(_HarborBase):  # type: ignore[misc,valid-type]
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
        self._image_map = dict(image_map or {})
        self._build_network = build_network
        self._ttl_s, self._idle_ttl_s = ttl_s, idle_ttl_s
        self._labels = dict(labels or {})
        self._sb: Optional[AsyncSandbox] = None
        self._shell = "sh"
        self._refuse({**harbor_kwargs, "_kind": kind}, Path(environment_dir), environment_name)
        policy = harbor_kwargs.get("network_policy")
        if policy is None and hasattr(task_env_config, "resolve_baseline"):
            # Constructed without the trial's policy (Harbor 0.1, or by
            # hand): the task's own baseline, never a wider default.
            policy = task_env_config.resolve_baseline()
        if policy is not None:
            harbor_kwargs["network_policy"] = policy
        self._modes = _ResourceModes(_mode_value(harbor_kwargs.get("cpu_enforcement_policy")) or "auto",
                                     _mode_value(harbor_kwargs.get("memory_enforcement_policy")) or "auto")
        self.task_env_config = task_env_config
        self._policy = self._harbor_policy(policy)  # in force (or to start with)
        self._dsec_network(self._policy)  # refused here, before anything starts
        super().__init__(environment_dir=Path(environment_dir), environment_name=environment_name,
                         session_id=session_id, trial_paths=trial_paths, task_env_config=task_env_config,
                         logger=logger, **harbor_kwargs)
        self._resources = self._resource_spec(harbor_kwargs)

    # -- construction ---------------------------------------------------

    @staticmethod
    def _refuse(kw: Mapping[str, Any], environment_dir: Path, name: str) -> None:
        if kw.get("override_tpu") is not None:
            raise UnsupportedOption(_NAME, "override_tpu", "dsec has no TPUs")
        if kw.get("override_gpus"):
            raise UnsupportedOption(_NAME, f"override_gpus={kw['override_gpus']}", "dsec's Harbor environment has no GPUs")
        if kw.get("extra_docker_compose") and kw.get("_kind", "container") != "container":
            raise UnsupportedOption(_NAME, "extra_docker_compose", "sidecars are containers: use kind container")
        for k in ("cpu_enforcement_policy", "memory_enforcement_policy"):
            v = _mode_value(kw.get(k)).lower()
            if v in ("request", "guarantee"):
                raise UnsupportedOption(_NAME, f"{k}={v}", "dsec enforces cpu and memory as limits (use auto, limit or ignore)")
        for m in kw.get("mounts") or []:
            target = m.get("target")
            if target not in _LOG_DIRS:
                raise UnsupportedOption(_NAME, f"mount {m.get('source')} -> {target}",
                                        "a host directory cannot be mounted into a dsec sandbox; "
                                        f"only Harbor's own {', '.join(_LOG_DIRS)} (copied by the trial) are accepted")
        kind = kw.get("_kind", "container")
        f = _compose_file(environment_dir)
        if f is not None and kind != "container":
            raise UnsupportedOption(_NAME, f"task {name}'s environment/{f.name} (a multi-container environment) "
                                    f"on kind {kind}", "sidecars are containers: use kind container")

    def _harbor_policy(self, policy: Any) -> Any:
        """Harbor's policy as a NetworkPolicy: a policy as it is, a mode
        alone as that mode, none (Harbor 0.1) from the task config's
        ``allow_internet``."""
        if policy is None:
            cfg = self.task_env_config
            public = getattr(cfg, "allow_internet", True) is not False
            return NetworkPolicy(network_mode=NetworkMode.PUBLIC if public else NetworkMode.NO_NETWORK)
        if not hasattr(policy, "network_mode"):
            return NetworkPolicy(network_mode=NetworkMode(_mode_value(policy)))
        return policy

    def _dsec_network(self, policy: Any) -> Dict[str, Any]:
        """The create keywords (``network``, ``network_policy``) that enforce
        Harbor's policy, or UnsupportedOption: never a wider network.

        On a kind with egress policies every mode is an egress sandbox under
        a policy or none, so the trial can change it while it runs:
        ``public`` has no policy, ``allowlist`` allows exactly its hosts,
        ``no-network`` denies everything (the node answers its DNS queries
        with NXDOMAIN and drops its packets). Elsewhere only ``public`` and
        ``no-network`` exist, fixed at create."""
        policy = self._harbor_policy(policy)
        mode = _mode_value(getattr(policy, "network_mode", None)) or "public"
        hosts = list(getattr(policy, "allowed_hosts", None) or [])
        if mode not in ("public", "no-network", "allowlist"):
            raise UnsupportedOption(_NAME, f"network_mode={mode!r}", "dsec knows public, no-network and allowlist")
        if mode == "allowlist" and not hosts:
            raise UnsupportedOption(_NAME, "network_mode='allowlist' without allowed_hosts",
                                    "an allowlist names the hosts it allows")
        if self._kind not in POLICY_KINDS:
            if mode == "allowlist":
                raise UnsupportedOption(_NAME, f"network_mode='allowlist' (allowed_hosts: {', '.join(hosts)}) "
                                        f"on kind {self._kind}",
                                        f"a {self._kind} sandbox has no network; use kind "
                                        f"{' or '.join(POLICY_KINDS)}")
            return {"network": "egress" if mode == "public" else "none"}
        if mode == "public":
            return {"network": "egress"}
        return {"network": "egress", "network_policy": DsecPolicy(allow=hosts if mode == "allowlist" else [])}

    def _resource_spec(self, kw: Mapping[str, Any]) -> Dict[str, Any]:
        cfg = self.task_env_config
        spec: Dict[str, Any] = {}
        if self._modes.cpu != "ignore" and getattr(cfg, "cpus", None):
            spec["cpu"] = float(cfg.cpus)
        if self._modes.memory != "ignore" and getattr(cfg, "memory_mb", None):
            spec["memory_mb"] = int(cfg.memory_mb)
        if getattr(cfg, "tpu", None) is not None:
            raise UnsupportedOption(_NAME, "tpu", "dsec has no TPUs")
        if (getattr(cfg, "gpus", None) or 0) > 0:
            raise UnsupportedOption(_NAME, f"gpus={cfg.gpus}", "dsec's Harbor environment has no GPUs")
        if _mode_value(getattr(cfg, "os", "linux")).lower() not in ("", "linux"):
            raise UnsupportedOption(_NAME, f"os={_mode_value(cfg.os)}", "dsec sandboxes run Linux")
        storage = getattr(cfg, "storage_mb", None)
        if storage:
            if self._kind in DISK_KINDS:
                spec["disk_mb"] = int(storage)
            else:
                # Harbor 0.1 defaulted storage_mb to 10240: only a value the
                # task or the run set is a request.
                fields_set = getattr(cfg, "model_fields_set", None)
                asked = (kw.get("override_storage_mb") is not None or fields_set is None
                         or "storage_mb" in fields_set or "storage" in fields_set)
                if asked:
                    raise UnsupportedOption(_NAME, f"storage_mb={storage} on kind {self._kind}",
                                            f"a {self._kind} sandbox has no disk of its own; "
                                            f"use kind {', '.join(DISK_KINDS)} for a storage size")
        return spec

    # -- what Harbor reads -----------------------------------------------

    @staticmethod
    def type() -> str:
        return _TypeName("dsec")

    @property
    def capabilities(self) -> Any:
        """What Harbor's base and trial check before they ask: internet can
        be disabled; on every kind with a network (container, microvm, vm)
        an allowlist is enforced and the policy can change while the
        sandbox runs (the trial's phases)."""
        policies = self._kind in POLICY_KINDS
        return EnvironmentCapabilities(disable_internet=True, network_allowlist=policies,
                                       dynamic_network_policy=policies, docker_compose=self._kind == "container")

    @classmethod
    def resource_capabilities(cls) -> Any:
        """dsec enforces cpu and memory as limits; it reserves nothing."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True)

    @property
    def supports_dynamic_network_policy(self) -> bool:  # Harbor 0.1
        return self._kind in POLICY_KINDS

    @classmethod
    def preflight(cls) -> None:
        """Harbor calls this once before queueing trials: the server named by
        $DSEC_URL must answer and have a sandbox kind available."""
        try:
            info = sync_client().info()
        except DsecError as e:
            raise SystemExit(f"dsec at {os.environ.get('DSEC_URL') or 'http://127.0.0.1:7070'} is not reachable: {e} "
                             "(set DSEC_URL and DSEC_API_KEY)")
        kinds = [k for n in info.get("nodes", []) for k in n.get("kinds", [])]
        if not any(k.get("available") for k in kinds):
            raise SystemExit("dsec has no available sandbox kind")

    def _validate_definition(self) -> None:
        d = Path(self.environment_dir)
        self._refuse({"_kind": self._kind}, d, self.environment_name)
        if (not getattr(self.task_env_config, "docker_image", None) and not (d / "Dockerfile").exists()
                and _compose_file(d) is None):
            raise FileNotFoundError(f"Task environment directory {d} has no environment definition: "
                                    "no Dockerfile, no docker-compose.yaml and no [environment].docker_image")

    # -- lifecycle -------------------------------------------------------

    async def _image(self, force_build: bool) -> Optional[Image]:
        cfg = self.task_env_config
        d = Path(self.environment_dir)
        if not getattr(cfg, "docker_image", None) and not (d / "Dockerfile").exists():
            return None  # a compose file whose main service names its image
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
        """Start the sandbox from the task's image (built if needed), make
        Harbor's log directories, and upload environment/ for a prebuilt
        image without a Dockerfile, as Harbor's providers do."""
        if self._sb is not None:
            return
        img = await self._image(force_build)
        kw = {**(img.spec() if img else {}), **self._resources, "kind": self._kind, **self._dsec_network(self._policy)}
        compose = _compose_file(Path(self.environment_dir))
        extra = [Path(p).read_text() for p in getattr(self, "extra_docker_compose_paths", None) or []]
        if compose is not None or extra:
            # Harbor's order: the task's file, then the job's overlays.
            # A task without a file of its own gets a main service for the
            # overlays to extend.
            base = compose.read_text() if compose is not None else "services:\n  main: {}\n"
            kw["compose"] = [base, *extra]
            kw["compose_env"] = self._compose_env(img)
        workdir = getattr(self.task_env_config, "workdir", None)
        if workdir:
            kw["workdir"] = workdir
        kw["labels"] = {"harbor-env": _label(self.environment_name), "harbor-session": _label(self.session_id),
                        **self._labels}
        if self._ttl_s:
            kw["ttl_s"] = self._ttl_s
        if self._idle_ttl_s:
            kw["idle_ttl_s"] = self._idle_ttl_s
        sb = await self._client.create(**kw)
        self._sb = sb
        try:
            self._shell = "bash" if (await sb.exec(["sh", "-c", "command -v bash"])).exit_code == 0 else "sh"
            dirs = list(_LOG_DIRS)
            r = await sb.exec(["sh", "-c", 'mkdir -p "$@" && chmod 777 "$@"', "sh", *dirs], user="root")
            if r.exit_code != 0:
                raise RuntimeError(f"cannot make Harbor's directories: {r.stderr}")
            upload = getattr(self, "_upload_environment_dir_after_start", None)  # not in Harbor 0.1
            if upload is not None:
                await upload()
        except BaseException:
            await self.stop(delete=True)
            raise

    def _compose_env(self, img: Optional[Image]) -> Dict[str, str]:
        """The variables of the task's compose file, with Harbor's
        precedence: the process environment, then the task's and persistent
        environment, then Harbor's infrastructure variables (compose_env.py),
        which win."""
        cfg = self.task_env_config
        env = {**os.environ, **getattr(self, "_persistent_env", {})}
        main = (img.image or img.snapshot or "") if img else ""
        env.update({
            "CONTEXT_DIR": str(Path(self.environment_dir).resolve()),
            "MAIN_IMAGE_NAME": main,
            "PREBUILT_IMAGE_NAME": str(getattr(cfg, "docker_image", None) or main),
        })
        if self._resources.get("cpu"):
            env["CPUS"] = str(self._resources["cpu"])
        if self._resources.get("memory_mb"):
            env["MEMORY"] = f"{int(self._resources['memory_mb'])}M"
        return env

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
            raise RuntimeError("Sandbox not found. Please start the environment first.")
        return self._sb

    # -- commands and files ----------------------------------------------

    async def exec(self, command: str, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                   timeout_sec: Optional[int] = None, user: Union[str, int, None] = None) -> ExecResult:
        """Run a shell command (bash when the image has it) with the
        persistent environment. A timeout raises RuntimeError, as Harbor's
        Docker environment does."""
        u = self._resolve_user(user)
        r = await self._require().exec([self._shell, "-c", command], cwd=cwd, env=self._merge_env(env),
                                       timeout_s=timeout_sec, user=None if u is None else str(u))
        if r.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    async def upload_file(self, source_path: Union[Path, str], target_path: str) -> None:
        await self._require().upload(str(source_path), str(target_path))

    async def upload_dir(self, source_dir: Union[Path, str], target_dir: str) -> None:
        """The directory's contents into target_dir (merged with what is
        there), as ``docker cp src/. target`` copies them."""
        await upload_dir(self._require(), str(source_dir), str(target_dir))

    async def download_file(self, source_path: str, target_path: Union[Path, str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(str(target_path))), exist_ok=True)
        await self._require().download(str(source_path), str(target_path))

    async def download_dir(self, source_dir: str, target_dir: Union[Path, str],
                           exclude: Optional[List[str]] = None) -> None:
        """The directory's tree into target_dir, overwriting files there."""
        await download_dir(self._require(), str(source_dir), str(target_dir),
                           skip=(lambda rel: any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(os.path.basename(rel), p)
                                                 for p in exclude)) if exclude else None)

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Union[Path, str],
                                           exclude: List[str]) -> None:
        await self.download_dir(source_dir, target_dir, exclude=exclude)

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

    async def _apply_network_policy(self, network_policy: Any) -> None:
        """Put Harbor's policy in force (Harbor's ``set_network_policy``
        calls this for a policy other than the current one): before start it
        is the one the sandbox starts with; after, dsec's egress policy
        changes for the sandbox's new connections and cuts open ones it
        denies. On a kind without egress policies, refused."""
        net = self._dsec_network(network_policy)
        if self._kind not in POLICY_KINDS:
            raise UnsupportedOption(_NAME, f"network_mode={_mode_value(network_policy.network_mode)!r} after start",
                                    f"a {self._kind}'s network is fixed when it is created")
        if self._sb is not None:
            await self._sb.set_network_policy(net.get("network_policy"))
        self._policy = network_policy

    async def apply_network_policy(self, policy: Any) -> None:  # Harbor 0.1
        """Harbor 0.1's name for a phase change: a policy equal to the one in
        force is accepted as it is."""
        policy = self._harbor_policy(policy)
        if not _same_policy(policy, self._policy):
            await self._apply_network_policy(policy)

    @property
    def sandbox(self) -> Optional[AsyncSandbox]:
        """The dsec sandbox, once started."""
        return self._sb


def _same_policy(a: Any, b: Any) -> bool:
    return (_mode_value(a.network_mode), list(getattr(a, "allowed_hosts", None) or [])) == \
        (_mode_value(b.network_mode), list(getattr(b, "allowed_hosts", None) or []))


def _label(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", s)[:63] or "x"


def _resolve_env(env: Mapping[str, str]) -> Dict[str, str]:
    """Harbor's ${VAR} and ${VAR:-default} templates, from the host."""
    def sub(m: "re.Match[str]") -> str:
        v = os.environ.get(m.group(1))
        return v if v else (m.group(2) or "")

    return {k: re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, str(v)) for k, v in env.items()}


# Harbor 0.1 declared these abstract; Harbor 0.13 reads `capabilities` and
# warns when a subclass declares them, so they are added only where the
# installed Harbor asks for them.
if HARBOR and "is_mounted" in getattr(_HarborBase, "__abstractmethods__", ()):  # pragma: no cover - Harbor 0.1 only
    DsecEnvironment.is_mounted = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.supports_gpus = property(lambda self: False)  # type: ignore[attr-defined]
    DsecEnvironment.can_disable_internet = property(lambda self: True)  # type: ignore[attr-defined]
    abc.update_abstractmethods(DsecEnvironment)  # type: ignore[attr-defined]


__all__ = ["DsecEnvironment", "ExecResult", "EnvironmentConfig", "HealthcheckConfig", "HealthcheckError",
           "NetworkMode", "NetworkPolicy", "TaskOS", "EnvironmentCapabilities", "EnvironmentResourceCapabilities",
           "UnsupportedOption", "SandboxBuildFailedError", "HARBOR"]
