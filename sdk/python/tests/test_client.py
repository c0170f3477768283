import io
import os
import threading

import pytest

import dsec


def test_exec_returns_exit_code_output_and_aliases(sandbox):
    r = sandbox.exec("echo out; echo err >&2; exit 3")
    assert r.exit_code == 3 and r.return_code == 3
    assert r.stdout == "out\n" and r.stderr == "err\n"
    assert r.output == "out\nerr\n"
    code, out, err = r
    assert (code, out, err) == (3, "out\n", "err\n")
    assert not r.timed_out and not r.truncated


def test_exec_argv_stdin_env_cwd(sandbox):
    assert sandbox.exec(["cat"], stdin=b"bytes in").stdout == "bytes in"
    assert sandbox.exec("echo $X", env={"X": "42"}).stdout == "42\n"
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_timeout_is_a_result_not_an_exception(sandbox):
    r = sandbox.exec("sleep 30", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 137


def test_output_cap_keeps_head_and_tail(sandbox):
    r = sandbox.exec("echo HEAD; yes | head -c 100000; echo; echo TAIL", max_output_bytes=1000)
    assert r.truncated and len(r.stdout_bytes) == 1000
    assert r.stdout.startswith("HEAD\n") and r.stdout.endswith("TAIL\n")


def test_exec_stream_yields_events_in_order(sandbox):
    kinds = []
    out = b""
    for ev in sandbox.exec_stream("echo a; sleep 0.1; echo b; exit 2"):
        kinds.append(ev.kind)
        if ev.kind == "stdout":
            out += ev.data
        if ev.kind == "exit":
            assert ev.result.exit_code == 2
    assert kinds[0] == "started" and kinds[-1] == "exit"
    assert out == b"a\nb\n"


def test_files_round_trip(sandbox, tmp_path):
    sandbox.write_file("/work/a.txt", "text")
    assert sandbox.read_file("/work/a.txt") == b"text"
    data = os.urandom(3 << 20)
    sandbox.write_file("/work/blob", io.BytesIO(data), mode=0o600)
    assert sandbox.read_file("/work/blob") == data
    assert sandbox.stat("/work/blob").size == len(data)
    assert sandbox.stat("/work/blob").mode == 0o600
    assert sandbox.chmod("/work/blob", 0o640).mode == 0o640
    assert sandbox.exec("stat -c %a /work/blob").stdout.strip() == "640"
    local = tmp_path / "up.bin"
    local.write_bytes(b"upload")
    sandbox.upload(str(local), "/work/up.bin")
    sandbox.download("/work/up.bin", str(tmp_path / "down.bin"))
    assert (tmp_path / "down.bin").read_bytes() == b"upload"
    names = sorted(f.name for f in sandbox.list_dir("/work"))
    assert names == ["a.txt", "blob", "up.bin"]
    assert sandbox.exists("/work/a.txt") and not sandbox.exists("/work/nope")
    sandbox.remove("/work", recursive=True)
    assert not sandbox.exists("/work")


def test_missing_file_is_not_found(sandbox):
    with pytest.raises(dsec.NotFound) as e:
        sandbox.read_file("/no/such/file")
    assert e.value.infra is False


def test_context_manager_and_idempotent_close(client):
    with client.create(image="busybox") as sb:
        assert sb.exec("true").exit_code == 0
    sb.close()
    assert client.get(sb.id).info.state == "deleted"
    with pytest.raises(dsec.NotFound):
        sb.exec("true")


def test_list_by_labels(client):
    a = client.create(image="busybox", labels={"job": "pyjob", "member": "a"})
    b = client.create(image="busybox", labels={"job": "pyjob", "member": "b"})
    try:
        ids = {s.id for s in client.list(labels={"job": "pyjob"})}
        assert ids == {a.id, b.id}
        assert [s.id for s in client.list(labels={"job": "pyjob", "member": "b"})] == [b.id]
        assert [s.id for s in client.list(selector="job=pyjob,member!=b")] == [a.id]
    finally:
        a.close()
        b.close()


def test_typed_errors_carry_infra_flags(client, sandbox):
    with pytest.raises(dsec.NotFound) as e:
        client.create(image="no-such-image")
    assert not e.value.infra and not e.value.retryable
    with pytest.raises(dsec.InvalidRequest):
        client.create(image="busybox", memory_mb=1 << 40)
    with pytest.raises(dsec.NotFound):
        client.get("aaaaaaaaaaaaaaaa-local")


def test_gone_after_ttl_is_infra(client):
    import time

    sb = client.create(image="busybox", ttl_s=1)
    time.sleep(3)
    with pytest.raises(dsec.SandboxGone) as e:
        sb.exec("true")
    assert e.value.infra
    assert not sb.alive()


def test_unreachable_server_is_infra():
    c = dsec.Client("http://127.0.0.1:1")
    with pytest.raises(dsec.ConnectionFailed) as e:
        c.list()
    assert e.value.infra and e.value.retryable


def test_client_is_shared_between_threads(client, sandbox):
    errors = []

    def work(i):
        try:
            r = sandbox.exec(["echo", str(i)])
            assert r.stdout == f"{i}\n"
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_keepalive_extends(sandbox):
    info = sandbox.keepalive(extend_ttl_s=3600)
    assert info.state == "running" and info.expires_at


def test_screen_calls_need_a_kind_with_a_screen(sandbox):
    # Containers have no screen (kind vm does: test/e2e drives one).
    with pytest.raises(dsec.Unimplemented) as e:
        sandbox.screenshot()
    assert not e.value.infra
    with pytest.raises(dsec.Unimplemented):
        sandbox.type_text("ls\n")
    with pytest.raises(dsec.InvalidRequest):
        sandbox.input()
