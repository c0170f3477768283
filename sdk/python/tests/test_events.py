"""Lifecycle events through the Python SDK against a real server."""

import threading
import time
from datetime import datetime

import pytest

import dsec


def test_events_follow_a_sandbox_and_leave_others_out(client):
    job = f"events-{time.monotonic_ns()}"
    with client.events({"job": job}) as stream:
        sb = client.create(image="busybox", labels={"job": job}, ttl_s=600)
        other = client.create(image="busybox", labels={"job": job + "-not"}, ttl_s=600)
        sb.pause()
        sb.resume()
        sb.close()
        seen = []
        for ev in stream:
            assert ev.sandbox_id == sb.id, f"an event of another sandbox: {ev}"
            seen.append(ev)
            if ev.type == "ended":
                break
        other.close()
    assert [e.type for e in seen] == ["created", "paused", "resumed", "ended"]
    created, ended = seen[0], seen[-1]
    assert created.labels["job"] == job and created.kind == "container" and created.state == "running"
    assert ended.cause == "deleted" and not ended.infra and ended.state == "deleted" and ended.reason
    gone = client.get(sb.id).info
    assert gone.end_cause == "deleted" and not gone.infra and gone.ended_at
    # The runs that stopped: the first from the create to the pause, the
    # second from the resume to the end, each with the sandbox's limits.
    paused, resumed = seen[1], seen[2]
    assert not created.run and not resumed.run
    for ev, start_after in ((paused, created.at), (ended, resumed.at)):
        assert ev.run["cpu"] == 1 and int(ev.run["memoryMb"]) == 512 and int(ev.run.get("durationMs", 0)) >= 0, ev.run
        assert ev.run["startedAt"] >= start_after[:19], (ev.run, start_after)


def test_a_stream_runs_beside_the_clients_other_calls(client):
    """The stream has its own connection: the same thread and others go on
    calling while it is open, and a thread can wait on it."""
    job = f"events-thread-{time.monotonic_ns()}"
    got = []
    stream = client.events({"job": job}, types=["ended"])

    def consume():
        for ev in stream:
            got.append(ev)
            return

    t = threading.Thread(target=consume)
    t.start()
    sb = client.create(image="busybox", labels={"job": job}, ttl_s=600)
    assert sb.exec("echo hi").stdout == "hi\n"
    sb.close()
    t.join(30)
    stream.close()
    assert not t.is_alive() and len(got) == 1 and got[0].sandbox_id == sb.id and got[0].type == "ended"


def test_a_bad_subscription_is_refused_at_once(client):
    with pytest.raises(dsec.InvalidRequest):
        client.events(types=["exploded"])
    with pytest.raises(dsec.InvalidRequest):
        client.events(selector="bad key=1")


def test_stats_history(sandbox):
    now = sandbox.stats()
    assert now.memory_limit_mb > 0 and now.history == []
    deadline = time.monotonic() + 60
    while True:
        st = sandbox.stats(history=True)
        if len(st.history) >= 2:
            break
        assert time.monotonic() < deadline, "the node kept no two samples within a minute"
        time.sleep(1)
    assert all(s.at and s.memory_bytes > 0 for s in st.history)
    times = [datetime.fromisoformat(s.at.replace("Z", "+00:00")) for s in st.history]
    assert times == sorted(times) and len(set(times)) == len(times)
