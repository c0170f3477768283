#!/usr/bin/env python3
"""Agents inside their sandboxes, calling a model through dsec's model gateway.

Each rollout is a sandbox (the debian image) running a small agent scaffold
(AGENT below, Python, standard library only) that talks to
``$OPENAI_BASE_URL`` as any OpenAI client would, runs the tool calls the
model returns and submits. The model is examples/model_server.py, a
deterministic stand-in for vLLM that this script starts itself and registers
as the session's upstream: the sandboxes hold no key and have no network;
the gateway on their own loopback forwards their calls and records each one
(request, response, token IDs, log probabilities) in the sandbox's
trajectory log.

    python3 examples/agent_gateway.py --rollouts 4
    python3 examples/agent_gateway.py --run r1 --kill-after 5   # SIGKILLs itself once the model served 5 calls
    python3 examples/agent_gateway.py --run r1 --resume         # fast-forwards each rollout through its log

A resumed run starts each unfinished rollout again in a fresh sandbox
created with ``fast_forward_from`` the killed one: its agent's model calls
are answered from the recorded ones while they are the same, then go live.
The summary counts the recorded calls answered from the log and checks at
the model server that none of them reached it twice.
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

# The scaffold inside the sandbox: it knows nothing of dsec, only the OpenAI
# protocol at OPENAI_BASE_URL.
AGENT = r'''
import json, os, re, subprocess, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
messages = [{"role": "system", "content": "Solve the task in task.txt with <bash> tool calls, then <submit/>."},
            {"role": "user", "content": "Begin. Your task: " + open("task.txt").read()}]
for turn in range(8):
    req = urllib.request.Request(base + "/chat/completions", method="POST",
        data=json.dumps({"model": "policy", "messages": messages, "temperature": 0, "logprobs": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.load(r)["choices"][0]["message"]["content"]
    messages.append({"role": "assistant", "content": text})
    if "<submit/>" in text:
        print(json.dumps({"turns": turn + 1, "submitted": True}))
        break
    m = re.search(r"<bash>(.*?)</bash>", text, re.S)
    out = subprocess.run(m.group(1), shell=True, capture_output=True, text=True, timeout=60) if m else None
    obs = (out.stdout + out.stderr) if out else "no tool call found"
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


def rollout(client: dsec.Client, sess: Any, run: str, i: int, journal: Journal, resume_from: str = "") -> Dict[str, Any]:
    labels = {"run": run, "rollout": str(i)}
    if resume_from:
        # The killed run's agent may still be at work in its sandbox (a
        # command outlives its caller): end it, so its log is final, then
        # fast-forward a fresh sandbox through that log.
        try:
            client.delete(resume_from)
        except dsec.NotFound:
            pass
    sb = client.create("debian", session=sess, model_gateway=True, labels=labels,
                       fast_forward_from=resume_from or None)
    journal.add({"rollout": i, "sandbox": sb.id})
    try:
        nums = task_numbers(run, i)
        sb.write_file("/root/task.txt", "Write the sum of these numbers to answer.txt. numbers: " + " ".join(map(str, nums)) + "\n")
        sb.write_file("/root/agent.py", AGENT)
        r = sb.exec("cd /root && python3 agent.py", timeout_s=300)
        if r.exit_code != 0:
            return {"rollout": i, "reward": 0.0, "infra": True, "error": r.stderr[-500:]}
        answer = sb.exec("cat /root/answer.txt 2>/dev/null").stdout.strip()
        calls = [e["modelCall"] for e in sb.log() if e.get("op") == "model_call"]
        return {"rollout": i, "reward": 1.0 if answer == str(sum(nums)) else 0.0, "infra": False,
                "model_calls": len(calls), "replayed": sum(1 for c in calls if c.get("replayed")),
                "diverged": sum(1 for c in calls if c.get("diverged")),
                "logprobs": sum(len(c.get("logprobs", [])) for c in calls)}
    finally:
        sb.close()


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
        old = {r["rollout"]: r["sandbox"] for r in recs if "sandbox" in r}
        done = {r["rollout"]: r for r in recs if "reward" in r}
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

        todo = [i for i in range(args.rollouts) if i not in done]
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda i: rollout(client, sess, args.run, i, journal, old.get(i, "")), todo))
        for r in results:
            journal.add(r)
            done[r["rollout"]] = r

        # What the resumed rollouts replayed: every call the killed sandbox
        # completed is answered from its log and reached the model once.
        prefix_calls = prefix_hits = duplicates = 0
        seen = stats(model_url)["by_digest"]
        for i, sid in old.items():
            if i not in {r["rollout"] for r in results}:
                continue
            recorded = [e["modelCall"] for e in client.get(sid).log() if e.get("op") == "model_call" and not e.get("error")]
            prefix_calls += len(recorded)
            for mc in recorded:
                if seen.get(hashlib.sha256(mc["request"].encode()).hexdigest(), 0) > 1:
                    duplicates += 1
        prefix_hits = sum(r.get("replayed", 0) for r in results)
        for sid in old.values():
            try:
                client.delete(sid)
            except dsec.NotFound:
                pass

    rewards = [done[i]["reward"] for i in range(args.rollouts)]
    summary = {"run": args.run, "rollouts": args.rollouts, "rewards": rewards,
               "infra_failures": sum(1 for i in range(args.rollouts) if done[i].get("infra")),
               "model_calls": sum(done[i].get("model_calls", 0) for i in range(args.rollouts)),
               "prefix_calls": prefix_calls, "prefix_replay_hits": prefix_hits, "prefix_duplicates_at_model": duplicates,
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
