"""The GRPO example end to end: full runs (twice in a row under one name,
each with its own keys), and runs SIGKILLed at random moments (calls in
flight) and resumed, which must fast-forward through every call they had
journaled and arrive at the same rewards without leaking a sandbox."""

import json
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "grpo_rollout.py")


def run(server, *args, check=True):
    p = subprocess.run([sys.executable, EXAMPLE, "--url", server.url, "--tasks", "4", "--group", "4", *args],
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"grpo_rollout {args} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    run(server, "--run", "py-grpo-ref", "--json", str(out), "--state", str(out) + ".jsonl")
    return json.loads(out.read_text())


def test_a_full_run_scores_its_rollouts_and_leaks_nothing(server, client, reference):
    s = reference
    assert s["rollouts"] == 16 and s["infra_failures"] == 0 and s["sandboxes_leaked"] == 0
    # The policy fixes some rollouts within its turns and not others:
    # rewards are neither all 0 nor all 1.
    assert 0.2 < s["mean_reward"] < 0.95, s
    assert s["replayed"] == 0 and s["parse_errors"] > 0  # it garbles some calls and recovers
    assert client.list(labels={"run": "py-grpo-ref"}) == []
    # Fork snapshots went with their children.
    assert [x for x in client.snapshots() if x.name.startswith("fork of ")] == []


def test_running_twice_under_one_name_gets_fresh_keys(server, client, reference, tmp_path):
    first = tmp_path / "1.json"
    second = tmp_path / "2.json"
    state = str(tmp_path / "same.jsonl")
    run(server, "--run", "py-grpo-twice", "--json", str(first), "--state", state)
    run(server, "--run", "py-grpo-twice", "--json", str(second), "--state", state)
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["nonce"] != b["nonce"]
    assert b["replayed"] == 0 and b["infra_failures"] == 0 and b["sandboxes_leaked"] == 0
    assert a["rewards"] == b["rewards"] == reference["rewards"]


@pytest.mark.parametrize("seed", [2, 7, 5])  # kills at call 12 (preparing), 46 (mid-rollouts), 84 (near the end)
def test_a_run_killed_at_a_random_moment_resumes_by_fast_forwarding(server, client, reference, tmp_path, seed):
    name = f"py-grpo-kill{seed}"
    state = str(tmp_path / "kr.jsonl")
    killed = run(server, "--run", name, "--kill-random", str(seed), "--state", state, check=False)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert "calls in flight" in killed.stdout
    # The trainer is gone; its sandboxes survive it (paused after the grace).
    assert len(client.list(labels={"run": name})) > 0

    out = tmp_path / "resume.json"
    p = run(server, "--run", name, "--resume", "--state", state, "--json", str(out))
    s = json.loads(out.read_text())
    assert s["prefix_replay_hits"] == s["prefix_calls"], p.stdout
    assert s["rewards_differ"] == 0, p.stdout
    assert s["rewards"] == reference["rewards"]
    assert s["rollouts"] == 16 and s["infra_failures"] == 0 and s["sandboxes_leaked"] == 0
    assert client.list(labels={"run": name}) == []


def test_resume_needs_the_runs_own_journal(server, tmp_path):
    p = run(server, "--run", "py-grpo-none", "--resume", "--state", str(tmp_path / "missing.jsonl"), check=False)
    assert p.returncode != 0 and "FileNotFoundError" in p.stderr
