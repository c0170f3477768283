"""Egress policies, brokered credentials and the connection log
(api/dsec/v1/sandbox.proto: NetworkPolicy, GetNetworkLog)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union


def _int(v: Any) -> int:
    return int(v) if v not in (None, "") else 0


@dataclass
class Credential:
    """A brokered credential: ``name`` (one of the server's configured
    credentials), or ``host``, ``header`` (default "Authorization") and
    ``value``. The node's egress proxy sets the header on the sandbox's
    plain-HTTP requests to ``http://<host>/...`` and sends them on over
    TLS; the value never enters the sandbox and no answer carries it (it
    reads back as "")."""

    name: str = ""
    host: str = ""
    header: str = ""
    value: str = field(default="", repr=False)

    def _wire(self) -> Dict[str, Any]:
        out = {}
        for k in ("name", "host", "header", "value"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        return out

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "Credential":
        return cls(name=m.get("name", ""), host=m.get("host", ""), header=m.get("header", ""), value=m.get("value", ""))


@dataclass
class NetworkPolicy:
    """An egress sandbox's policy: what no rule allows is denied, and the
    most specific rule decides. ``allow`` and ``deny`` list destinations:
    IPv4 addresses or CIDRs ("203.0.113.7", "151.101.0.0/16"), host names
    ("pypi.org"), wildcards ("*.pypi.org": every name below it; "*": every
    name). ``NetworkPolicy()`` denies everything. Whatever it says, a
    sandbox never reaches other sandboxes, the host, loopback or
    link-local (metadata) addresses."""

    allow: List[str] = field(default_factory=list)
    deny: List[str] = field(default_factory=list)
    credentials: List[Credential] = field(default_factory=list)

    def _wire(self) -> Dict[str, Any]:
        rules = [{"action": "allow", "destination": d} for d in self.allow]
        rules += [{"action": "deny", "destination": d} for d in self.deny]
        out: Dict[str, Any] = {"rules": rules}
        if self.credentials:
            out["credentials"] = [c._wire() for c in self.credentials]
        return out

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "NetworkPolicy":
        p = cls()
        for r in m.get("rules") or []:
            (p.allow if r.get("action") == "allow" else p.deny).append(r.get("destination", ""))
        p.credentials = [Credential._from(c) for c in m.get("credentials") or []]
        return p


PolicyLike = Union[NetworkPolicy, Mapping[str, Any]]


def policy_wire(p: PolicyLike) -> Dict[str, Any]:
    """A policy as the API takes it, from a NetworkPolicy or a dict with
    the same keys (``{"allow": [...], "deny": [...], "credentials":
    [{"name": ...}]}``)."""
    if isinstance(p, NetworkPolicy):
        return p._wire()
    unknown = set(p) - {"allow", "deny", "credentials"}
    if unknown:
        raise ValueError(f"network policy: unknown keys {sorted(unknown)} (allow, deny, credentials)")
    creds = [c if isinstance(c, Credential) else Credential(**c) for c in p.get("credentials") or []]
    return NetworkPolicy(allow=list(p.get("allow") or []), deny=list(p.get("deny") or []), credentials=creds)._wire()


@dataclass
class Network:
    """A sandbox's network as it now is: ``mode`` ("none" or "egress") and
    ``policy`` (None: unrestricted egress)."""

    mode: str
    policy: Optional[NetworkPolicy] = None

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "Network":
        p = m.get("policy")
        return cls(mode=m.get("mode", "") or "none", policy=NetworkPolicy._from(p) if p is not None else None)


@dataclass
class ConnectionRecord:
    """One connection the sandbox opened. ``protocol`` is "tcp", "udp",
    "icmp", "dns" (a query), "http" or "tls" (through the egress proxy);
    ``host`` the name (the query's, the HTTP Host, the TLS SNI);
    ``verdict`` "allow" or "deny"; ``reason`` what decided ("allow
    *.pypi.org", "pinned: files.pythonhosted.org", "no rule", "link-local",
    ...)."""

    seq: int
    at: str
    protocol: str
    address: str
    port: int
    host: str
    verdict: str
    reason: str
    brokered: bool = False

    @property
    def allowed(self) -> bool:
        return self.verdict == "allow"

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "ConnectionRecord":
        return cls(seq=_int(m.get("seq")), at=m.get("at", ""), protocol=m.get("protocol", ""), address=m.get("address", ""),
                   port=_int(m.get("port")), host=m.get("host", ""), verdict=m.get("verdict", ""),
                   reason=m.get("reason", ""), brokered=bool(m.get("brokered")))


@dataclass
class NetworkLog:
    """A page of the connection log, oldest first; ``dropped`` counts the
    records the node did not keep (beyond the last 4096, or the rate of 200
    a second per verdict)."""

    records: List[ConnectionRecord]
    dropped: int = 0

    @property
    def next_seq(self) -> int:
        """The ``after_seq`` that reads on from here."""
        return self.records[-1].seq if self.records else 0

    @classmethod
    def _from(cls, m: Mapping[str, Any]) -> "NetworkLog":
        return cls(records=[ConnectionRecord._from(r) for r in m.get("records") or []], dropped=_int(m.get("dropped")))


__all__: Sequence[str] = ["Credential", "NetworkPolicy", "Network", "ConnectionRecord", "NetworkLog"]
