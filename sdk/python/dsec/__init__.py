"""dsec: sandboxes for training and evaluating AI agents.

    import dsec
    client = dsec.Client()                      # $DSEC_URL, $DSEC_API_KEY
    with client.create(image="debian", ttl_s=600, labels={"job": "demo"}) as sb:
        r = sb.exec("python3 -c 'print(6*7)'")
        print(r.exit_code, r.stdout)

Standard library only. Every error is a :class:`DsecError` with ``.infra``
(mask the rollout) and ``.retryable``.
"""

from .client import (Client, ExecEvent, ExecResult, FileInfo, Sandbox, SandboxInfo, SnapshotInfo, Stats, StatsSample,
                     quote, request_id)
from .session import Session
from .rollout import Rollout
from .events import Event, EventStream, Webhook, verify_signature
from .runkeys import RunKeys
from .aio import AsyncClient, AsyncSandbox
from .functions import Checker, RunCodeResult
from .network import ConnectionRecord, Credential, Network, NetworkLog, NetworkPolicy
from .volumes import Volume, VolumeFileInfo
from .build import DockerIgnore
from .errors import (
    Conflict,
    ConnectionFailed,
    DeadlineExceeded,
    DsecError,
    Exhausted,
    Internal,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    SandboxGone,
    Throttled,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Rollout",
    "AsyncClient",
    "AsyncSandbox",
    "RunCodeResult",
    "Checker",
    "NetworkPolicy",
    "Volume",
    "VolumeFileInfo",
    "DockerIgnore",
    "Credential",
    "Network",
    "NetworkLog",
    "ConnectionRecord",
    "Sandbox",
    "SandboxInfo",
    "ExecResult",
    "ExecEvent",
    "Stats",
    "StatsSample",
    "Event",
    "EventStream",
    "Webhook",
    "verify_signature",
    "FileInfo",
    "quote",
    "request_id",
    "RunKeys",
    "Session",
    "SnapshotInfo",
    "DsecError",
    "InvalidRequest",
    "NotFound",
    "Conflict",
    "Exhausted",
    "Throttled",
    "Unavailable",
    "ConnectionFailed",
    "SandboxGone",
    "Unauthenticated",
    "PermissionDenied",
    "Unimplemented",
    "DeadlineExceeded",
    "Internal",
]
