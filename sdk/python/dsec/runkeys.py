"""Idempotency keys and request IDs for one run of a trainer.

A key must name the run *instance*, not only the run's name: a fresh run that
reused the keys of an earlier run of the same name would adopt that run's
sandboxes (deleted by then: ``NotFound: sandbox ... was deleted``) and be
answered from its trajectory logs. :class:`RunKeys` derives every key from
(name, nonce). :meth:`RunKeys.start` draws a new nonce and records it as the
first line of the run's journal; only :meth:`RunKeys.resume` reads it back,
so the one way to get an earlier run's keys is to ask to resume it.

    keys = dsec.RunKeys.resume(name, journal) if resuming else dsec.RunKeys.start(name, journal)
    sb = client.create(image="debian", idempotency_key=keys.key("task-3", "base"), labels=keys.labels)
    sb.exec(cmd, request_id=keys.request_id("task-3/rollout-0", turn))
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any, Dict

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class RunKeys:
    """The keys of one run instance: ``name`` (chosen by the user, the same
    across a resume) and ``nonce`` (random per fresh start)."""

    def __init__(self, name: str, nonce: str) -> None:
        if not _NAME.match(name):
            raise ValueError(f"run name {name!r}: letters, digits, '_', '.', '-', at most 63")
        if not re.fullmatch(r"[0-9a-f]{8,32}", nonce):
            raise ValueError(f"run nonce {nonce!r}: 8 to 32 lowercase hex digits")
        self.name, self.nonce = name, nonce

    @classmethod
    def start(cls, name: str, journal: str) -> "RunKeys":
        """A fresh run: a new nonce, written (and synced) as the journal's
        first line. An existing journal is replaced."""
        keys = cls(name, secrets.token_hex(6))
        tmp = journal + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"t": "run", "run": name, "nonce": keys.nonce}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, journal)
        return keys

    @classmethod
    def resume(cls, name: str, journal: str) -> "RunKeys":
        """The keys of the run whose journal this is. Raises FileNotFoundError
        without a journal and ValueError for another run's journal."""
        with open(journal) as f:
            first = f.readline()
        try:
            head = json.loads(first)
        except ValueError:
            head = {}
        if not isinstance(head, dict) or head.get("t") != "run":
            raise ValueError(f"{journal} does not start with a run header: not a journal RunKeys.start wrote")
        if head.get("run") != name:
            raise ValueError(f"{journal} is the journal of run {head.get('run')!r}, not {name!r}")
        return cls(name, str(head.get("nonce")))

    @property
    def prefix(self) -> str:
        return f"{self.name}/{self.nonce}"

    def key(self, *parts: Any) -> str:
        """An idempotency key (create, fork) for this run instance."""
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def request_id(self, trajectory: Any, step: Any, *parts: Any) -> str:
        """A request ID for a call of this run instance: the same on a
        resume, different in any other run."""
        return self.key(trajectory, step, *parts)

    @property
    def session(self) -> str:
        """A session name for this run instance."""
        return f"{self.name}-{self.nonce}"[:63]

    @property
    def labels(self) -> Dict[str, str]:
        """Labels that find this run instance's sandboxes."""
        return {"run": self.name, "run-nonce": self.nonce}

    def __repr__(self) -> str:
        return f"RunKeys({self.name!r}, {self.nonce!r})"


__all__ = ["RunKeys"]
