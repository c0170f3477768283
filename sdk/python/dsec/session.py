"""Trainer sessions: a lease the trainer heartbeats from a background
thread. If the trainer dies, the server pauses (or deletes) the session's
sandboxes after the grace period; reopening the session resumes them."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, Optional

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
