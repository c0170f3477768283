"""The native asyncio client: calls in flight without threads, cancellation
that ends the remote process, backpressure, shell sessions across loops."""

import asyncio
import resource
import threading

import pytest

import dsec


def run(coro):
    return asyncio.run(coro)


def gone(pid):
    """A command that exits 0 once process pid is gone (a killed process is
    a zombie until the sandbox's init reaps it), 1 if it is still there
    after 5 s."""
    return f"for i in $(seq 50); do kill -0 {pid} 2>/dev/null || exit 0; sleep 0.1; done; exit 1"


@pytest.fixture()
def ac(server):
    return dsec.AsyncClient(server.url)


def test_a_hundred_calls_are_in_flight_at_once_without_threads(ac, sandbox):
    # Each call waits for /tmp/go, which the test creates only once all 100
    # calls have announced themselves: a client with fewer than 100 calls in
    # flight would never get there.
    n = 100
    sandbox.exec("mkdir -p /tmp/b")
    threads_before = threading.active_count()

    async def go():
        sb = ac.sandbox(sandbox.id)
        calls = [asyncio.ensure_future(sb.exec(f"touch /tmp/b/{i}; until [ -e /tmp/go ]; do sleep 0.2; done; echo {i}", timeout_s=60))
                 for i in range(n)]
        for _ in range(300):
            if len(await sb.list_dir("/tmp/b")) == n:
                break
            await asyncio.sleep(0.1)
        peak_threads = threading.active_count()
        await sb.exec("touch /tmp/go")
        results = await asyncio.gather(*calls)
        return results, peak_threads

    results, peak_threads = run(go())
    assert sorted(int(r.stdout) for r in results) == list(range(n))
    assert all(r.exit_code == 0 for r in results)
    assert peak_threads == threads_before  # no thread per call


def test_cancelling_an_exec_kills_its_process(ac, sandbox):
    async def go():
        sb = ac.sandbox(sandbox.id)
        call = asyncio.ensure_future(sb.exec("echo $$ > /tmp/pid; exec sleep 300"))
        for _ in range(100):
            if await sb.exists("/tmp/pid"):
                break
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return await sb.exec(gone("$(cat /tmp/pid)"))

    assert run(go()).exit_code == 0


def test_a_timed_out_call_kills_its_process_too(ac, sandbox):
    async def go():
        sb = ac.sandbox(sandbox.id)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sb.exec("echo $$ > /tmp/pid2; exec sleep 300"), 1.0)
        return await sb.exec(gone("$(cat /tmp/pid2)"))

    assert run(go()).exit_code == 0


def test_leaving_a_stream_early_kills_its_process(ac, sandbox):
    async def go():
        sb = ac.sandbox(sandbox.id)
        pid = None
        async with sb.exec_stream("echo $$; exec sleep 300") as events:
            async for ev in events:
                if ev.kind == "stdout":
                    pid = ev.data.decode().strip()
                    break
        return await sb.exec(gone(pid))

    assert run(go()).exit_code == 0


def test_an_unread_stream_is_not_read_ahead(ac, sandbox):
    # Backpressure: the client reads a stream only as its consumer asks. The
    # sandbox's agent spools the 256 MiB the command writes; the client,
    # not being read from, holds a socket buffer's worth, not the output.
    async def go():
        sb = ac.sandbox(sandbox.id)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stream = sb.exec_stream("head -c 268435456 /dev/zero; echo done")
        async for ev in stream:
            if ev.kind == "stdout":
                break
        await asyncio.sleep(3)  # the command is done by now (the agent spools)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        await stream.aclose()
        return grown

    assert run(go()) < 64 << 10  # KiB: far from the 256 MiB (and 340 MiB of base64) a read-ahead would hold


def test_results_and_errors_match_the_sync_client(ac, sandbox):
    async def go():
        sb = ac.sandbox(sandbox.id)
        r = await sb.exec("echo out; echo err >&2; exit 3")
        t = await sb.exec("sleep 30", timeout_s=0.5)
        cap = await sb.exec("echo HEAD; yes | head -c 100000; echo; echo TAIL", max_output_bytes=1000)
        await sb.write_file("/w/a.txt", "text", mode=0o600)
        with pytest.raises(dsec.NotFound):
            await sb.read_file("/no/such/file")
        with pytest.raises(dsec.NotFound):
            await ac.sandbox("aaaaaaaaaaaaaaaa-local").exec("true")
        return r, t, cap, await sb.read_file("/w/a.txt"), await sb.stat("/w/a.txt")

    r, t, cap, data, st = run(go())
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert t.timed_out and t.exit_code == 137
    assert cap.truncated and len(cap.stdout_bytes) == 1000
    assert cap.stdout.startswith("HEAD\n") and cap.stdout.endswith("TAIL\n")
    assert data == b"text" and st.mode == 0o600
    assert sandbox.exec("cat /w/a.txt").stdout == "text"


def test_request_ids_replay_through_the_async_client(ac, sandbox):
    async def go():
        sb = ac.sandbox(sandbox.id)
        a = await sb.exec("echo x >> /tmp/n; wc -l < /tmp/n", request_id="r/1")
        b = await sb.exec("echo x >> /tmp/n; wc -l < /tmp/n", request_id="r/1")
        return a, b

    a, b = run(go())
    assert (a.stdout, a.replayed) == ("1\n", False)
    assert (b.stdout, b.replayed) == ("1\n", True)


def test_a_shell_session_survives_an_interrupt_and_changes_of_loop(ac, server):
    sb = run(ac.create(image="debian", ttl_s=600))

    async def first():
        sh = await sb.shell("s", split_stderr=True)
        assert await sh.run_split("cd /etc && export X=7; echo e >&2") == ("", "e\n", 0)
        with pytest.raises(dsec.DeadlineExceeded):
            await sh.run("sleep 60", timeout=1)
        return sh

    sh = run(first())

    async def second():  # a new event loop, as SWE-agent's asyncio.run per call
        out = await sh.run_split("echo $X; pwd; ls /nope")
        await sh.close()
        await sb.close()
        return out

    out, err, code = run(second())
    assert (out, code) == ("7\n/etc\n", 2) and "/nope" in err
