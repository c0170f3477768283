"""The GRPO example end to end: a full run, then a run SIGKILLed mid-way
and resumed, which must fast-forward through every call it had finished
and arrive at the same rewards without leaking a sandbox."""

import json
import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "grpo_rollout.py")


def run(server, tmp_path, *args, check=True):
    p = subprocess.run([sys.executable, EXAMPLE, "--url", server.url, "--tasks", "4", "--group", "4", *args],
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"grpo_rollout {args} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def test_grpo_rollout_full_run(server, client, tmp_path):
    out = tmp_path / "full.json"
    run(server, tmp_path, "--run", "py-grpo-full", "--json", str(out))
    s = json.loads(out.read_text())
    assert s["rollouts"] == 16 and s["infra_failures"] == 0 and s["sandboxes_leaked"] == 0
    # The scripted policy fixes half the rollouts, half-fixes a quarter and
    # leaves a quarter alone: rewards are neither all 0 nor all 1.
    assert 0.2 < s["mean_reward"] < 0.95
    assert s["replayed"] == 0
    assert client.list(labels={"run": "py-grpo-full"}) == []
    # Fork snapshots went with their children.
    assert [x for x in client.snapshots() if x.name.startswith("fork of ")] == []


def test_grpo_rollout_killed_and_resumed(server, client, tmp_path):
    full = tmp_path / "full.json"
    run(server, tmp_path, "--run", "py-grpo-ref", "--json", str(full), "--state", str(tmp_path / "ref.jsonl"))
    state = str(tmp_path / "kr.jsonl")
    killed = run(server, tmp_path, "--run", "py-grpo-kr", "--kill-at", "40", "--state", state, check=False)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    journaled = sum(1 for line in open(state) if '"t": "call"' in line)
    assert journaled >= 40
    # The trainer is gone; its sandboxes survive it (paused after the grace).
    assert len(client.list(labels={"run": "py-grpo-kr"})) > 0

    out = tmp_path / "resume.json"
    p = run(server, tmp_path, "--run", "py-grpo-kr", "--resume", "--state", state, "--json", str(out))
    s = json.loads(out.read_text())
    ref = json.loads(full.read_text())
    assert s["prefix_calls"] > 0 and s["prefix_replay_hits"] == s["prefix_calls"], p.stdout
    assert s["rewards_differ"] == 0 and s["rewards_identical"] > 0, p.stdout
    assert s["mean_reward"] == ref["mean_reward"], (s, ref)
    assert s["rollouts"] == 16 and s["infra_failures"] == 0 and s["sandboxes_leaked"] == 0
    assert client.list(labels={"run": "py-grpo-kr"}) == []
