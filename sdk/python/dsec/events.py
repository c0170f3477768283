"""Sandbox lifecycle events: a subscription instead of polling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

from . import _wire

_EVENTS = "dsec.v1.EventService"


@dataclass
class Event:
    """One change of a sandbox's life. ``type`` is created, paused,
    resumed, snapshotted, forked or ended; or ``dropped``: the subscriber
    fell behind and lost ``dropped`` events (0: an unknown number, a node's
    stream broke). An ended event says why (``reason``), its class
    (``cause``: deleted, ttl, idle_ttl, paused_ttl, workload_exit, oom, died,
    pause_failed, node_down) and whether the platform ended it
    (``infra``)."""

    type: str
    sandbox_id: str = ""
    node: str = ""
    project: str = ""
    kind: str = ""
    labels: Dict[str, str] = field(default_factory=dict)
    at: str = ""
    state: str = ""
    reason: str = ""
    cause: str = ""
    infra: bool = False
    snapshot_id: str = ""
    children: List[str] = field(default_factory=list)
    dropped: int = 0

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "Event":
        return cls(type=m.get("type", ""), sandbox_id=m.get("sandboxId", ""), node=m.get("node", ""),
                   project=m.get("project", ""), kind=m.get("kind", ""), labels=dict(m.get("labels") or {}),
                   at=m.get("at", ""), state=m.get("state", ""), reason=m.get("reason", ""),
                   cause=m.get("cause", ""), infra=bool(m.get("infra", False)),
                   snapshot_id=m.get("snapshotId", ""), children=list(m.get("children") or []),
                   dropped=int(m.get("dropped", 0) or 0))


class EventStream:
    """A subscription to lifecycle events (Client.events). Iterate it for
    events, heartbeats skipped; ``close()`` (or leaving a ``with`` block)
    ends it. It has a connection of its own: the client's other calls go on
    beside it, from any thread."""

    def __init__(self, transport: _wire.Transport, req: Dict[str, Any]) -> None:
        self._t = transport
        # A socket read waits at most a minute: the server sends a
        # heartbeat after every 15 s of silence.
        self._gen: Iterator[Dict[str, Any]] = transport.stream(_EVENTS, "Subscribe", req, timeout=60)
        try:
            next(self._gen)  # the first event: a heartbeat once the subscription is in place
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        for m in self._gen:
            if m.get("type") != "heartbeat":
                return Event._from(m)
        raise StopIteration

    def close(self) -> None:
        self._gen.close()
        self._t.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def subscribe(t: _wire.Transport, labels: Optional[Mapping[str, str]], selector: Optional[str],
              types: Optional[Sequence[str]], project: Optional[str]) -> EventStream:
    parts = [f"{k}={v}" for k, v in (labels or {}).items()]
    if selector:
        parts.append(selector)
    req: Dict[str, Any] = {"labelSelector": ",".join(parts)}
    if types:
        req["types"] = list(types)
    if project:
        req["project"] = project
    return EventStream(_wire.Transport(t.url, t.api_key, t.timeout), req)
