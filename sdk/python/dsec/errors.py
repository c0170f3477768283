"""Typed errors mirroring the server's error classes.

Every error has ``infra`` (the platform failed: mask the rollout instead of
scoring it) and ``retryable`` (repeating the call may succeed).
"""

from __future__ import annotations

from typing import Optional


class DsecError(Exception):
    """Base class of every error the SDK raises for a server answer."""

    kind = "unknown"
    #: flags an error of this class has unless the server said otherwise
    default_infra = False
    default_retryable = False

    def __init__(
        self,
        message: str,
        *,
        kind: Optional[str] = None,
        infra: Optional[bool] = None,
        retryable: Optional[bool] = None,
        retry_after_s: Optional[float] = None,
        status: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if kind:
            self.kind = kind
        self.infra = self.default_infra if infra is None else infra
        self.retryable = self.default_retryable if retryable is None else retryable
        self.retry_after_s = retry_after_s
        self.status = status

    def __str__(self) -> str:
        flags = ", infra" if self.infra else ""
        return f"{self.message} ({self.kind}{flags})"


class InvalidRequest(DsecError):
    """The request was malformed or out of range. Do not retry."""

    kind = "invalid"


class NotFound(DsecError):
    """The sandbox, image, file or process does not exist."""

    kind = "not_found"


class Conflict(DsecError):
    kind = "conflict"


class Exhausted(DsecError):
    """No capacity or quota right now; retry after ``retry_after_s``."""

    kind = "exhausted"
    default_infra = True
    default_retryable = True


Throttled = Exhausted


class Unavailable(DsecError):
    """A platform component could not serve the call (infra)."""

    kind = "unavailable"
    default_infra = True
    default_retryable = True


class SandboxGone(DsecError):
    """The sandbox died, expired or was evicted (infra). It is never
    silently re-created: mask the rollout or start a new one."""

    kind = "gone"
    default_infra = True


class Unauthenticated(DsecError):
    kind = "unauthenticated"


class PermissionDenied(DsecError):
    kind = "permission_denied"


class Unimplemented(DsecError):
    """The substrate or server does not support this call."""

    kind = "unimplemented"


class DeadlineExceeded(DsecError):
    kind = "deadline_exceeded"


class Internal(DsecError):
    kind = "internal"
    default_infra = True


class ConnectionFailed(Unavailable):
    """The server could not be reached (infra, retryable for idempotent
    calls)."""

    kind = "unavailable"


_BY_KIND = {
    c.kind: c
    for c in (
        InvalidRequest,
        NotFound,
        Conflict,
        Exhausted,
        Unavailable,
        SandboxGone,
        Unauthenticated,
        PermissionDenied,
        Unimplemented,
        DeadlineExceeded,
        Internal,
    )
}

# Connect codes, for errors that carry no dsec detail (a proxy's answer).
_BY_CODE = {
    "invalid_argument": InvalidRequest,
    "not_found": NotFound,
    "already_exists": Conflict,
    "resource_exhausted": Exhausted,
    "unavailable": Unavailable,
    "failed_precondition": SandboxGone,
    "unauthenticated": Unauthenticated,
    "permission_denied": PermissionDenied,
    "unimplemented": Unimplemented,
    "deadline_exceeded": DeadlineExceeded,
    "internal": Internal,
}

def make_error(
    kind: str,
    message: str,
    *,
    code: Optional[str] = None,
    infra: Optional[bool] = None,
    retryable: Optional[bool] = None,
    retry_after_s: Optional[float] = None,
    status: Optional[int] = None,
) -> DsecError:
    cls = _BY_KIND.get(kind) or (_BY_CODE.get(code or "") if code else None) or DsecError
    return cls(
        message,
        kind=kind or cls.kind,
        infra=infra,
        retryable=retryable,
        retry_after_s=retry_after_s,
        status=status,
    )
