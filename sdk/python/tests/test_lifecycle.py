import json
import os
import signal
import subprocess
import sys
import time

import pytest

import dsec

HERE = os.path.dirname(__file__)


def test_request_id_is_exactly_once(sandbox):
    a = sandbox.exec("echo x >> /tmp/once; wc -l < /tmp/once", request_id="t1/0")
    b = sandbox.exec("echo x >> /tmp/once; wc -l < /tmp/once", request_id="t1/0")
    assert not a.replayed and b.replayed
    assert a.stdout == b.stdout == "1\n" and a.seq == b.seq
    with pytest.raises(dsec.Conflict):
        sandbox.exec("something else", request_id="t1/0")
    log = sandbox.log()
    assert [e["requestId"] for e in log if e.get("requestId")] == ["t1/0"]


def test_pause_resume_and_transparent_resume(client, sandbox):
    sandbox.exec("echo kept > /tmp/k")
    assert sandbox.pause().state == "paused"
    assert sandbox.pause().state == "paused"  # idempotent
    assert client.get(sandbox.id).info.state == "paused"
    assert sandbox.exec("cat /tmp/k").stdout == "kept\n"  # resumes transparently
    assert client.get(sandbox.id).info.state == "running"


def test_bulk_by_label(client):
    sbs = client.create(image="busybox", count=3, labels={"job": "bulk"})
    assert len(sbs) == 3
    assert sorted(client.pause(labels={"job": "bulk"})) == sorted(s.id for s in sbs)
    assert {s.state for s in client.list(labels={"job": "bulk"})} == {"paused"}
    client.resume(labels={"job": "bulk"})
    assert {s.state for s in client.list(labels={"job": "bulk"})} == {"running"}
    assert len(client.delete(labels={"job": "bulk"})) == 3
    assert client.list(labels={"job": "bulk"}) == []


def test_create_many_reports_each_item(client):
    res = client.create_many("busybox", 2, labels={"job": "many"})
    assert all(isinstance(r, dsec.Sandbox) for r in res)
    bad = client.create_many("no-such-image", 2)
    assert all(isinstance(r, dsec.NotFound) for r in bad)
    client.delete(labels={"job": "many"})


def test_snapshot_and_fork(client, sandbox):
    sandbox.exec("mkdir -p /repo && echo prepared > /repo/state && rm /bin/vi")
    snap = sandbox.snapshot(name="prepared")
    child = client.create(from_snapshot=snap, labels={"job": "snap"})
    assert child.exec("cat /repo/state").stdout == "prepared\n"
    assert child.exec("test -e /bin/vi").exit_code != 0  # deletions carry over
    kids = client.fork(sandbox, 4, labels={"job": "fork"})
    assert len(kids) == 4
    kids[0].exec("echo mine > /repo/state")
    assert kids[1].exec("cat /repo/state").stdout == "prepared\n"  # own writable layers
    assert any(s.id == snap.id for s in client.snapshots())
    client.delete(labels={"job": "fork"})
    child.close()
    client.delete_snapshot(snap)


def test_session_context_deletes_on_close(client):
    with client.session("py-ctx", heartbeat_s=1) as s:
        sbs = client.create(image="busybox", count=2, session=s)
        assert len(sbs) == 2
    assert client.list(selector="dsec.io/session=py-ctx") == []


def test_create_in_an_unknown_session_is_refused(client):
    with pytest.raises(dsec.NotFound):
        client.create(image="busybox", session="never-opened")


def _run_trainer(server, tmp_path, *extra):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "trainer.py"), "--url", server.url, "--session", "killtest",
         "--state", str(tmp_path / "state.json"), *extra],
        stdout=subprocess.PIPE, text=True)


def test_killed_trainer_is_paused_then_resumed_with_replay(server, client, tmp_path):
    t = _run_trainer(server, tmp_path)
    progress = []
    for line in t.stdout:
        progress.append(json.loads(line))
        if progress[-1].get("step") == 2:
            break
    t.send_signal(signal.SIGKILL)  # mid-rollout: no cleanup runs
    t.wait()
    state = json.load(open(tmp_path / "state.json"))
    done_steps = state["done"]
    ids = state["ids"]
    # After the grace period the session's sandboxes are paused, not gone.
    deadline = time.time() + 20
    while time.time() < deadline:
        states = {client.get(i).info.state for i in ids}
        if states == {"paused"}:
            break
        time.sleep(0.5)
    assert states == {"paused"}, states
    assert int(client.capacity()["running"]) >= 3  # still held, not leaked or lost
    # The restarted trainer resumes them and is fast-forwarded.
    t = _run_trainer(server, tmp_path, "--resume")
    out = [json.loads(line) for line in t.stdout]
    assert t.wait() == 0
    final = out[-1]
    assert final["final"]
    # Every step completed before the kill replays: 100% hits for that prefix.
    assert final["replayed"] >= done_steps * 3
    assert final["replayed"] + final["live"] == 6 * 3
    # Each trace holds each step exactly once: nothing ran twice.
    for trace in final["traces"]:
        assert trace.split() == [f"step{i}" for i in range(6)]
    assert client.list(selector="dsec.io/session=killtest") == []
