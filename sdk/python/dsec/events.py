"""Sandbox lifecycle events: a subscription instead of polling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _wire

_EVENTS = "dsec.v1.EventService"


@dataclass
class Event:
    """One change of a sandbox's life. ``type`` is created, paused,
    resumed, snapshotted, forked or ended; or ``dropped``: the subscriber
    fell behind and lost ``dropped`` events (0: an unknown number, a node's
    stream broke). An ended event says why (``reason``), its class
    (``cause``: deleted, session_expired, ttl, idle_ttl, paused_ttl, workload_exit, oom, died,
    pause_failed, node_down) and whether the platform ended it
    (``infra``). Paused and ended events carry ``run``: the run that
    stopped (``startedAt``, ``cpu``, ``memoryMb``, ``durationMs``)."""

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
    run: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "Event":
        return cls(type=m.get("type", ""), sandbox_id=m.get("sandboxId", ""), node=m.get("node", ""),
                   project=m.get("project", ""), kind=m.get("kind", ""), labels=dict(m.get("labels") or {}),
                   at=m.get("at", ""), state=m.get("state", ""), reason=m.get("reason", ""),
                   cause=m.get("cause", ""), infra=bool(m.get("infra", False)),
                   snapshot_id=m.get("snapshotId", ""), children=list(m.get("children") or []),
                   run=dict(m.get("run") or {}),
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


_WEBHOOKS = "dsec.v1.WebhookService"


@dataclass
class Webhook:
    """A URL registered to receive lifecycle events as signed POSTs (its
    secret is never shown again). ``format`` is "dsec" (the event's JSON,
    signed in ``Dsec-Signature``) or "e2b" (registered through E2B's API)."""

    id: str
    url: str
    project: str = ""
    name: str = ""
    enabled: bool = True
    label_selector: str = ""
    types: List[str] = field(default_factory=list)
    created_at: str = ""
    format: str = "dsec"

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "Webhook":
        return cls(id=m.get("id", ""), url=m.get("url", ""), project=m.get("project", ""), name=m.get("name", ""),
                   enabled=bool(m.get("enabled", False)), label_selector=m.get("labelSelector", ""),
                   types=list(m.get("types") or []), created_at=m.get("createdAt", ""), format=m.get("format", ""))


def verify_signature(secret: Union[str, bytes], headers: Mapping[str, str], body: bytes,
                     max_age_s: float = 300.0) -> bool:
    """Whether a delivery to your webhook came from dsec: ``headers`` and
    ``body`` are the request's (the raw bytes, before any JSON parsing).
    The signature is the hex HMAC-SHA256, keyed with the secret, of
    "<Dsec-Timestamp>.<body>"; a delivery older than ``max_age_s`` is
    refused (a replay)."""
    import hashlib
    import hmac
    import time

    low = {k.lower(): v for k, v in headers.items()}
    ts, sig = low.get("dsec-timestamp", ""), low.get("dsec-signature", "")
    if not ts.isdigit() or not sig.startswith("sha256="):
        return False
    if abs(time.time() - int(ts)) > max_age_s:
        return False
    key = secret.encode() if isinstance(secret, str) else secret
    want = hmac.new(key, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(sig[len("sha256="):], want)


def create_webhook(t: _wire.Transport, url: str, secret: str, name: Optional[str],
                   labels: Optional[Mapping[str, str]], selector: Optional[str],
                   types: Optional[Sequence[str]], enabled: bool) -> Webhook:
    parts = [f"{k}={v}" for k, v in (labels or {}).items()]
    if selector:
        parts.append(selector)
    req: Dict[str, Any] = {"url": url, "secret": secret, "labelSelector": ",".join(parts), "disabled": not enabled}
    if name:
        req["name"] = name
    if types:
        req["types"] = list(types)
    return Webhook._from(t.unary(_WEBHOOKS, "CreateWebhook", req))


def list_webhooks(t: _wire.Transport) -> List[Webhook]:
    return [Webhook._from(w) for w in t.unary(_WEBHOOKS, "ListWebhooks", {}).get("webhooks", [])]


def enable_webhook(t: _wire.Transport, webhook_id: str, enabled: bool) -> Webhook:
    return Webhook._from(t.unary(_WEBHOOKS, "UpdateWebhook", {"id": webhook_id, "enabled": enabled}))


def delete_webhook(t: _wire.Transport, webhook_id: str) -> None:
    t.unary(_WEBHOOKS, "DeleteWebhook", {"id": webhook_id})
