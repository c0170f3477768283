#!/usr/bin/env python3
"""Agents in sandboxes of their own, calling a model through dsec's model
gateway and driving the task's sandbox through dsec.

Each rollout is a sandbox group: a task sandbox (the debian image, holding
task.txt) and an agent sandbox running a small agent scaffold (AGENT below,
Python, standard library only) as a dsec rollout. The agent talks to
``$OPENAI_BASE_URL`` as any OpenAI client would and runs the model's tool
calls in the task sandbox through the dsec API at ``$DSEC_URL`` (its
workers, ``$DSEC_WORKERS``). The model is examples/model_server.py, a
deterministic stand-in for vLLM that this script starts itself and
registers as the session's upstream: the sandboxes hold no key and have no
network; the gateway on the agent's own loopback forwards its calls and
records each one (request, response, token IDs, log probabilities) in the
agent sandbox's trajectory log, and each command in the task sandbox's.

    python3 examples/agent_gateway.py --rollouts 4
    python3 examples/agent_gateway.py --run r1 --kill-after 5   # SIGKILLs itself once the model served 5 calls
    python3 examples/agent_gateway.py --run r1 --resume         # replays each unfinished rollout from the logs

A resumed run starts each unfinished rollout again in a fresh agent sandbox
created with ``fast_forward_from`` the killed one (standing in for an agent
sandbox lost with its trainer; a trainer that merely died would reattach to
the rollout, which never stopped), beside the same task sandbox: its
model calls are answered from the recorded ones and its commands from the
task sandbox's log while they are the same, then go live. The summary
counts both and checks at the model server that no recorded call reached it
twice, and in the task sandbox's log that no command ran twice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python"))
import dsec  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# The scaffold inside the agent's sandbox: it knows nothing of dsec beyond
# two addresses, the OpenAI protocol at OPENAI_BASE_URL and an exec in its
# worker at DSEC_URL.
AGENT = r'''
import base64, json, os, re, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

def post(url, body, headers):
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers=dict(headers, **{"Content-Type": "application/json"}))
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)

def bash(cmd):
    r = post(os.environ["DSEC_URL"] + "/dsec.v1.ProcessService/Exec",
             {"sandboxId": os.environ["DSEC_WORKERS"], "cmd": cmd, "cwd": "/root", "timeoutS": 60}, {})
    return (base64.b64decode(r.get("stdout", "")) + base64.b64decode(r.get("stderr", ""))).decode(errors="replace")

task = bash("cat task.txt")
messages = [{"role": "system", "content": "Solve the task in task.txt with <bash> tool calls, then <submit/>."},
            {"role": "user", "content": "Begin. Your task: " + task}]
for turn in range(8):
    text = post(base + "/chat/completions", {"model": "policy", "messages": messages, "temperature": 0, "logprobs": True},
                {"Authorization": "Bearer " + key})["choices"][0]["message"]["content"]
    messages.append({"role": "assistant", "content": text})
    if "<submit/>" in text:
        print(json.dumps({"turns": turn + 1, "submitted": True}))
        break
    m = re.search(r"<bash>(.*?)</bash>", text, re.S)
    obs = bash(m.group(1)) if m else "no tool call found"
    messages.append({"role": "user", "content": obs[-4000:]})
'''


def task_numbers(run: str, i: int) -> List[int]:
    h = hashlib.sha256(f"{run}/{i}".encode()).digest()
    return [b % 50 for b in h[:6]]


class Journal:
    """The run's state file: the model server's address, then one line per
    rollout's sandbox and one per finished rollout."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def read(self) -> List[Dict[str, Any]]:
        out = []
        with open(self.path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # torn by the kill
        return out

    def add(self, rec: Dict[str, Any]) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def start_model_server(state: str) -> Dict[str, Any]:
    """Start the model server in a session of its own, so it outlives a
    killed trainer; the journal keeps its address and PID."""
    port_file = state + ".port"
    if os.path.exists(port_file):
        os.remove(port_file)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "model_server.py"), "--port-file", port_file],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1000):
        if os.path.exists(port_file):
            with open(port_file) as f:
                port = f.read().strip()
            os.remove(port_file)
            return {"model_url": f"http://127.0.0.1:{port}", "model_pid": proc.pid}
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError("the model server did not start")


def stats(model_url: str) -> Dict[str, Any]:
    with urllib.request.urlopen(model_url + "/stats", timeout=10) as r:
        return json.load(r)


def commands_in(task: Any, rid: str) -> int:
    """The commands rollout rid's agents ran in the task sandbox: the
    execs its log holds under the IDs the worker API gave them."""
    return sum(1 for e in task.log() if e.get("op") == "exec" and e.get("requestId", "").startswith(f"rollout:{rid}/"))


def rollout(client: dsec.Client, sess: Any, run: str, i: int, journal: Journal, old: Dict[str, str]) -> Dict[str, Any]:
    labels = {"run": run, "rollout": str(i)}
    rid = f"{run}-{i}"
    if old.get("agent"):
        # The killed run's agent may still be at work (a rollout outlives
        # its trainer): end it, so both logs are final, then fast-forward
        # a fresh agent sandbox through them.
        try:
            client.delete(old["agent"])
        except dsec.NotFound:
            pass
    if old.get("task"):
        task = client.get(old["task"])
    else:
        task = client.create("debian", session=sess, labels=labels)
        journal.add({"rollout": i, "task": task.id})
    prefix_commands = commands_in(task, rid)  # what the killed agent ran there
    agent = client.create("debian", session=sess, model_gateway=True, labels=labels,
                          fast_forward_from=old.get("agent") or None)
    journal.add({"rollout": i, "task": task.id, "agent": agent.id})
    try:
        res = attempt(client, task, agent, run, i, rid, prefix_commands)
        # Journaled before its sandboxes go: a rollout whose task sandbox
        # is gone is always a finished one to a resumed run.
        journal.add(res)
        return res
    finally:
        agent.close()
        task.close()


def attempt(client: dsec.Client, task: Any, agent: Any, run: str, i: int, rid: str, prefix_commands: int) -> Dict[str, Any]:
    nums = task_numbers(run, i)
    # Exactly once: a resumed run's write is answered from the log.
    task.write_file("/root/task.txt", "Write the sum of these numbers to answer.txt. numbers: " + " ".join(map(str, nums)) + "\n",
                    request_id=f"task-{rid}")
    agent.write_file("/root/agent.py", AGENT)
    r = agent.rollout("cd /root && python3 agent.py", rid, workers=[task], timeout_s=300).wait(600)
    if r.state != "succeeded":
        return {"rollout": i, "reward": 0.0, "infra": True, "error": r.detail or r.result.get("stderr", "")}
    answer = task.exec("cat /root/answer.txt 2>/dev/null").stdout.strip()
    calls = [e["modelCall"] for e in agent.log() if e.get("op") == "model_call"]
    return {"rollout": i, "reward": 1.0 if answer == str(sum(nums)) else 0.0, "infra": False,
            "model_calls": len(calls), "replayed": sum(1 for c in calls if c.get("replayed")),
            "diverged": sum(1 for c in calls if c.get("diverged")),
            "logprobs": sum(len(c.get("logprobs", [])) for c in calls),
            "commands": r.worker_calls, "commands_replayed": r.worker_replays, "divergence": r.divergence,
            "prefix_commands": prefix_commands, "commands_logged": commands_in(task, rid)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("DSEC_URL", "http://127.0.0.1:7788"))
    p.add_argument("--run", default="agents")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--state", help="the run's journal (default /tmp/dsec-agents-<run>.jsonl)")
    p.add_argument("--kill-after", type=int, default=0, help="SIGKILL this process once the model served this many calls")
    p.add_argument("--resume", action="store_true", help="resume a killed run (same --run and --state)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()
    state = args.state or f"/tmp/dsec-agents-{args.run}.jsonl"
    journal = Journal(state)
    client = dsec.Client(args.url)

    if args.resume:
        recs = journal.read()
        model_url, model_pid = recs[0]["model_url"], recs[0]["model_pid"]
        old: Dict[int, Dict[str, str]] = {r["rollout"]: r for r in recs if "task" in r}
        done = {r["rollout"]: r for r in recs if "reward" in r}
        # Sandboxes the killed run made but had not journaled yet.
        known = {r.get(k) for r in recs for k in ("task", "agent")}
        for info in client.list(labels={"run": args.run}):
            if info.id not in known:
                try:
                    client.delete(info.id)
                except dsec.NotFound:
                    pass
    else:
        if os.path.exists(state):
            os.remove(state)
        server = start_model_server(state)
        model_url, model_pid = server["model_url"], server["model_pid"]
        journal.add(server)
        old, done = {}, {}

    with client.session(f"agents-{args.run}", heartbeat_s=2, grace_s=30) as sess:
        sess.set_model_upstreams([{"name": "policy-server", "base_url": model_url + "/v1", "models": ["policy"]}],
                                 per_sandbox_concurrent=4)
        if args.kill_after:
            def killer() -> None:
                while stats(model_url)["calls"] < args.kill_after:
                    time.sleep(0.02)
                print(f"--kill-after {args.kill_after}: SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=killer, daemon=True).start()

        finished_before = sorted(done)
        todo = [i for i in range(args.rollouts) if i not in done]
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda i: rollout(client, sess, args.run, i, journal, old.get(i, {})), todo))
        for r in results:
            done[r["rollout"]] = r

        # What the resumed rollouts replayed: every call the killed agent
        # completed is answered from its log and reached the model once;
        # every command it completed in the task sandbox is answered from
        # that sandbox's log and ran there once.
        prefix_calls = duplicates = 0
        seen = stats(model_url)["by_digest"]
        resumed = [r for r in results if r["rollout"] in old]
        for r in resumed:
            if not old[r["rollout"]].get("agent"):
                continue  # killed before its agent existed: nothing recorded
            recorded = [e["modelCall"] for e in client.get(old[r["rollout"]]["agent"]).log()
                        if e.get("op") == "model_call" and not e.get("error")]
            prefix_calls += len(recorded)
            for mc in recorded:
                if seen.get(hashlib.sha256(mc["request"].encode()).hexdigest(), 0) > 1:
                    duplicates += 1
        prefix_hits = sum(r.get("replayed", 0) for r in results)
        # The killed run's sandboxes: its agents, and those of rollouts it
        # finished but had not deleted yet.
        for o in old.values():
            for sid in (o.get("agent"), o["task"]):
                try:
                    if sid:
                        client.delete(sid)
                except dsec.NotFound:
                    pass

    rewards = [done[i]["reward"] for i in range(args.rollouts)]
    summary = {"run": args.run, "rollouts": args.rollouts, "rewards": rewards,
               "infra_failures": sum(1 for i in range(args.rollouts) if done[i].get("infra")),
               "model_calls": sum(done[i].get("model_calls", 0) for i in range(args.rollouts)),
               "prefix_calls": prefix_calls, "prefix_replay_hits": prefix_hits, "prefix_duplicates_at_model": duplicates,
               # calls of the rollouts the killed run had finished (not resumed)
               "finished_before_calls": sum(done[i].get("model_calls", 0) for i in finished_before),
               "prefix_commands": sum(r["prefix_commands"] for r in resumed),
               "prefix_command_replay_hits": sum(r["commands_replayed"] for r in resumed),
               "commands_run_twice": sum(r["commands_logged"] - r["prefix_commands"] - (r["commands"] - r["commands_replayed"])
                                         for r in resumed),
               "upstream_calls": stats(model_url)["calls"],
               "sandboxes_leaked": len(client.list(labels={"run": args.run}))}
    os.kill(model_pid, signal.SIGTERM)  # the run is over: nothing left behind
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
