"""dsec as ROCK's sandbox client (``rock.sdk.sandbox.client.Sandbox``), the
one ROLL's agentic environments drive.

Written against alibaba/ROCK ``4889118bde2d`` (2026-08-21):
``rock/sdk/sandbox/client.py``, ``rock/sdk/sandbox/config.py``,
``rock/sdk/sandbox/network.py``, ``rock/sdk/sandbox/speedup/``,
``rock/sdk/common/exceptions.py``, ``rock/_codes.py``,
``rock/actions/sandbox/{request,response}.py`` and, for what the server does
with a session, ``rock/rocklet/{linux,rocklet}.py``; and the call sites in
alibaba/ROLL ``8eb27cc2dc34`` (2026-08-19):
``roll/pipeline/agentic/env/rock/sandbox_manager_v2.py``,
``roll/pipeline/agentic/env/sandbox/sokoban_sandbox_env.py``,
``roll/pipeline/agentic/agent_runner/rock/{rock_agent_runner,pull_runner}.py``.

The one-line change is the import::

    from dsec.adapters.rock import Sandbox      # was: from rock.sdk.sandbox.client import Sandbox
    sandbox = Sandbox(SandboxConfig(base_url=DSEC_URL, image="debian", ...))

``Sandbox`` takes ROCK's ``SandboxConfig``, its methods take and return
ROCK's request and response models (``CreateBashSessionRequest``,
``BashAction``, ``Observation``, ``Command``/``CommandResponse``,
``ReadFileRequest``/``ReadFileResponse``, ``UploadResponse``...) and raise
ROCK's exceptions (``BadRequestRockError``, ``InternalServerRockError``,
``CommandRockError``, ``InvalidParameterRockException``). A sandbox that
died, expired or was deleted raises :class:`SandboxTerminated`, a
``SandboxNotFoundRockError`` with dsec's ``infra = True``. With ROCK
installed its classes are used; without it, stand-ins with the same names,
fields and defaults.

Every call works from its own event loop (ROLL wraps each one in
``asyncio.run``). Options the adapter cannot honour raise
``UnsupportedOption`` naming them; see docs/rl.md for the list.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import re
import shlex
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..aio import AsyncSandbox
from ..errors import DeadlineExceeded, DsecError, InvalidRequest, NotFound, SandboxGone
from ..shell import AsyncShellSession
from ._common import DISK_KINDS, StandInModel, UnsupportedOption, async_client, upload_dir

_NAME = "dsec ROCK sandbox"
_log = logging.getLogger(__name__)

try:
    from rock._codes import codes
    from rock.actions import (Action, BashAction, BashObservation, CloseBashSessionRequest, CloseBashSessionResponse,
                              CloseResponse, CloseSessionRequest, CloseSessionResponse, Command, CommandResponse,
                              CreateBashSessionRequest, CreateBashSessionResponse, ExecuteBashSessionResponse,
                              IsAliveResponse, Observation, ReadFileRequest, ReadFileResponse, SandboxStatusResponse,
                              UploadMode, UploadRequest, UploadResponse, WriteFileRequest, WriteFileResponse)
    from rock.sdk.common.exceptions import (BadRequestRockError, CommandRockError, InternalServerRockError,
                                            InvalidParameterRockException, RockException, SandboxNotFoundRockError)
    from rock.sdk.sandbox.config import SandboxConfig
    from rock.sdk.sandbox.speedup.types import SpeedupType

    ROCK = True
except ImportError:
    ROCK = False

    class codes(enum.IntEnum):  # type: ignore[no-redef]
        """ROCK's status codes (2xxx ok, 4xxx client, 5xxx server, 6xxx command)."""

        OK = 2000
        BAD_REQUEST = 4000
        INTERNAL_SERVER_ERROR = 5000
        COMMAND_ERROR = 6000

    class RockException(Exception):  # type: ignore[no-redef]
        """ROCK's base exception: a message and a status code."""

        _code: Any = None

        def __init__(self, message: Any, code: Any = None) -> None:
            super().__init__(message)
            self._code = code

        @property
        def code(self) -> Any:
            return self._code

    class InvalidParameterRockException(RockException):  # type: ignore[no-redef]
        def __init__(self, message: Any) -> None:
            super().__init__(message)

    class BadRequestRockError(RockException):  # type: ignore[no-redef]
        def __init__(self, message: Any, code: Any = codes.BAD_REQUEST) -> None:
            super().__init__(message, code)

    class SandboxNotFoundRockError(BadRequestRockError):  # type: ignore[no-redef]
        pass

    class InternalServerRockError(RockException):  # type: ignore[no-redef]
        def __init__(self, message: Any, code: Any = codes.INTERNAL_SERVER_ERROR) -> None:
            super().__init__(message, code)

    class CommandRockError(RockException):  # type: ignore[no-redef]
        def __init__(self, message: Any, code: Any = codes.COMMAND_ERROR) -> None:
            super().__init__(message, code)

    class SpeedupType(str, enum.Enum):  # type: ignore[no-redef]
        APT = "apt"
        PIP = "pip"
        GITHUB = "github"

    class UploadMode(str, enum.Enum):  # type: ignore[no-redef]
        AUTO = "auto"
        OSS = "oss"
        DIRECT = "direct"

    _Model = StandInModel

    @dataclass
    class Command(_Model):  # type: ignore[no-redef]
        command: Union[str, List[str]]
        session_type: str = "bash"
        timeout: Optional[float] = 1200
        env: Optional[Dict[str, str]] = None
        cwd: Optional[str] = None

    @dataclass
    class CreateBashSessionRequest(_Model):  # type: ignore[no-redef]
        session_type: str = "bash"
        session: str = "default"
        startup_source: List[str] = field(default_factory=list)
        env_enable: bool = False
        env: Optional[Dict[str, str]] = None
        remote_user: Optional[str] = None

    @dataclass
    class BashAction(_Model):  # type: ignore[no-redef]
        command: str
        action_type: str = "bash"
        session: str = "default"
        timeout: Optional[float] = None
        check: str = "raise"

    Action = BashAction

    @dataclass
    class WriteFileRequest(_Model):  # type: ignore[no-redef]
        content: str
        path: str

    @dataclass
    class CloseBashSessionRequest(_Model):  # type: ignore[no-redef]
        session_type: str = "bash"
        session: str = "default"

    CloseSessionRequest = CloseBashSessionRequest

    @dataclass
    class ReadFileRequest(_Model):  # type: ignore[no-redef]
        path: str
        encoding: Optional[str] = None
        errors: Optional[str] = None

    @dataclass
    class UploadRequest(_Model):  # type: ignore[no-redef]
        source_path: str
        target_path: str
        upload_mode: UploadMode = UploadMode.AUTO

    @dataclass
    class IsAliveResponse(_Model):  # type: ignore[no-redef]
        is_alive: bool
        message: str = ""

        def __bool__(self) -> bool:
            return self.is_alive

    @dataclass
    class SandboxStatusResponse(_Model):  # type: ignore[no-redef]
        sandbox_id: Optional[str] = None
        status: Optional[Dict[str, Any]] = None
        port_mapping: Optional[Dict[str, Any]] = None
        host_name: Optional[str] = None
        host_ip: Optional[str] = None
        is_alive: bool = True
        image: Optional[str] = None
        metadata: Optional[Dict[str, str]] = None
        gateway_version: Optional[str] = None
        swe_rex_version: Optional[str] = None
        user_id: Optional[str] = None
        experiment_id: Optional[str] = None
        namespace: Optional[str] = None
        cpus: Optional[float] = None
        memory: Optional[str] = None
        num_gpus: Optional[float] = None
        accelerator_type: Optional[str] = None
        disk: Optional[str] = None
        state: Optional[str] = None
        start_time: Optional[str] = None
        stop_time: Optional[str] = None
        create_time: Optional[str] = None
        archive_time: Optional[str] = None
        delete_time: Optional[str] = None
        auto_stop_time: Optional[str] = None
        auto_archive_time: Optional[str] = None
        auto_delete_time: Optional[str] = None
        state_history: List[Any] = field(default_factory=list)

    @dataclass
    class CommandResponse(_Model):  # type: ignore[no-redef]
        stdout: str = ""
        stderr: str = ""
        exit_code: Optional[int] = None

    @dataclass
    class WriteFileResponse(_Model):  # type: ignore[no-redef]
        success: bool = False
        message: str = ""

    @dataclass
    class ExecuteBashSessionResponse(_Model):  # type: ignore[no-redef]
        success: bool = False
        message: str = ""

    @dataclass
    class CreateBashSessionResponse(_Model):  # type: ignore[no-redef]
        output: str = ""
        session_type: str = "bash"

    @dataclass
    class BashObservation(_Model):  # type: ignore[no-redef]
        session_type: str = "bash"
        output: str = ""
        exit_code: Optional[int] = None
        failure_reason: str = ""
        expect_string: str = ""

    Observation = BashObservation

    @dataclass
    class CloseBashSessionResponse(_Model):  # type: ignore[no-redef]
        session_type: str = "bash"

    CloseSessionResponse = CloseBashSessionResponse

    @dataclass
    class ReadFileResponse(_Model):  # type: ignore[no-redef]
        content: str = ""

    @dataclass
    class UploadResponse(_Model):  # type: ignore[no-redef]
        success: bool = False
        message: str = ""
        file_name: str = ""

    @dataclass
    class CloseResponse(_Model):  # type: ignore[no-redef]
        pass

    _CONFIG_DEFAULTS: Dict[str, Any] = {
        "base_url": os.environ.get("ROCK_BASE_URL", "http://localhost:8080"),
        "xrl_authorization": None, "extra_headers": None,
        "image": "python:3.11", "image_os": "linux", "auto_clear_seconds": 60 * 5,
        "startup_timeout": float(os.environ.get("ROCK_SANDBOX_STARTUP_TIMEOUT_SECONDS", "180")),
        "memory": "8g", "cpus": 2.0, "limit_cpus": None, "num_gpus": None, "accelerator_type": None,
        "user_id": None, "experiment_id": None, "cluster": os.environ.get("ROCK_DEFAULT_CLUSTER", "vpc-nt-a"),
        "namespace": None, "registry_username": None, "registry_password": None, "use_kata_runtime": False,
        "sandbox_id": None, "auto_archive_seconds": None, "auto_delete_seconds": None, "disk": "50G",
    }

    class SandboxConfig:  # type: ignore[no-redef]
        """ROCK's SandboxConfig: the same fields and defaults. Like a
        pydantic model it records the fields given (``model_fields_set``);
        unlike one it refuses a field it does not know (TypeError)."""

        def __init__(self, **kw: Any) -> None:
            unknown = sorted(set(kw) - set(_CONFIG_DEFAULTS))
            if unknown:
                raise TypeError(f"SandboxConfig: unexpected field(s) {', '.join(unknown)}")
            for k, v in _CONFIG_DEFAULTS.items():
                setattr(self, k, kw.get(k, v))
            if self.extra_headers is None:
                self.extra_headers = {}
            self.model_fields_set = set(kw)

        def model_dump(self, **_: Any) -> Dict[str, Any]:
            return {k: getattr(self, k) for k in _CONFIG_DEFAULTS}

        def __repr__(self) -> str:
            return "SandboxConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _CONFIG_DEFAULTS) + ")"


class SandboxTerminated(SandboxNotFoundRockError):  # type: ignore[misc,valid-type]
    """The sandbox died, expired or was deleted: a dsec infrastructure
    failure (mask the rollout rather than score it)."""

    infra = True


#: before Python 3.11 asyncio's TimeoutError is a class of its own
_TIMEOUTS = (TimeoutError,) if asyncio.TimeoutError is TimeoutError else (TimeoutError, asyncio.TimeoutError)


class CommandTimeout(CommandRockError, *_TIMEOUTS):  # type: ignore[misc,valid-type]
    """A command outlived its timeout. It is also a ``TimeoutError`` (which
    is ``asyncio.TimeoutError``), the error ROLL's ``asyncio.wait_for``
    around a call is written to catch; ROCK raises httpx's ReadTimeout, which
    the stdlib-only SDK cannot."""

    infra = False


def _rock_error(e: DsecError, what: str) -> Exception:
    """ROCK's exception for a dsec error, carrying dsec's ``infra`` flag."""
    if isinstance(e, SandboxGone) or (isinstance(e, NotFound) and "sandbox" in str(e)):
        return SandboxTerminated(f"{what}: {e}")
    err: Exception
    if isinstance(e, InvalidRequest) or e.kind in ("invalid", "not_found", "conflict", "permission_denied",
                                                    "unauthenticated", "unimplemented"):
        err = BadRequestRockError(f"{what}: {e}")
    else:
        err = InternalServerRockError(f"{what}: {e}")
    err.infra = e.infra  # type: ignore[attr-defined]
    return err


async def _guard(aw: Any, what: str) -> Any:
    """Await, with dsec's errors as ROCK's (a deadline as CommandTimeout)."""
    try:
        return await aw
    except DeadlineExceeded as e:
        raise CommandTimeout(f"{what}: {e}") from e
    except DsecError as e:
        raise _rock_error(e, what) from e


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*")


def _refused(e: DsecError, response: Any, what: str) -> Any:
    """A failed write or upload as ROCK answers it: a response with
    ``success=False``; a dead sandbox raises ``SandboxTerminated``."""
    if isinstance(e, SandboxGone) or (isinstance(e, NotFound) and "sandbox" in str(e)):
        raise SandboxTerminated(f"{what}: {e}") from e
    return response(success=False, message=f"{what}: {e}")


def _size_mb(option: str, value: Any) -> int:
    """ROCK's sizes ("8g", "512m", "50G", "1Ti") in MiB."""
    m = _SIZE.fullmatch(str(value).lower())
    if not m:
        raise UnsupportedOption(_NAME, f"{option}={value!r}", "give a size such as 8g, 512m or 50G")
    n, unit = float(m.group(1)), m.group(2)
    return max(16, int(math.ceil(n * {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}[unit])))


def _enum_value(v: Any) -> Any:
    return v.value if isinstance(v, enum.Enum) else v


#: dsec sandbox states as ROCK's State values
_STATES = {"running": "running", "paused": "stopped", "deleting": "deleted", "deleted": "deleted",
           "failed": "deleted"}


class Network:
    """``sandbox.network``: ROCK's package-mirror speedup, done with
    commands in the sandbox."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self.sandbox = sandbox

    async def speedup(self, speedup_type: Any, speedup_value: str, timeout: int = 300) -> Any:
        """Point APT or pip at a mirror, or github.com at an address.
        Returns an Observation: exit code 1 with ``failure_reason`` "Precheck
        failed" when the image has no apt (or pip), as ROCK reports it."""
        kind = _enum_value(speedup_type)
        value = speedup_value.rstrip("/")
        if kind == "pip":
            url = value if "/simple" in value else value + "/pypi/simple/"
            host = urllib.parse.urlparse(url).hostname or ""
            check = "command -v pip3 >/dev/null 2>&1 || command -v pip >/dev/null 2>&1"
            conf = f"[global]\nindex-url = {url}\ntrusted-host = {host}\n"
            script = (f"mkdir -p /etc && printf %s {shlex.quote(conf)} > /etc/pip.conf && "
                      "h=${HOME:-/root}; mkdir -p \"$h/.pip\" \"$h/.config/pip\" && cp /etc/pip.conf \"$h/.pip/pip.conf\" && "
                      f"cp /etc/pip.conf \"$h/.config/pip/pip.conf\" && echo pip mirror set to {shlex.quote(url)}")
        elif kind == "apt":
            host = urllib.parse.urlparse(value).netloc
            if not host:
                return Observation(output=f"not a mirror URL: {speedup_value}", exit_code=1,
                                   failure_reason="Invalid speedup value")
            check = "command -v apt-get >/dev/null 2>&1"
            # Every repository's scheme and host, in every sources file, becomes the mirror's.
            repl = value.replace("\\", "\\\\").replace("#", "\\#").replace("&", "\\&")
            sed = r"/^[[:space:]]*\(deb\|deb-src\|URIs:\)/ s#https\?://[^/[:space:]]*#" + repl + "#g"
            script = ("for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list "
                      "/etc/apt/sources.list.d/*.sources; do [ -f \"$f\" ] && sed -i "
                      f"{shlex.quote(sed)} \"$f\"; done; echo apt mirror set to {shlex.quote(value)}")
        elif kind == "github":
            check = "test -w /etc/hosts"
            script = (f"grep -v '[[:space:]]github.com$' /etc/hosts > /tmp/.hosts.$$; "
                      f"echo {shlex.quote(value + ' github.com')} >> /tmp/.hosts.$$ && "
                      f"cat /tmp/.hosts.$$ > /etc/hosts && rm -f /tmp/.hosts.$$ && echo github.com is {shlex.quote(value)}")
        else:
            return Observation(output=f"Unsupported speedup type: {speedup_type}", exit_code=1,
                               failure_reason="Invalid speedup type")
        sb = self.sandbox._live()
        pre = await _guard(sb.exec(["sh", "-c", check], timeout_s=timeout), "speedup")
        if pre.exit_code != 0:
            return Observation(output=f"{kind} is not available in the image, {kind} speedup is not supported",
                               exit_code=1, failure_reason="Precheck failed")
        r = await _guard(sb.exec(["sh", "-c", script], timeout_s=timeout, user="root"), "speedup")
        if r.timed_out:
            return Observation(output=r.stdout + r.stderr, exit_code=1, failure_reason=f"timeout after {timeout}s")
        return Observation(output=r.stdout + r.stderr, exit_code=r.exit_code,
                           failure_reason="" if r.exit_code == 0 else r.stderr.strip())


class Sandbox:
    """ROCK's ``Sandbox`` on a dsec sandbox: ``Sandbox(config)``, then
    ``await start()``; bash sessions, commands, files; ``await stop()``
    deletes it.

    ``url``/``api_key`` name the dsec server; without them ``$DSEC_URL`` /
    ``$DSEC_API_KEY``, then ``config.base_url`` and the config's
    ``XRL-Authorization`` token. ``kind`` is dsec's sandbox kind,
    ``network`` its network ("none" or "egress"), ``image_map`` renames
    images the dsec server does not have, ``ttl_s`` bounds the sandbox's
    whole life (ROCK's ``auto_clear_seconds`` is its idle limit)."""

    def __init__(self, config: Any, *, url: Optional[str] = None, api_key: Optional[str] = None,
                 kind: str = "container", network: str = "none", image_map: Optional[Mapping[str, str]] = None,
                 ttl_s: int = 24 * 3600, labels: Optional[Mapping[str, str]] = None) -> None:
        self.config = config
        self._dsec_url = url or os.environ.get("DSEC_URL") or config.base_url
        self._api_key = api_key if api_key is not None else (os.environ.get("DSEC_API_KEY") or self._token(config))
        self._url = self._dsec_url
        self._kind, self._network, self._ttl_s = kind, network, ttl_s
        self._image_map = dict(image_map or {})
        self._labels = dict(labels or {})
        self._client = async_client(self._dsec_url, self._api_key)
        self._sb: Optional[AsyncSandbox] = None
        self._sandbox_id: Optional[str] = None
        self._host_name: Optional[str] = None
        self._host_ip: Optional[str] = None
        self._cluster = getattr(config, "cluster", None)
        self._namespace = getattr(config, "namespace", None)
        self._experiment_id = getattr(config, "experiment_id", None)
        self._sessions: Dict[str, AsyncShellSession] = {}
        self._dirty: set = set()
        self.network = Network(self)
        self.agent: Any = None  # ROLL's AgentManager sets it
        self.model_service: Any = None

    @staticmethod
    def _token(config: Any) -> Optional[str]:
        """The token ROCK would send as XRL-Authorization, if any."""
        hdr = (getattr(config, "extra_headers", None) or {}).get("XRL-Authorization")
        tok = hdr or (f"Bearer {config.xrl_authorization}" if getattr(config, "xrl_authorization", None) else "")
        tok = tok.strip()
        return tok[len("Bearer "):].strip() if tok.lower().startswith("bearer ") else (tok or None)

    # -- what ROCK's callers read ---------------------------------------

    @property
    def sandbox_id(self) -> Optional[str]:
        return self._sandbox_id

    @property
    def host_name(self) -> Optional[str]:
        """The dsec node that runs the sandbox."""
        return self._host_name

    @property
    def host_ip(self) -> Optional[str]:
        """The dsec server's host (dsec does not publish a sandbox's
        address; ROLL logs this and checks that it is set)."""
        return self._host_ip

    @property
    def cluster(self) -> Optional[str]:
        return self._cluster

    @property
    def url(self) -> str:
        return self._url

    @url.setter
    def url(self, value: str) -> None:
        self._url = value

    @property
    def sandbox(self) -> Optional[AsyncSandbox]:
        """The dsec sandbox (None before start)."""
        return self._sb

    def _live(self) -> AsyncSandbox:
        if self._sb is None:
            raise BadRequestRockError("sandbox is not started (call start() or attach() first)")
        return self._sb

    def __str__(self) -> str:
        return (f"Sandbox(sandbox_id={self._sandbox_id}, host_name={self._host_name!r}, host_ip={self._host_ip}, "
                f"image={getattr(self.config, 'image', None)}, cluster={self._cluster})")

    __repr__ = __str__

    # -- lifecycle -------------------------------------------------------

    def _spec(self) -> Dict[str, Any]:
        """The dsec create spec for the config; refuses what dsec cannot do."""
        c = self.config
        given = getattr(c, "model_fields_set", None)

        def asked(name: str) -> bool:
            return given is None or name in given

        if str(getattr(c, "image_os", "linux")).casefold() != "linux":
            raise UnsupportedOption(_NAME, f"image_os={c.image_os!r}", "dsec sandboxes run Linux")
        if (c.num_gpus or 0) > 0:
            raise UnsupportedOption(_NAME, f"num_gpus={c.num_gpus}", "dsec's ROCK sandboxes have no GPUs")
        if c.accelerator_type:
            raise UnsupportedOption(_NAME, f"accelerator_type={c.accelerator_type!r}", "dsec has no accelerators")
        if c.registry_username or c.registry_password:
            raise UnsupportedOption(_NAME, "registry_username/registry_password",
                                    "dsec runs the images its server has; it pulls from no private registry")
        if c.use_kata_runtime and self._kind not in ("microvm", "vm"):
            raise UnsupportedOption(_NAME, "use_kata_runtime=True",
                                    "for a VM-isolated sandbox construct the adapter with kind='microvm' or 'vm'")
        if c.sandbox_id:
            raise UnsupportedOption(_NAME, f"sandbox_id={c.sandbox_id!r} at start",
                                    "dsec names its sandboxes; use attach(sandbox_id) to drive an existing one")
        if c.auto_archive_seconds is not None:
            raise UnsupportedOption(_NAME, "auto_archive_seconds", "dsec does not archive sandboxes")
        if c.auto_delete_seconds is not None:
            raise UnsupportedOption(_NAME, "auto_delete_seconds",
                                    "stop() deletes the sandbox; its life is bounded by auto_clear_seconds (idle) "
                                    "and the adapter's ttl_s")
        if c.limit_cpus is not None and float(c.limit_cpus) != float(c.cpus):
            raise UnsupportedOption(_NAME, f"limit_cpus={c.limit_cpus} (cpus={c.cpus})",
                                    "dsec's cpu is one number, a limit; it reserves nothing below it")
        extra = {k for k in (getattr(c, "extra_headers", None) or {}) if k != "XRL-Authorization"}
        if extra:
            raise UnsupportedOption(_NAME, f"extra_headers {', '.join(sorted(extra))}",
                                    "dsec's client sends no custom headers (XRL-Authorization is the API key)")
        image = self._image_map.get(c.image, c.image)
        idle = max(60, int(math.ceil(c.auto_clear_seconds / 60)) * 60)  # ROCK rounds up to minutes
        spec: Dict[str, Any] = {"image": image, "kind": self._kind, "network": self._network,
                                "cpu": float(c.cpus), "memory_mb": _size_mb("memory", c.memory),
                                "ttl_s": max(self._ttl_s, idle), "idle_ttl_s": idle}
        if c.disk:
            if self._kind in DISK_KINDS:
                spec["disk_mb"] = _size_mb("disk", c.disk)
            elif asked("disk"):
                raise UnsupportedOption(_NAME, f"disk={c.disk!r} on kind {self._kind}",
                                        f"a {self._kind} sandbox has no disk of its own; use kind "
                                        f"{', '.join(DISK_KINDS)}")
        labels = dict(self._labels)
        for key, v in (("rock-user-id", c.user_id), ("rock-experiment-id", c.experiment_id),
                       ("rock-namespace", c.namespace), ("rock-cluster", c.cluster)):
            if v:
                labels[key] = str(v)
        if labels:
            spec["labels"] = labels
        return spec

    async def start(self) -> None:
        """Create the sandbox and wait (up to ``startup_timeout``) until it
        runs. A config dsec cannot honour raises UnsupportedOption before
        anything is created; a refused create raises BadRequestRockError,
        a failed one InternalServerRockError."""
        spec = self._spec()
        try:
            sb = await self._client.create(timeout_s=float(self.config.startup_timeout), **spec)
        except DeadlineExceeded as e:
            err = InternalServerRockError(f"Failed to start sandbox within {self.config.startup_timeout}s: {e}")
            err.infra = True  # type: ignore[attr-defined]
            raise err from e
        except DsecError as e:
            # A refused spec (an unknown image, a size past the node's) is
            # the caller's; anything else the platform's.
            cls = BadRequestRockError if e.kind in ("invalid", "not_found", "permission_denied",
                                                    "unauthenticated", "unimplemented") else InternalServerRockError
            err = cls(f"Failed to start sandbox: {e}")
            err.infra = e.infra  # type: ignore[attr-defined]
            raise err from e
        self._adopt(sb)

    def _adopt(self, sb: AsyncSandbox) -> None:
        self._sb = sb
        self._sessions.clear()
        self._dirty.clear()
        self._sandbox_id = sb.id
        info = sb.info
        self._host_name = (info.node if info is not None else "") or "dsec"
        self._host_ip = urllib.parse.urlparse(self._client.url).hostname or self._host_name

    async def attach(self, sandbox_id: str) -> None:
        """Drive a sandbox that already exists."""
        try:
            sb = await self._client.get(sandbox_id)
        except DsecError as e:
            raise Exception(f"Failed to attach sandbox {sandbox_id}: {e}") from e
        self._adopt(sb)
        self.config.sandbox_id = sandbox_id

    async def is_alive(self, *, timeout: Optional[float] = None) -> Any:
        """Whether the sandbox runs (a paused one counts: any call resumes
        it). ``message`` is the node's name, as ROCK's is the host's."""
        sb = self._live()
        try:
            ok = await asyncio.wait_for(sb.alive(), timeout)
        except asyncio.TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"sandbox {sb.id} did not answer in {timeout}s")
        return IsAliveResponse(is_alive=ok, message=(self._host_name or "") if ok else f"sandbox {sb.id} is not running")

    async def get_status(self, include_all_states: bool = False) -> Any:
        """ROCK's SandboxStatusResponse for the sandbox (ROCK's states:
        a paused dsec sandbox is "stopped" yet alive, since any call resumes
        it). A sandbox dsec no longer knows raises SandboxTerminated."""
        sb = self._live()
        info = await _guard(sb.refresh(), "Failed to get status")
        c = self.config
        return SandboxStatusResponse(
            sandbox_id=info.id, host_name=self._host_name, host_ip=self._host_ip,
            is_alive=info.state in ("running", "paused"), image=info.image or c.image,
            metadata=dict(info.labels) or None, user_id=c.user_id, experiment_id=c.experiment_id,
            namespace=c.namespace, cpus=float(c.cpus), memory=c.memory, disk=c.disk,
            state=_STATES.get(info.state, "pending"), create_time=info.created_at or None,
            auto_stop_time=info.expires_at or None)

    async def stop(self) -> None:
        """End the sessions and delete the sandbox. Idempotent; like ROCK's,
        it never raises (a failure is logged)."""
        sb, self._sb = self._sb, None
        sessions, self._sessions = list(self._sessions.values()), {}
        self._dirty.clear()
        for sh in sessions:
            try:
                await sh.close()
            except Exception:  # noqa: BLE001 - the sandbox is going anyway
                pass
        if sb is None:
            return
        try:
            await sb.close()
        except (SandboxGone, NotFound):
            pass
        except Exception as e:  # noqa: BLE001 - ROCK's stop ignores failures
            _log.warning("Failed to stop sandbox %s, IGNORE: %s", sb.id, e)

    async def delete(self) -> None:
        """Delete the sandbox; unlike stop() a failure raises."""
        if not self._sandbox_id:
            raise Exception("sandbox_id is not set, cannot delete")
        sb = self._sb or self._client.sandbox(self._sandbox_id)
        self._sb = None
        for sh in list(self._sessions.values()):
            try:
                await sh.close()
            except Exception:  # noqa: BLE001
                pass
        self._sessions.clear()
        await _guard(sb.close(), "Failed to delete sandbox")

    async def close(self) -> Any:
        await self.stop()
        return CloseResponse()

    async def restart(self) -> None:
        raise UnsupportedOption(_NAME, "restart()", "stop() deletes the dsec sandbox; start() makes a new one")

    async def archive(self) -> None:
        raise UnsupportedOption(_NAME, "archive()", "dsec does not archive sandboxes (see snapshot/fork)")

    async def commit(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOption(_NAME, "commit()", "dsec does not push sandboxes to image registries")

    async def commit_async(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOption(_NAME, "commit_async()", "dsec does not push sandboxes to image registries")

    async def get_commit_status(self) -> Any:
        raise UnsupportedOption(_NAME, "get_commit_status()", "dsec does not push sandboxes to image registries")

    # -- sessions --------------------------------------------------------

    async def create_session(self, create_session_request: Any) -> Any:
        """A persistent bash session. As ROCK's: ``env_enable=False``
        starts it with an empty environment (PATH kept: bash would give
        one), ``env`` is exported, each ``startup_source`` file is sourced
        and what they print is the response's output."""
        req = create_session_request
        if getattr(req, "session_type", "bash") != "bash":
            raise BadRequestRockError(f"unknown session type: {req!r}")
        if req.remote_user not in (None, "", "root"):
            raise UnsupportedOption(_NAME, f"remote_user={req.remote_user!r}",
                                    "dsec's sessions run as the image's user")
        if req.session in self._sessions:
            raise BadRequestRockError(f"session {req.session} already exists")
        sb = self._live()
        sh = await _guard(sb.shell(req.session), "Failed to create session")
        setup: List[str] = []
        if not req.env_enable:
            setup.append('for __v in $(compgen -e); do [ "$__v" = PATH ] || unset "$__v"; done; unset __v')
        for k, v in (req.env or {}).items():
            setup.append(f"export {k}={shlex.quote(str(v))}")
        out: List[str] = []
        try:
            if setup:
                await _guard(sh.run("\n".join(setup), timeout=60), "Failed to create session")
            for src in req.startup_source:
                o, _ = await _guard(sh.run(f"source {shlex.quote(src)}", timeout=120), "Failed to create session")
                out.append(o)
        except BaseException:
            await sh.close()
            raise
        self._sessions[req.session] = sh
        return CreateBashSessionResponse(output="".join(out).strip())

    async def close_session(self, request: Any) -> Any:
        sh = self._sessions.pop(request.session, None)
        self._dirty.discard(request.session)
        if sh is None:
            raise BadRequestRockError(f"session {request.session!r} does not exist")
        await sh.close()
        return CloseSessionResponse()

    async def _check_syntax(self, command: str) -> None:
        r = await _guard(self._live().exec(["/bin/bash", "-n"], stdin=command, timeout_s=30), "syntax check")
        if r.exit_code not in (0, 127):  # 127: no bash (the session would have failed to start)
            raise CommandRockError(f"Command {command!r} has a syntax error: {r.stderr.strip()}")

    async def _run(self, session: str, command: str, timeout: Optional[float],
                   job_notice: bool = False) -> Tuple[str, int]:
        """Run a command in a session; (output, exit code). A call cut
        short by its caller (ROLL's own asyncio.wait_for) interrupts the
        command, and the session drains what it left before its next one.

        With ``job_notice``, a command that leaves a job in the background
        ends its output with bash's interactive notice, ``[N] PID``: ROCK's
        sessions are interactive shells, and ROLL reads the PID of a
        ``nohup ... &`` from that line."""
        sh = self._sessions.get(session)
        if sh is None:
            raise BadRequestRockError(f"session {session!r} does not exist")
        await self._check_syntax(command)
        if session in self._dirty:
            try:
                await _guard(sh.run("true", timeout=10), "run in session")
            except (CommandTimeout, BadRequestRockError):  # still running what timed out (Conflict)
                await _guard(sh.recover(), "run in session")
            self._dirty.discard(session)
        run = command
        if job_notice:
            run = (f"__rock_bg=${{!:-}}\n{command}\n__rock_rc=$?; if [ \"${{!:-}}\" != \"$__rock_bg\" ]; then "
                   f"printf '\\n[%s] %s\\n' \"$(jobs -p | wc -l)\" \"$!\"; fi; (exit $__rock_rc)")
        try:
            return await _guard(sh.run(run, timeout=timeout), "run in session")
        except CommandTimeout as e:
            self._dirty.add(session)  # a command that ignored the interrupt is ended before the next
            raise CommandTimeout(f"Command execution failed due to timeout: '{command}' in {timeout} seconds") from e
        except asyncio.CancelledError:
            self._dirty.add(session)
            await sh.interrupt()
            raise

    async def run_in_session(self, action: Any) -> Any:
        """Run ``action.command`` in ``action.session``: ``check`` "raise"
        (the default) raises CommandRockError on a non-zero exit, "silent"
        returns the exit code, "ignore" returns ``exit_code=None``. The
        output is stripped, as ROCK's is. A timeout raises CommandTimeout."""
        if getattr(action, "action_type", "bash") != "bash":
            raise BadRequestRockError(f"unknown action type: {action!r}")
        out, code = await self._run(action.session, action.command, action.timeout, job_notice=True)
        out = out.strip()
        check = getattr(action, "check", "raise")
        if check == "ignore":
            return Observation(output=out, exit_code=None)
        if check == "raise" and code != 0:
            raise CommandRockError(f"Command {action.command!r} failed with exit code {code}. "
                                   f"Here is the output:\n{out!r}")
        return Observation(output=out, exit_code=code)

    async def arun(self, cmd: str, session: Optional[str] = None, wait_timeout: float = 300,
                   wait_interval: float = 10, mode: Any = "normal",
                   response_limited_bytes_in_nohup: Optional[int] = None, ignore_output: bool = False,
                   output_file: Optional[str] = None) -> Any:
        """ROCK's arun. "normal" runs ``cmd`` in ``session`` (a fresh one,
        closed afterwards, when None) as run_in_session with ``check``
        "raise". "nohup" starts it in the background with its output in a
        file (``output_file`` or a temporary one), waits up to
        ``wait_timeout`` for it and returns the file's content (its first
        ``response_limited_bytes_in_nohup`` bytes; with ``ignore_output`` a
        note naming the file instead): exit code 0 when the process ended,
        1 when it did not in time, as ROCK's."""
        mode = _enum_value(mode)
        if mode not in ("normal", "nohup"):
            raise InvalidParameterRockException(f"Unsupported arun mode: {mode}")
        temp = session is None
        if temp:
            session = f"bash-{time.time_ns()}"
            await self.create_session(CreateBashSessionRequest(session=session))
        try:
            if mode == "normal":
                return await self.run_in_session(BashAction(command=cmd, session=session))
            return await self._nohup(cmd, session, wait_timeout, wait_interval, response_limited_bytes_in_nohup,
                                     ignore_output, output_file)
        finally:
            if temp and session in self._sessions:
                try:
                    await self.close_session(CloseBashSessionRequest(session=session))
                except Exception:  # noqa: BLE001 - a temporary session on a sandbox that may be gone
                    pass

    async def _nohup(self, cmd: str, session: str, wait_timeout: float, wait_interval: float,
                     limit: Optional[int], ignore_output: bool, output_file: Optional[str]) -> Any:
        if output_file:
            d, name = os.path.split(output_file)
            if "." not in name:
                raise BadRequestRockError(f"Failed parse output file path: {output_file}")
            out, code = await self._run(session, f"mkdir -p {shlex.quote(d or '.')}", 60)
            if code != 0:
                raise InternalServerRockError(f"Failed mkdir for output file path: {output_file}, because {out}")
        tmp = output_file or f"/tmp/tmp_{time.time_ns()}.out"
        out, code = await self._run(session, f"nohup {cmd} < /dev/null > {shlex.quote(tmp)} 2>&1 & echo \"PID=$!\"", 30)
        m = re.search(r"PID=(\d+)", out)
        if code != 0:
            return Observation(output=out.strip(), exit_code=code, failure_reason=out.strip())
        if not m:
            msg = "Failed to submit command, nohup failed to extract PID"
            return Observation(output=msg, exit_code=1, failure_reason=msg)
        done, message = await self._wait_pid(int(m.group(1)), wait_timeout, wait_interval)
        if ignore_output:
            size = ""
            try:
                st = await self._live().stat(tmp)
                size = f"\nFile size: {st.size} bytes"
            except DsecError:
                pass
            note = (f"Command executed in nohup mode without streaming the log content.\n"
                    f"Status: {'completed' if done else 'finished with errors'}\nOutput file: {tmp}{size}\n"
                    f"Use Sandbox.read_file(...) or run 'cat {tmp}' inside the session to inspect the result.\n"
                    f"Detail: {message}")
            return Observation(output=note, exit_code=0 if done else 1, failure_reason="" if done else message)
        try:
            data = await self._live().read_file(tmp, max_bytes=limit or None)
        except NotFound:
            data = b""
        except DsecError as e:
            raise _rock_error(e, "read nohup output") from e
        text = data.decode("utf-8", errors="replace")
        return Observation(output=text, exit_code=0 if done else 1, failure_reason="" if done else message)

    async def _wait_pid(self, pid: int, wait_timeout: float, wait_interval: float) -> Tuple[bool, str]:
        """Wait until process ``pid`` ends. It is checked every half second
        at most (ROCK's wait_interval, at least 5 s there, only spaces its
        checks)."""
        sb = self._live()
        loop = asyncio.get_running_loop()
        start = loop.time()
        step = min(max(float(wait_interval), 0.1), 0.5)
        while True:
            r = await _guard(sb.exec(["sh", "-c", f"kill -0 {int(pid)}"], timeout_s=30), "wait for process")
            elapsed = loop.time() - start
            if r.exit_code != 0:
                return True, f"Process completed successfully in {elapsed:.1f}s"
            if elapsed >= wait_timeout:
                return False, f"Process {pid} did not complete within {elapsed:.1f}s (timeout: {wait_timeout}s)"
            await asyncio.sleep(min(step, max(wait_timeout - elapsed, 0.01)))

    async def run_nohup_and_wait(self, cmd: str, redirect_file_path: str = "/dev/null", wait_timeout: int = 300,
                                 wait_interval: int = 10) -> Any:
        """ROCK's deprecated helper: run ``cmd`` in the background in a fresh
        session and wait for it."""
        session = f"bash-{time.time_ns()}"
        await self.create_session(CreateBashSessionRequest(session=session))
        try:
            out, code = await self._run(
                session, f"nohup {cmd} < /dev/null > {shlex.quote(redirect_file_path)} 2>&1 & echo \"PID=$!\"", 30)
            m = re.search(r"PID=(\d+)", out)
            if code != 0 or not m:
                return ExecuteBashSessionResponse(success=False, message=f"Failed to extract PID from output: {out}")
            ok, message = await self._wait_pid(int(m.group(1)), wait_timeout, wait_interval)
            return ExecuteBashSessionResponse(success=ok, message=message)
        finally:
            await self.close_session(CloseBashSessionRequest(session=session))

    # -- commands and files ----------------------------------------------

    async def execute(self, command: Any) -> Any:
        """A command outside any session, as ROCK's server runs it
        (``subprocess.run`` without a shell: a list is the argv, a string
        names one program; ``env`` is added to the environment). A timeout
        raises CommandTimeout."""
        argv = [command.command] if isinstance(command.command, str) else list(command.command)
        r = await _guard(self._live().exec(argv, timeout_s=command.timeout, env=command.env, cwd=command.cwd),
                         "Failed to execute command")
        if r.timed_out:
            raise CommandTimeout(f"Timeout ({command.timeout}s) exceeded while running command {argv!r}")
        return CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)

    async def read_file(self, request: Any) -> Any:
        """A file's text (``encoding``/``errors`` as Path.read_text); a
        missing file raises FileNotFoundError."""
        try:
            data = await self._live().read_file(request.path)
        except NotFound as e:
            if "sandbox" in str(e):
                raise SandboxTerminated(f"Failed to read file {request.path}: {e}") from e
            raise FileNotFoundError(request.path) from e
        except DsecError as e:
            raise _rock_error(e, f"Failed to read file {request.path}") from e
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def read_file_by_line_range(self, file_path: str, start_line: Optional[int] = None,
                                      end_line: Optional[int] = None, lines_per_request: int = 1000,
                                      session: Optional[str] = None) -> Any:
        """Lines ``start_line``..``end_line`` (1-based, inclusive) of a file."""
        start = 1 if start_line is None else start_line
        if start < 1:
            raise Exception(f"start_line({start}) must be positive")
        if end_line is not None and end_line < start:
            raise Exception(f"end_line({end_line}) must be greater than start_line({start})")
        if lines_per_request < 1 or lines_per_request > 10000:
            raise Exception(f"lines_per_request({lines_per_request}) must be between 1 and 10000")
        text = (await self.read_file(ReadFileRequest(path=file_path))).content
        lines = text.splitlines(keepends=True)
        return ReadFileResponse(content="".join(lines[start - 1:end_line]))

    async def write_file(self, request: Any) -> Any:
        return await self.write_file_by_path(request.content, request.path)

    async def write_file_by_path(self, content: str, path: str) -> Any:
        """Write a file (parents made). A refused write is a response with
        ``success=False``, as ROCK's; a dead sandbox raises."""
        try:
            await self._live().write_file(path, content)
        except DsecError as e:
            return _refused(e, WriteFileResponse, f"Failed to write file {path}")
        return WriteFileResponse(success=True, message=f"Successfully write content to file {path}")

    async def upload(self, request: Any) -> Any:
        return await self.upload_by_path(request.source_path, request.target_path,
                                         getattr(request, "upload_mode", UploadMode.AUTO))

    async def upload_by_path(self, file_path: Union[str, "os.PathLike[str]"], target_path: str,
                             upload_mode: Any = UploadMode.AUTO) -> Any:
        """Copy a local file (or directory tree) to ``target_path``. Every
        ``upload_mode`` streams it straight to the sandbox (dsec has no OSS
        detour, and any size goes directly). A missing file is a response
        with ``success=False``, as ROCK's; a dead sandbox raises."""
        if _enum_value(upload_mode) not in ("auto", "oss", "direct"):
            raise BadRequestRockError(f"unknown upload_mode {upload_mode!r}")
        src = os.fspath(file_path)
        name = os.path.basename(src.rstrip("/"))
        if not os.path.exists(src):
            return UploadResponse(success=False, message=f"File not found: {src}")
        sb = self._live()
        try:
            if os.path.isdir(src):
                await upload_dir(sb, src, target_path)
            else:
                await sb.upload(src, target_path)
        except DsecError as e:
            return _refused(e, UploadResponse, f"Failed to upload file {name}")
        return UploadResponse(success=True, message=f"Successfully uploaded file {name} to {target_path}",
                              file_name=os.path.basename(target_path))


#: the name dsec's docs use; ``Sandbox`` is the one ROCK's callers import
DsecRockSandbox = Sandbox

__all__ = ["Sandbox", "DsecRockSandbox", "Network", "SandboxTerminated", "CommandTimeout", "ROCK", "SandboxConfig",
           "SpeedupType", "Action", "BashAction", "BashObservation", "Observation", "CloseBashSessionRequest",
           "CloseBashSessionResponse", "CloseSessionRequest", "CloseSessionResponse", "CloseResponse", "Command",
           "CommandResponse", "CreateBashSessionRequest", "CreateBashSessionResponse", "ExecuteBashSessionResponse",
           "IsAliveResponse", "ReadFileRequest", "ReadFileResponse", "SandboxStatusResponse", "UploadMode",
           "UploadRequest", "UploadResponse", "WriteFileRequest", "WriteFileResponse", "RockException",
           "BadRequestRockError", "SandboxNotFoundRockError", "InternalServerRockError", "CommandRockError",
           "InvalidParameterRockException", "codes"]
