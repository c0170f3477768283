"""Agent rollouts: an agent command that runs on in its sandbox when the
trainer that started it dies, scored by a verifier when it ends.

    r = sb.rollout("python3 agent.py", "traj-7", verifier="python3 score.py")
    for entry in r.events():          # model calls and commands as they land in the log
        ...
    r.wait()                          # the outcome: r.state, r.reward, r.result
    # a new trainer process, after a crash:
    r = client.rollout(sandbox_id, "traj-7")   # reattach; the agent never stopped
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _wire
from .errors import ConnectionFailed, DsecError

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

_LOGS = "dsec.v1.LogService"
_MAX_WAIT_S = 300
#: the server sends a keepalive every 15 s while nothing happens
_STREAM_IDLE_S = 60

#: Rollout states: the task's outcomes to score, and the platform's to mask.
RUNNING, SUCCEEDED, FAILED, INFRA, CANCELED = "running", "succeeded", "failed", "infra", "canceled"


def _command(cmd: Union[str, Sequence[str]]) -> Dict[str, Any]:
    return {"cmd": cmd} if isinstance(cmd, str) else {"argv": [str(a) for a in cmd]}


class Rollout:
    """A rollout as last read from the server."""

    def __init__(self, client: "Client", m: Mapping[str, Any]) -> None:
        self._client = client
        self._set(m)

    def _set(self, m: Mapping[str, Any]) -> None:
        self.raw: Dict[str, Any] = dict(m)
        self.sandbox_id: str = m.get("sandboxId", "")
        self.id: str = m.get("rolloutId", "")
        #: running, succeeded, failed (the task's: score it), infra (the
        #: platform's: mask it) or canceled
        self.state: str = m.get("state", "")
        self.start_seq = int(m.get("startSeq") or 0)
        self.model_calls = int(m.get("modelCalls") or 0)
        self.commands = int(m.get("commands") or 0)
        #: the agent's exit (exitCode, stdout and stderr tails, timedOut), once it ended
        self.result: Dict[str, Any] = m.get("result") or {}
        self.verifier: Dict[str, Any] = m.get("verifier") or {}
        self.reward: Optional[float] = float(m.get("reward") or 0) if m.get("hasReward") else None
        self.detail: str = m.get("detail", "")
        #: the agent's execs and file writes in its workers, and how many
        #: of them were answered from the workers' logs (a resume)
        self.worker_calls = int(m.get("workerCalls") or 0)
        self.worker_replays = int(m.get("workerReplays") or 0)
        #: where a resumed agent's worker calls went live ("": they did not)
        self.divergence: str = m.get("divergence", "")

    @property
    def done(self) -> bool:
        return self.state not in ("", RUNNING)

    @property
    def infra(self) -> bool:
        """True when the platform (or a model upstream) failed the rollout."""
        return self.state == INFRA

    def refresh(self, wait_s: float = 0) -> "Rollout":
        m = self._client._t.unary(_LOGS, "GetRollout", {"sandboxId": self.sandbox_id, "rolloutId": self.id,
                                                         "waitS": min(float(wait_s), _MAX_WAIT_S)},
                                  retry=True, timeout=min(float(wait_s), _MAX_WAIT_S) + 60)
        self._set(m)
        return self

    def wait(self, timeout_s: Optional[float] = None) -> "Rollout":
        """Wait until the rollout ended (or timeout_s passed) and return it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            left = _MAX_WAIT_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            self.refresh(min(left, _MAX_WAIT_S))
        return self

    def events(self, from_seq: Optional[int] = None) -> Iterator[Dict[str, Any]]:
        """The rollout's progress, streamed by the server as it happens:
        each entry of its sandbox's log after its start (model calls,
        commands), until it ended (then ``self`` holds its outcome). A
        stream that breaks (a replica or the network went) is opened again
        from the entry after the last one yielded; pass ``from_seq`` to
        start elsewhere (a trainer that saw entries up to seq n: n + 1)."""
        seq = int(from_seq) if from_seq else self.start_seq + 1
        t = self._client._t
        # The stream holds its connection: its own, so the trainer's calls
        # go on meanwhile.
        with contextlib.closing(_wire.Transport(t.url, t.api_key, t.timeout)) as st:
            yield from self._watch(st, seq)

    def _watch(self, st: "_wire.Transport", seq: int) -> Iterator[Dict[str, Any]]:
        failures = 0
        while True:
            try:
                for ev in st.stream(_LOGS, "WatchRollout", {"sandboxId": self.sandbox_id, "rolloutId": self.id,
                                                                         "fromSeq": str(seq)}, timeout=_STREAM_IDLE_S):
                    failures = 0
                    if "rollout" in ev:
                        self._set(ev["rollout"])
                        if self.done:
                            return
                    elif "entry" in ev:
                        e = ev["entry"]
                        seq = int(e.get("seq") or seq) + 1
                        if e.get("op") not in ("rollout_start", "rollout_end"):
                            yield e
                # A stream that ended without the rollout's end (its
                # server stopped): watch again, as after a break.
                raise ConnectionFailed("the rollout's stream ended before the rollout")
            except DsecError as e:
                if not e.retryable or failures >= 5:
                    raise
                failures += 1
                time.sleep(0.2 * 2 ** failures)

    def __repr__(self) -> str:
        return f"Rollout({self.sandbox_id!r}, {self.id!r}, state={self.state!r}, reward={self.reward!r})"


def start(client: "Client", sandbox_id: str, rollout_id: str, cmd: Union[str, Sequence[str]], *,
          env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
          timeout_s: Optional[float] = None, verifier: Union[str, Sequence[str], None] = None,
          verifier_timeout_s: Optional[float] = None, workers: Optional[Sequence[Any]] = None) -> Rollout:
    from .client import _exec_request  # the same fields as an exec's

    req = _exec_request(sandbox_id, cmd, timeout_s=timeout_s, stdin=None, env=env, cwd=cwd, user=user, max_output_bytes=None)
    req["rolloutId"] = rollout_id
    if workers:
        req["workers"] = [w if isinstance(w, str) else w.id for w in workers]
    if verifier is not None:
        req["verifier"] = _command(verifier)
        if verifier_timeout_s:
            req["verifier"]["timeoutS"] = float(verifier_timeout_s)
    return Rollout(client, client._t.unary(_LOGS, "StartRollout", req, retry=True))


def get(client: "Client", sandbox_id: str, rollout_id: str) -> Rollout:
    return Rollout(client, client._t.unary(_LOGS, "GetRollout", {"sandboxId": sandbox_id, "rolloutId": rollout_id}, retry=True))
