"""Trainer sessions: a lease the trainer heartbeats from a background
thread. If the trainer dies, the server pauses (or deletes) the session's
sandboxes after the grace period; reopening the session resumes them."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from .errors import DsecError

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

_SESSION = "dsec.v1.SessionService"


class Session:
    """An open session. As a context manager it heartbeats until exit, then
    closes the session, deleting its sandboxes (``delete_on_close``)."""

    def __init__(self, client: "Client", name: str, *, heartbeat_s: float = 5, grace_s: Optional[float] = None,
                 on_expire: str = "pause", delete_on_close: bool = True) -> None:
        self._client = client
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.delete_on_close = delete_on_close
        req: Dict[str, Any] = {"name": name, "heartbeatS": str(max(1, int(heartbeat_s))), "onExpire": on_expire}
        if grace_s:
            req["graceS"] = str(int(grace_s))
        info = client._t.unary(_SESSION, "OpenSession", req, retry=True)
        self.state = info.get("state", "")
        #: sandboxes resumed because this open revived an expired session
        self.resumed = int(info.get("resumed") or 0)
        self.last_error: Optional[DsecError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"dsec-session-{name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                info = self._client._t.unary(_SESSION, "Heartbeat", {"name": self.name}, retry=True)
                self.state = info.get("state", self.state)
                self.last_error = None
            except DsecError as e:  # keep beating: the server may come back
                self.last_error = e

    def heartbeat(self) -> None:
        """Heartbeat now (the background thread does it on its own)."""
        self._client._t.unary(_SESSION, "Heartbeat", {"name": self.name}, retry=True)

    def stop_heartbeats(self) -> None:
        """Stop the background heartbeats without closing (as a crash would)."""
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5)

    def set_model_upstreams(self, upstreams: Sequence[Mapping[str, Any]], **limits: int) -> Dict[str, Any]:
        """Replace the session's model upstreams: where the model gateway of
        its sandboxes (``create(..., model_gateway=True)``) sends their
        agents' model calls, before the project's own
        (:meth:`Client.set_model_upstreams`). Each upstream is a dict with
        ``name``, ``base_url`` (e.g. ``"http://10.0.0.5:8000/v1"``), and
        optionally ``api`` ("openai" or "anthropic"), ``api_key`` (kept on
        the server, never in a sandbox), ``models`` (the model names it
        serves; none: it takes every model no other lists), ``timeout_s``
        and ``idle_timeout_s``. Limits (per node): ``max_concurrent``,
        ``tokens_per_minute``, ``token_budget``, ``per_sandbox_concurrent``.
        Returns the registration, without keys."""
        return set_model_upstreams(self._client, self.name, upstreams, **limits)

    def model_upstreams(self) -> Dict[str, Any]:
        """The session's model upstreams (``hasApiKey`` says whether a key
        is set; keys are never returned)."""
        return self._client._t.unary(_SESSION, "GetModelUpstreams", {"session": self.name}, retry=True)

    def close(self, delete_sandboxes: Optional[bool] = None) -> None:
        self.stop_heartbeats()
        delete = self.delete_on_close if delete_sandboxes is None else delete_sandboxes
        self._client._t.unary(_SESSION, "CloseSession", {"name": self.name, "deleteSandboxes": delete}, retry=True)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.name!r}, state={self.state!r})"


def set_model_upstreams(client: "Client", session: str, upstreams: Sequence[Mapping[str, Any]], *,
                        max_concurrent: int = 0, tokens_per_minute: int = 0, token_budget: int = 0,
                        per_sandbox_concurrent: int = 0) -> Dict[str, Any]:
    """SetModelUpstreams for a session ("" for the project's own)."""
    ups = []
    for u in upstreams:
        w: Dict[str, Any] = {"name": u["name"], "baseUrl": u["base_url"]}
        for k, wk in (("api", "api"), ("api_key", "apiKey"), ("timeout_s", "timeoutS"), ("idle_timeout_s", "idleTimeoutS")):
            if u.get(k):
                w[wk] = u[k]
        if u.get("models"):
            w["models"] = [str(m) for m in u["models"]]
        ups.append(w)
    limits: Dict[str, Any] = {}
    if max_concurrent:
        limits["maxConcurrent"] = int(max_concurrent)
    if tokens_per_minute:
        limits["tokensPerMinute"] = str(int(tokens_per_minute))
    if token_budget:
        limits["tokenBudget"] = str(int(token_budget))
    if per_sandbox_concurrent:
        limits["perSandboxConcurrent"] = int(per_sandbox_concurrent)
    req: Dict[str, Any] = {"session": session, "upstreams": ups}
    if limits:
        req["limits"] = limits
    return client._t.unary(_SESSION, "SetModelUpstreams", req, retry=True)
