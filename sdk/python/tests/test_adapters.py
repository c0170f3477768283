"""Each adapter driven the way its framework's code calls it."""

import asyncio
import os

import pytest

import dsec
from dsec.adapters import harbor, open_instruct, rllm, swerex, tinker, verl


def test_tinker_sandbox_interface(client):
    async def rollout():
        sb = await tinker.DsecSandbox.create(client, image="debian")
        assert sb.sandbox_id
        await sb.send_heartbeat(timeout=30)
        await sb.write_file("/workspace/run.sh", "echo from-script", executable=True)
        res = await sb.run_command("/workspace/run.sh && pwd", workdir="/tmp", timeout=60)
        assert isinstance(res, tinker.SandboxResult) and res.exit_code == 0
        assert res.stdout == "from-script\n/tmp\n"
        assert (await sb.read_file("/workspace/run.sh")) == "echo from-script"
        fail = await sb.run_command("exit 3")
        assert fail.exit_code == 3
        await sb.cleanup()
        await sb.cleanup()  # idempotent, never raises after the end
        with pytest.raises(tinker.SandboxTerminatedError):
            await sb.run_command("true")

    asyncio.run(rollout())


def test_tinker_factory_uploads_env_dir(client, tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("echo ok")
    factory = tinker.sandbox_factory(client, image="debian")

    async def go():
        sb = await factory(str(tmp_path), 600)
        res = await sb.run_command("bash /workspace/tests/test.sh")
        await sb.cleanup()
        return res

    assert asyncio.run(go()).stdout == "ok\n"


def test_open_instruct_backend():
    b = open_instruct.DsecBackend(image="debian", client=dsec.Client(os.environ["DSEC_URL"]))
    b.start()
    try:
        r = b.run_command("cd /tmp && export X=7")
        assert isinstance(r, open_instruct.ExecutionResult) and r.exit_code == 0
        r = b.run_command("echo $X; pwd; ls /nope")
        assert r.stdout.splitlines()[:2] == ["7", "/tmp"] and r.exit_code != 0  # state persists
        b.write_file("/tmp/f.bin", b"\x00\x01")
        assert b.read_file("/tmp/f.bin", binary=True) == b"\x00\x01"
        b.write_file("/tmp/f.txt", "text")
        assert b.read_file("/tmp/f.txt") == "text"
        with pytest.raises(FileNotFoundError):
            b.read_file("/tmp/missing")
    finally:
        b.close()
    b.close()


def test_rllm_sandbox(client, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("x")
    (tmp_path / "top.txt").write_text("top")
    sb = rllm.create_sandbox(backend="dsec", task={"image": "debian"}, client=client)
    try:
        assert sb.is_alive()
        assert sb.exec("echo hi") == "hi\n"
        with pytest.raises(rllm.CommandFailed) as e:
            sb.exec("echo oops >&2; exit 4")
        assert e.value.exit_code == 4
        sb.upload_file(str(tmp_path / "top.txt"), "/task/top.txt")
        sb.upload_dir(str(tmp_path), "/task2")
        assert sb.exec("cat /task/top.txt /task2/a/x.txt") == "topx"
    finally:
        sb.close()
    assert sb.is_alive() is False  # never raises


def test_harbor_environment(client, tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")

    async def trial():
        env = harbor.DsecEnvironment(image="debian", client=client, cpus=1, memory_mb=512)
        await env.preflight()
        assert env.can_disable_internet and not env.supports_gpus
        await env.start(force_build=False)
        r = await env.exec("echo $GREETING; pwd", cwd="/tmp", env={"GREETING": "hello"}, timeout_sec=30)
        assert isinstance(r, harbor.ExecResult) and r.return_code == 0 and r.stdout == "hello\n/tmp\n"
        await env.upload_dir(str(tmp_path / "tests"), "/tests")
        assert await env.is_file("/tests/test.sh") and await env.is_dir("/tests")
        await env.exec("bash /tests/test.sh")
        await env.download_file("/logs/verifier/reward.txt", str(tmp_path / "reward.txt"))
        await env.download_dir("/logs", str(tmp_path / "logs"))
        await env.stop(delete=True)
        return (tmp_path / "reward.txt").read_text(), (tmp_path / "logs" / "verifier" / "reward.txt").read_text()

    assert asyncio.run(trial()) == ("1\n", "1\n")


def test_swerex_runtime_sessions(client):
    async def agent():
        rt = swerex.DsecRuntime(image="debian", client=client)
        assert await rt.is_alive()
        await rt.create_session(swerex.CreateBashSessionRequest(session="main"))
        await rt.run_in_session(swerex.BashAction(command="mkdir -p /repo && cd /repo && export TOKEN=abc", session="main"))
        obs = await rt.run_in_session(swerex.BashAction(command="echo $TOKEN; pwd", session="main"))
        assert obs.output == "abc\n/repo\n" and obs.exit_code == 0
        obs = await rt.run_in_session(swerex.BashAction(command="false", session="main"))
        assert obs.exit_code == 1
        with pytest.raises(swerex.NonZeroExitCodeError):
            await rt.run_in_session(swerex.BashAction(command="exit_with() { return 2; }; exit_with", session="main", check="raise"))
        with pytest.raises(swerex.CommandTimeoutError):
            await rt.run_in_session(swerex.BashAction(command="sleep 30", session="main", timeout=1))
        r = await rt.execute(swerex.Command(command="echo out; echo err >&2", shell=True))
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
        await rt.write_file("/repo/a.py", "print(1)")
        assert await rt.read_file("/repo/a.py") == "print(1)"
        await rt.close()

    asyncio.run(agent())


def test_verl_tool_and_reward_url(client, server):
    assert verl.sandbox_fusion_url(server.url) == server.url + "/run_code"

    async def trajectory():
        tool = verl.DsecTool(config={"url": server.url, "image": "debian", "timeout": 10})
        assert tool.get_openai_tool_schema()["function"]["name"] == "code_interpreter"
        iid, _ = await tool.create()
        r1, reward, m1 = await tool.execute(iid, {"code": "open('/tmp/state','w').write('kept'); print(6*7)"})
        r2, _, m2 = await tool.execute(iid, {"code": "print(open('/tmp/state').read())"})
        await tool.release(iid)
        return r1.text, r2.text, reward

    t1, t2, reward = asyncio.run(trajectory())
    assert t1 == "42\n" and t2 == "kept\n" and reward == 0.0
