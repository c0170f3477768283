#!/usr/bin/env python3
"""A GRPO-shaped rollout loop on dsec, with a scripted policy (no model).

For each of N coding tasks (examples/tasks/: a small repo with failing
tests), one sandbox is prepared with the repo and forked into G children.
Each child runs a multi-turn episode: the policy writes completions as a
model would (a thought, then a tool call in <tool_call>{json}</tool_call>),
the loop parses the tool call out of the text, runs it in the sandbox and
feeds the output back as the next observation. The policy reads those
observations: the code it printed, the test results, a parse error when
its tool call was malformed. The reward is the fraction of tests passing
when the episode ends; advantages are computed per group with
infrastructure-failed rollouts masked. Everything is bound to one session.

    python3 examples/grpo_rollout.py --tasks 16 --group 8
    python3 examples/grpo_rollout.py --run r1 --kill-random 7   # SIGKILLs itself at a random moment
    python3 examples/grpo_rollout.py --run r1 --resume          # fast-forwards through the trajectory logs

Every call carries a request ID from dsec.RunKeys: (run, nonce, trajectory,
turn). A resumed run reads the nonce back from its journal and re-issues the
same calls, which the server answers from each sandbox's trajectory log; a
fresh run of the same name draws a new nonce, so it never adopts an earlier
run's sandboxes or answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python"))
import dsec  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TURNS = 5  # a short budget: a rollout that tries the wrong fix first, or garbles a call, may run out

TOOLS = {
    "bash": {"command": str},
    "write_file": {"path": str, "content": str},
    "submit": {},
}


def load_tasks(n: int) -> List[Dict[str, Any]]:
    root = os.path.join(HERE, "tasks")
    tasks = []
    for name in sorted(os.listdir(root))[:n]:
        with open(os.path.join(root, name, "task.json")) as f:
            meta = json.load(f)
        files = {}
        repo = os.path.join(root, name, "repo")
        for d, _, fs in os.walk(repo):
            for fn in fs:
                p = os.path.join(d, fn)
                with open(p, "rb") as f:
                    files[os.path.relpath(p, repo)] = (f.read(), os.stat(p).st_mode & 0o777)
        meta["files"] = files
        tasks.append(meta)
    return tasks


# -- the policy: text in, text out ----------------------------------------

def tool_call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def policy(task: Dict[str, Any], g: int, history: List[Tuple[str, str]]) -> str:
    """The scripted "model": given the episode so far (its own completions
    and the observations that answered them) it writes the next completion,
    a thought and a tool call. Deterministic in (task, rollout,
    observations), so a resumed run that is fed the same observations makes
    the same choices. Now and then, as a model does, it garbles the call's
    JSON; the loop answers with the parse error and it tries again."""
    thought, call = decide(task, g, history)
    rng = random.Random(hashlib.sha256(f"{task['name']}/{g}/{len(history)}".encode()).digest())
    if rng.random() < 0.12:  # a malformed call: the JSON cut short
        call = call[: call.index("{") + len(call) // 3] + "\n</tool_call>"
    if history and history[-1][1].startswith("error: "):
        thought = "That tool call did not parse; again. " + thought
    return f"<think>{thought}</think>\n{call}"


def decide(task: Dict[str, Any], g: int, history: List[Tuple[str, str]]) -> Tuple[str, str]:
    """What to do next, from the observations: read the code, run the
    tests, then try the candidate fixes in this rollout's own order
    (skipping one that matches the code it read) until the tests pass."""
    order = random.Random(hashlib.sha256(f"{task['name']}/{g}".encode()).digest()).sample(
        range(len(task["candidates"])), len(task["candidates"]))
    code, last, obs = "", "", ""
    tried: List[int] = []
    for completion, observation in history:
        call = parse_tool_call(completion)
        if not isinstance(call, dict):
            continue  # a garbled call changed nothing
        args = call["arguments"]
        last, obs = call["name"] + ":" + args.get("command", args.get("path", "")), observation
        if last == "bash:cat /repo/solution.py":
            code = observation.rsplit("\n[exit ", 1)[0]
        elif call["name"] == "write_file":
            tried.append(task["candidates"].index(args["content"]))
    if not last:
        return "Read the code first.", tool_call("bash", command="cat /repo/solution.py")
    if last == "bash:cat /repo/solution.py" or last.startswith("write_file:"):
        return "Run the tests.", tool_call("bash", command="bash /repo/run_tests.sh")
    m = re.search(r"PASSED (\d+)/(\d+)", obs)
    if m and m.group(1) == m.group(2):
        return f"All {m.group(2)} tests pass.", tool_call("submit")
    passing = f"{m.group(1)}/{m.group(2)} pass" if m else "The tests did not run"
    for i in order:
        if i not in tried and task["candidates"][i] != code:
            return f"{passing}; try fix {i}.", tool_call("write_file", path="/repo/solution.py",
                                                         content=task["candidates"][i])
    return f"{passing}, and I am out of ideas.", tool_call("submit")


def parse_tool_call(text: str) -> Any:
    """The tool call in a completion, as a model's output is parsed: the
    JSON between <tool_call> tags, checked against the tools' argument
    types. A string (the error to show the model) when there is none, it
    does not parse, or it names an unknown tool or wrong arguments."""
    m = re.search(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    if not m:
        return "no <tool_call> in the completion"
    try:
        call = json.loads(m.group(1))
    except ValueError as e:
        return f"the tool call is not valid JSON ({e.msg} at {e.pos})"
    if not isinstance(call, dict) or call.get("name") not in TOOLS or not isinstance(call.get("arguments", {}), dict):
        return f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}; tools: {', '.join(TOOLS)}"
    args = call.setdefault("arguments", {})
    want = TOOLS[call["name"]]
    if set(args) != set(want) or any(not isinstance(args[k], t) for k, t in want.items()):
        return f"{call['name']} takes {', '.join(want) or 'no arguments'}"
    return call


# -- the trainer's bookkeeping --------------------------------------------

class Journal:
    """What the trainer knows it finished: request IDs and rewards, appended
    and synced after each call returns, so a resumed run can check the
    server replayed them. Its first line is the run's RunKeys header."""

    def __init__(self, path: str, keys: dsec.RunKeys) -> None:
        self.lock = threading.Lock()
        self.calls: set = set()
        self.rewards: Dict[str, float] = {}
        self.groups: Dict[str, Dict[str, Any]] = {}
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # torn by the kill
                if e["t"] == "call":
                    self.calls.add(e["rid"])
                elif e["t"] == "reward":
                    self.rewards[e["traj"]] = e["reward"]
                elif e["t"] == "group":
                    self.groups[e["task"]] = e
        self.f = open(path, "a")

    def add(self, **e: Any) -> None:
        with self.lock:
            self.f.write(json.dumps(e) + "\n")
            self.f.flush()
            os.fsync(self.f.fileno())


class Killer:
    """--kill-at N: SIGKILL this process at a random moment after its Nth
    call starts (0 to 250 ms later: before the request is sent, while the
    server runs it, or after the answer arrived but before it was
    journaled), with the other rollouts' calls in flight."""

    def __init__(self, at: int, seed: int) -> None:
        self.at, self.rng = at, random.Random(seed)
        self.started = 0
        self.lock = threading.Lock()
        self.in_flight = 0

    def starting(self) -> None:
        with self.lock:
            self.started += 1
            self.in_flight += 1
            fire = self.at and self.started == self.at
        if fire:
            delay = self.rng.uniform(0, 0.25)
            threading.Thread(target=self._kill, args=(delay,), daemon=True).start()

    def finished(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def _kill(self, delay: float) -> None:
        time.sleep(delay)
        with self.lock:
            print(f"\n--kill-at {self.at} (+{delay * 1000:.0f} ms): SIGKILL with {self.in_flight} calls in flight",
                  flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Run:
    def __init__(self, args: argparse.Namespace, keys: dsec.RunKeys) -> None:
        self.args = args
        self.keys = keys
        self.client = dsec.Client(args.url)
        self.journal = Journal(args.state, keys)
        self.killer = Killer(0 if args.resume else args.kill_at, args.seed)
        self.lock = threading.Lock()
        self.calls = 0          # calls made by this process
        self.replayed = 0       # of which answered from the log
        self.prefix_hits = 0    # journaled before the kill and replayed now
        self.prefix_misses = 0  # journaled before the kill but run again
        self.rewards: Dict[str, Optional[float]] = {}
        self.turns: Dict[str, int] = {}
        self.parse_errors = 0
        self.infra_failures = 0
        self.sandboxes = 0
        self.done_rollouts = 0

    # Each call goes through here: request IDs, journaling, the killer.
    def call(self, rid: str, f: Any, *a: Any, **kw: Any) -> Any:
        self.killer.starting()
        try:
            r = f(*a, request_id=rid, **kw)
        finally:
            self.killer.finished()
        replayed = bool(getattr(r, "replayed", False))
        with self.lock:
            self.calls += 1
            self.replayed += replayed
            if rid in self.journal.calls:
                if replayed:
                    self.prefix_hits += 1
                else:
                    self.prefix_misses += 1
        self.journal.add(t="call", rid=rid)
        return r

    def progress(self) -> None:
        if not sys.stdout.isatty():
            return
        with self.lock:
            done, total = self.done_rollouts, self.args.tasks * self.args.group
            valid = [r for r in self.rewards.values() if r is not None]
            mean = sum(valid) / len(valid) if valid else 0.0
            line = (f"\rrollouts {done}/{total}  calls {self.calls} (replayed {self.replayed})  "
                    f"mean reward {mean:.3f}  infra failures {self.infra_failures}  sandboxes {self.sandboxes}")
        print(line, end="", flush=True)

    def prepare(self, task: Dict[str, Any]) -> List[dsec.Sandbox]:
        """One sandbox with the repo, forked into the group. The run's
        idempotency keys make a resumed run adopt what the killed one
        created, and only that."""
        a = self.args
        done = self.journal.groups.get(task["name"])
        if done:  # forked before the kill; the base is gone, the children stay
            with self.lock:
                self.sandboxes += len(done["ids"])
            return [self.client.sandbox(i) for i in done["ids"]]
        labels = {**self.keys.labels, "task": task["name"]}
        self.killer.starting()
        try:
            base = self.client.create(image=a.image, kind=a.kind, session=self.keys.session, ttl_s=3600,
                                      idempotency_key=self.keys.key(task["name"], "base"),
                                      labels={**labels, "role": "base"})
        finally:
            self.killer.finished()
        for path, (data, mode) in sorted(task["files"].items()):
            self.call(self.keys.request_id(task["name"], "base", "write", path), base.write_file, "/repo/" + path,
                      data, mode=mode)
        self.killer.starting()
        try:
            kids = self.client.fork(base, a.group, labels={**labels, "role": "rollout"},
                                    idempotency_key=self.keys.key(task["name"], "fork"))
        finally:
            self.killer.finished()
        if len(kids) != a.group:
            raise dsec.Unavailable(f"fork made {len(kids)} of {a.group} children")
        with self.lock:
            self.sandboxes += 1 + len(kids)
        self.journal.add(t="group", task=task["name"], ids=[k.id for k in kids])
        base.close()
        return kids

    def run_tool(self, traj: str, turn: int, call: Dict[str, Any], sb: dsec.Sandbox) -> str:
        rid = self.keys.request_id(traj, turn)
        args = call["arguments"]
        if call["name"] == "bash":
            r = self.call(rid, sb.exec, ["bash", "-lc", args["command"]], timeout_s=60)
            return (r.stdout + r.stderr)[-4000:] + f"\n[exit {r.exit_code}]"
        if call["name"] == "write_file":
            info = self.call(rid, sb.write_file, args["path"], args["content"])
            return f"wrote {info.size} bytes to {args['path']}"
        raise AssertionError(call["name"])

    def rollout(self, task: Dict[str, Any], g: int, sb: dsec.Sandbox) -> Optional[float]:
        traj = f"{task['name']}/{g}"
        history: List[Tuple[str, str]] = []
        try:
            for turn in range(MAX_TURNS):
                completion = policy(task, g, history)
                call = parse_tool_call(completion)
                if isinstance(call, str):
                    with self.lock:
                        self.parse_errors += 1
                    history.append((completion, "error: " + call))
                    continue
                if call["name"] == "submit":
                    break
                history.append((completion, self.run_tool(traj, turn, call, sb)))
            # The verifier: the tests, once more, after the episode.
            res = self.call(self.keys.request_id(traj, "verify"), sb.exec, "bash /repo/run_tests.sh", timeout_s=60)
            passed, total = re.search(r"PASSED (\d+)/(\d+)", res.stdout).groups()
            reward: Optional[float] = int(passed) / max(int(total), 1)
        except dsec.DsecError as e:
            if not e.infra:
                raise
            with self.lock:
                self.infra_failures += 1
            reward = None  # masked: an infrastructure failure is not a zero reward
        if reward is not None:
            self.journal.add(t="reward", traj=traj, reward=reward)
        with self.lock:
            self.rewards[traj] = reward
            self.turns[traj] = len(history)
            self.done_rollouts += 1
        self.progress()
        return reward

    def group(self, pool: ThreadPoolExecutor, task: Dict[str, Any]) -> Dict[str, Any]:
        try:
            kids = self.prepare(task)
        except dsec.DsecError as e:
            if not e.infra:
                raise
            with self.lock:
                self.infra_failures += self.args.group
                self.done_rollouts += self.args.group
            return {"task": task["name"], "rewards": [None] * self.args.group, "advantages": []}
        rewards = list(pool.map(lambda g: self.rollout(task, g, kids[g]), range(len(kids))))
        valid = [r for r in rewards if r is not None]
        mean = sum(valid) / len(valid) if valid else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / len(valid)) if valid else 0.0
        adv = [None if r is None else (r - mean) / (std + 1e-6) for r in rewards]
        return {"task": task["name"], "rewards": rewards, "advantages": adv, "mean": mean}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("DSEC_URL"))
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--kind", default="container")
    p.add_argument("--image", default="debian")
    p.add_argument("--run", default="grpo-demo", help="run name: the sandboxes' run label")
    p.add_argument("--state", help="journal file (default /tmp/dsec-<run>.jsonl)")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts in flight")
    p.add_argument("--kill-at", type=int, default=0, help="SIGKILL this process at a random moment after its Nth call starts")
    p.add_argument("--kill-random", type=int, metavar="SEED", help="--kill-at a call drawn with this seed")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill's moment")
    p.add_argument("--resume", action="store_true", help="resume a killed run (same --run and --state)")
    p.add_argument("--json", help="write the final summary here as JSON")
    args = p.parse_args()
    args.state = args.state or f"/tmp/dsec-{args.run}.jsonl"
    if args.kill_random is not None:
        # Calls per run: the base's writes, the episodes' tool calls and the verifiers.
        rng = random.Random(args.kill_random)
        args.kill_at = rng.randint(5, max(6, args.tasks * (3 + args.group * 5)))
        args.seed = rng.randrange(1 << 30)

    keys = dsec.RunKeys.resume(args.run, args.state) if args.resume else dsec.RunKeys.start(args.run, args.state)
    run = Run(args, keys)
    tasks = load_tasks(args.tasks)
    start = time.time()
    # The session binds every sandbox: if this process dies, the server
    # pauses them after the grace period; --resume reopens it.
    session = run.client.session(keys.session, heartbeat_s=2, grace_s=6, on_expire="pause")
    if args.resume:
        print(f"resumed run {keys.name} (nonce {keys.nonce}): {session.resumed} paused sandboxes resumed; "
              f"{len(run.journal.calls)} calls and {len(run.journal.rewards)} rewards journaled before the kill",
              flush=True)
    else:
        print(f"run {keys.name}, nonce {keys.nonce}" + (f"; SIGKILL after call {args.kill_at}" if args.kill_at else ""),
              flush=True)
    with ThreadPoolExecutor(args.concurrency) as pool, ThreadPoolExecutor(4) as groups:
        results = list(groups.map(lambda t: run.group(pool, t), tasks))
    print()
    session.close(delete_sandboxes=True)
    wall = time.time() - start
    leaked = len(run.client.list(labels=keys.labels))

    same = [t for t, r in run.journal.rewards.items() if run.rewards.get(t) == r]
    differ = [t for t, r in run.journal.rewards.items() if t in run.rewards and run.rewards[t] != r]
    valid = [r for r in run.rewards.values() if r is not None]
    summary = {
        "run": keys.name, "nonce": keys.nonce,
        "tasks": len(tasks), "rollouts": len(run.rewards), "mean_reward": sum(valid) / len(valid) if valid else 0.0,
        "rewards": {t: r for t, r in sorted(run.rewards.items())},
        "mean_turns": sum(run.turns.values()) / len(run.turns) if run.turns else 0.0,
        "parse_errors": run.parse_errors,
        "infra_failures": run.infra_failures, "sandboxes_leaked": leaked, "wall_s": round(wall, 1),
        "sandboxes": run.sandboxes, "sandboxes_per_s": round(run.sandboxes / wall, 2) if wall else 0.0,
        "calls": run.calls, "replayed": run.replayed,
        "prefix_calls": run.prefix_hits + run.prefix_misses, "prefix_replay_hits": run.prefix_hits,
        "rewards_identical": len(same), "rewards_differ": len(differ),
    }
    w = 44
    print("=" * w)
    for k in ("tasks", "rollouts", "mean_reward", "mean_turns", "parse_errors", "infra_failures", "sandboxes_leaked",
              "wall_s", "sandboxes", "sandboxes_per_s", "calls", "replayed"):
        v = summary[k]
        print(f"{k.replace('_', ' '):<28}{v:>16.3f}" if isinstance(v, float) else f"{k.replace('_', ' '):<28}{v:>16}")
    if args.resume:
        pc = summary["prefix_calls"]
        rate = 100.0 * summary["prefix_replay_hits"] / pc if pc else 100.0
        hits = f"{summary['prefix_replay_hits']}/{pc} ({rate:.0f}%)"
        print(f"{'replay hits on the prefix':<28}{hits:>16}")
        print(f"{'rewards identical/differ':<28}{f'{len(same)}/{len(differ)}':>16}")
    print("=" * w)
    for r in results:
        print(f"  {r['task']:<14} rewards " + " ".join("  x " if x is None else f"{x:.2f}" for x in r["rewards"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if leaked == 0 and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
