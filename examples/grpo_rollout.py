#!/usr/bin/env python3
"""A GRPO-shaped rollout loop on dsec, with a scripted policy (no model).

For each of N coding tasks (examples/tasks/: a small repo with failing
tests), one sandbox is prepared with the repo and forked into G children;
each child runs a multi-turn episode (read the code, read the tests, write
a fix, run the tests), the reward is the fraction of tests passing, and
advantages are computed per group with infrastructure-failed rollouts
masked out of the group statistics. Everything is bound to one session.

    python3 examples/grpo_rollout.py --tasks 16 --group 8
    python3 examples/grpo_rollout.py --kill-at 120       # SIGKILLs itself mid-run
    python3 examples/grpo_rollout.py --resume            # fast-forwards through the trajectory log

Every call carries a request ID derived from (trajectory, turn), so a resumed
run re-issues the same calls and the server answers the completed ones from
each sandbox's trajectory log instead of running them again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python"))
import dsec  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load_tasks(n: int) -> List[Dict[str, Any]]:
    root = os.path.join(HERE, "tasks")
    tasks = []
    for name in sorted(os.listdir(root))[:n]:
        meta = json.load(open(os.path.join(root, name, "task.json")))
        files = {}
        repo = os.path.join(root, name, "repo")
        for d, _, fs in os.walk(repo):
            for f in fs:
                p = os.path.join(d, f)
                files[os.path.relpath(p, repo)] = (open(p, "rb").read(), os.stat(p).st_mode & 0o777)
        meta["files"] = files
        tasks.append(meta)
    return tasks


def policy(task: Dict[str, Any], g: int, observation: str) -> str:
    """The scripted policy: deterministic per (task, rollout) so a resumed
    run makes the same choices. Half the rollouts fix the bug, a quarter
    half-fix it, a quarter change nothing."""
    h = int(hashlib.sha256(f"{task['name']}/{g}".encode()).hexdigest(), 16) % 4
    return task["candidates"][{0: 0, 1: 0, 2: 1, 3: 2}[h]]


class Journal:
    """What the trainer knows it finished: request IDs and rewards, appended
    and synced, so a resumed run can check the server replayed them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.calls: set = set()
        self.rewards: Dict[str, float] = {}
        self.groups: Dict[str, Dict[str, Any]] = {}
        if os.path.exists(path):
            for line in open(path):
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


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = dsec.Client(args.url)
        self.journal = Journal(args.state)
        self.lock = threading.Lock()
        self.calls = 0          # calls made by this process
        self.replayed = 0       # of which answered from the log
        self.prefix_hits = 0    # journaled before the kill and replayed now
        self.prefix_misses = 0  # journaled before the kill but run again
        self.rewards: Dict[str, Optional[float]] = {}
        self.infra_failures = 0
        self.sandboxes = 0
        self.done_rollouts = 0

    # Each call goes through here: request IDs, journaling, --kill-at.
    def call(self, rid: str, f: Any, *a: Any, **kw: Any) -> Any:
        r = f(*a, request_id=rid, **kw)
        replayed = bool(getattr(r, "replayed", False))
        with self.lock:
            self.calls += 1
            self.replayed += replayed
            if rid in self.journal.calls:
                if replayed:
                    self.prefix_hits += 1
                else:
                    self.prefix_misses += 1
            total = self.calls
        self.journal.add(t="call", rid=rid)
        if self.args.kill_at and total >= self.args.kill_at and not self.args.resume:
            print(f"\n--kill-at {self.args.kill_at}: SIGKILL (no cleanup runs)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
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
        """One sandbox with the repo, forked into the group. Idempotency keys
        make a resumed run adopt what the killed one created."""
        a = self.args
        key = f"{a.run}/{task['name']}"
        done = self.journal.groups.get(task["name"])
        if done:  # forked before the kill; the base is gone, the children stay
            with self.lock:
                self.sandboxes += len(done["ids"])
            return [self.client.sandbox(i) for i in done["ids"]]
        base = self.client.create(image=a.image, kind=a.kind, session=a.run, idempotency_key=key + "/base",
                                  labels={"run": a.run, "task": task["name"], "role": "base"}, ttl_s=3600)
        for path, (data, mode) in sorted(task["files"].items()):
            self.call(f"{key}/base/write/{path}", base.write_file, "/repo/" + path, data, mode=mode)
        kids = self.client.fork(base, a.group, labels={"role": "rollout"}, idempotency_key=key + "/fork")
        if len(kids) != a.group:
            raise dsec.Unavailable(f"fork made {len(kids)} of {a.group} children")
        with self.lock:
            self.sandboxes += 1 + len(kids)
        self.journal.add(t="group", task=task["name"], ids=[k.id for k in kids])
        base.close()
        return kids

    def rollout(self, task: Dict[str, Any], g: int, sb: dsec.Sandbox) -> Optional[float]:
        traj = f"{self.args.run}/{task['name']}/{g}"
        try:
            code = self.call(f"{traj}/0", sb.exec, "cat /repo/solution.py").stdout
            self.call(f"{traj}/1", sb.exec, "cat /repo/tests/test_solution.py")
            fix = policy(task, g, code)
            self.call(f"{traj}/2", sb.write_file, "/repo/solution.py", fix)
            res = self.call(f"{traj}/3", sb.exec, "bash /repo/run_tests.sh", timeout_s=60)
            passed, total = res.stdout.strip().split()[-1].split("/")
            reward = int(passed) / max(int(total), 1)
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
    p.add_argument("--run", default="grpo-demo", help="run name: the session and the sandboxes' run label")
    p.add_argument("--state", help="journal file (default /tmp/dsec-<run>.jsonl)")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts in flight")
    p.add_argument("--kill-at", type=int, default=0, help="SIGKILL this process after this many calls")
    p.add_argument("--resume", action="store_true", help="resume a killed run (same --run)")
    p.add_argument("--json", help="write the final summary here as JSON")
    args = p.parse_args()
    args.state = args.state or f"/tmp/dsec-{args.run}.jsonl"
    if not args.resume and os.path.exists(args.state):
        os.remove(args.state)

    run = Run(args)
    tasks = load_tasks(args.tasks)
    start = time.time()
    # The session binds every sandbox: if this process dies, the server
    # pauses them after the grace period; --resume reopens it.
    session = run.client.session(args.run, heartbeat_s=2, grace_s=6, on_expire="pause")
    if args.resume:
        print(f"resumed session {args.run}: {session.resumed} paused sandboxes resumed; "
              f"{len(run.journal.calls)} calls and {len(run.journal.rewards)} rewards journaled before the kill", flush=True)
    with ThreadPoolExecutor(args.concurrency) as pool, ThreadPoolExecutor(4) as groups:
        results = list(groups.map(lambda t: run.group(pool, t), tasks))
    print()
    session.close(delete_sandboxes=True)
    wall = time.time() - start
    leaked = len(run.client.list(labels={"run": args.run}))

    same = [t for t, r in run.journal.rewards.items() if run.rewards.get(t) == r]
    differ = [t for t, r in run.journal.rewards.items() if t in run.rewards and run.rewards[t] != r]
    valid = [r for r in run.rewards.values() if r is not None]
    summary = {
        "tasks": len(tasks), "rollouts": len(run.rewards), "mean_reward": sum(valid) / len(valid) if valid else 0.0,
        "infra_failures": run.infra_failures, "sandboxes_leaked": leaked, "wall_s": round(wall, 1),
        "sandboxes": run.sandboxes, "sandboxes_per_s": round(run.sandboxes / wall, 2) if wall else 0.0,
        "calls": run.calls, "replayed": run.replayed,
        "prefix_calls": run.prefix_hits + run.prefix_misses, "prefix_replay_hits": run.prefix_hits,
        "rewards_identical": len(same), "rewards_differ": len(differ),
    }
    w = 44
    print("=" * w)
    for k in ("tasks", "rollouts", "mean_reward", "infra_failures", "sandboxes_leaked", "wall_s", "sandboxes", "sandboxes_per_s", "calls", "replayed"):
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
        json.dump(summary, open(args.json, "w"), indent=2)
    return 0 if leaked == 0 and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
