"""on_timeout="pause": reaching the TTL pauses a sandbox instead of ending it."""

import datetime
import time

import pytest

import dsec


def _until(what, cond, timeout_s=30.0):
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def _seconds_left(info):
    end = datetime.datetime.fromisoformat(info.expires_at.replace("Z", "+00:00"))
    return (end - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


def test_the_ttl_pauses_and_a_call_resumes_with_its_state_and_a_fresh_ttl(client):
    sb = client.create(image="busybox", ttl_s=3, on_timeout="pause", labels={"test": "on-timeout"})
    try:
        assert sb.info.on_timeout == "pause"
        sb.exec("echo kept > /tmp/k")
        _until("the TTL pauses the sandbox", lambda: client.get(sb.id).info.state == "paused")
        info = client.get(sb.id).info
        assert "on_timeout pause" in info.reason
        assert _seconds_left(info) > 3600  # kept for the node's paused_ttl (24 h), not ended
        assert sb.exec("cat /tmp/k").stdout == "kept\n"  # a call resumes it
        info = client.get(sb.id).info
        assert info.state == "running" and info.reason == ""
        assert 0 < _seconds_left(info) <= 3  # its TTL again, from the resume
    finally:
        sb.close()


def test_a_session_expiry_still_deletes_a_sandbox_paused_at_its_ttl(client):
    s = client.session("py-on-timeout", heartbeat_s=1, grace_s=1, on_expire="delete")
    try:
        sb = client.create(image="busybox", ttl_s=1, on_timeout="pause", session=s)
        _until("the TTL pauses the sandbox", lambda: client.get(sb.id).info.state == "paused")
        s.stop_heartbeats()
        _until("the session's expiry deletes it", lambda: client.get(sb.id).info.state == "deleted")
        _until("it is no longer listed", lambda: client.list(selector="dsec.io/session=py-on-timeout") == [])
        info = client.get(sb.id).info
        assert info.end_cause == "session_expired" and not info.infra
        assert info.reason == "its trainer session expired (on_expire: delete)"
    finally:
        s.close(delete_sandboxes=True)


def test_a_policy_the_server_does_not_know_is_refused(client):
    with pytest.raises(dsec.InvalidRequest):
        client.create(image="busybox", on_timeout="hibernate")


def _boot_id(sb):
    return sb.exec("cat /proc/sys/kernel/random/boot_id").stdout.strip()


def test_a_filesystem_only_pause_keeps_the_files_and_the_resume_boots_afresh(client):
    sb = client.create(image="busybox", labels={"test": "fs-pause"})
    try:
        sb.exec("echo kept > /root/k")
        before = _boot_id(sb)
        assert sb.pause(keep_memory=False).state == "paused"
        assert sb.resume().state == "running"
        assert sb.exec("cat /root/k").stdout == "kept\n"
        after = _boot_id(sb)
        assert after != before
        # The bulk form, for a preempted job's sandboxes.
        assert client.pause({"test": "fs-pause"}, keep_memory=False) == [sb.id]
        assert sb.exec("cat /root/k").stdout == "kept\n"  # a call resumes (boots) it
        assert _boot_id(sb) != after
    finally:
        sb.close()


def test_the_ttl_pauses_filesystem_only_with_pause_filesystem(client):
    sb = client.create(image="busybox", ttl_s=2, on_timeout="pause_filesystem")
    try:
        before = _boot_id(sb)
        sb.exec("echo kept > /root/k")
        _until("the TTL pauses the sandbox", lambda: client.get(sb.id).info.state == "paused")
        assert "on_timeout pause_filesystem" in client.get(sb.id).info.reason
        assert sb.exec("cat /root/k").stdout == "kept\n"
        assert _boot_id(sb) != before
    finally:
        sb.close()
