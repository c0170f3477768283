"""The tinker-cookbook adapter driven as harbor_rl drives a SandboxFactory:
the factory pickled with its EnvGroupBuilder, ``await factory(env_dir,
sandbox_timeout)`` once per group member, the bash tool's
``run_command(command, workdir="/", timeout=, max_output_bytes=)``, the
reward's upload of tests/ with ``write_file(..., executable=)``, ``bash
/tests/test.sh`` from /root, ``read_file`` of reward.txt then reward.json,
and ``cleanup`` of every sandbox. tinker-cookbook is not installed here:
SandboxResult and SandboxTerminatedError are the adapter's stand-ins with
tinker's fields and base classes."""

import asyncio
import json
import pickle

import pytest

from dsec.adapters import tinker
from dsec.adapters._common import UnsupportedOption

MAX_OUTPUT_CHARS = 4096  # harbor_tools' cap is its own constant; any value exercises the call


def make_task(root):
    env = root / "environment"
    tests = root / "tests"
    (tests / "fixtures").mkdir(parents=True)
    env.mkdir()
    (env / "Dockerfile").write_text("FROM debian\nWORKDIR /work\nCOPY data.txt /work/data.txt\nRUN chmod 600 /work/data.txt\n")
    (env / "data.txt").write_text("3 4\n")
    (tests / "test.sh").write_text(
        "[ \"$PWD\" = / ] && exit 1\n"
        "set -- $(cat /work/data.txt)\n"
        "if [ \"$(cat /work/answer 2>/dev/null)\" = $(( $1 + $2 )) ] && [ -f /tests/fixtures/expected ]; then\n"
        "  echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    (tests / "fixtures" / "expected").write_text("7\n")
    return root


async def bash_tool(sandbox, command):
    """HarborBashTool.bash: the JSON the model sees."""
    r = await sandbox.run_command(command, workdir="/", timeout=30, max_output_bytes=MAX_OUTPUT_CHARS)
    return json.dumps({"exit_code": r.exit_code, "stdout": r.stdout[:MAX_OUTPUT_CHARS], "stderr": r.stderr[:MAX_OUTPUT_CHARS]})


async def reward(sandbox, tests_dir):
    """HarborReward.__call__: upload tests/, run test.sh from /root, parse the reward file."""
    await sandbox.run_command("mkdir -p /tests", workdir="/")
    for f in sorted(tests_dir.rglob("*")):
        if f.is_file():
            await sandbox.write_file(f"/tests/{f.relative_to(tests_dir)}", f.read_text(), executable=f.suffix == ".sh")
    await sandbox.run_command("mkdir -p /logs/verifier", workdir="/root")
    await sandbox.run_command("bash /tests/test.sh", workdir="/root", timeout=60)
    r = await sandbox.read_file("/logs/verifier/reward.txt")
    if r.exit_code == 0 and r.stdout.strip():
        return float(r.stdout.strip())
    r = await sandbox.read_file("/logs/verifier/reward.json")
    if r.exit_code == 0 and r.stdout.strip():
        return float(json.loads(r.stdout).get("reward", 0.0))
    return 0.0


def test_a_harbor_rl_group_builds_once_runs_the_bash_tool_and_scores(server, client, tmp_path):
    task = make_task(tmp_path / "task")
    factory = pickle.loads(pickle.dumps(tinker.sandbox_factory(build_network="none", network="none")))

    async def group():
        sandboxes = [await factory(task / "environment", 600) for _ in range(3)]
        try:
            out = json.loads(await bash_tool(sandboxes[0], "cd /work && cat data.txt && pwd && ls /nope"))
            assert out["exit_code"] == 2 and out["stdout"] == "3 4\n/work\n" and "/nope" in out["stderr"]
            out = json.loads(await bash_tool(sandboxes[0], "echo $PWD"))
            assert out["stdout"] == "/\n"  # workdir="/" as the tool passes it
            big = json.loads(await bash_tool(sandboxes[0], "head -c 100000 /dev/zero | tr '\\0' x"))
            assert len(big["stdout"]) <= MAX_OUTPUT_CHARS
            for sb in sandboxes[:2]:
                await sb.run_command("echo 7 > /work/answer")
            await sandboxes[2].send_heartbeat(timeout=30)
            return [await reward(sb, task / "tests") for sb in sandboxes]
        finally:
            for sb in sandboxes:
                await sb.cleanup()

    before = len([i for i in client.images() if i["name"].startswith("tinker-build-")])
    assert asyncio.run(group()) == [1.0, 1.0, 0.0]
    assert len([i for i in client.images() if i["name"].startswith("tinker-build-")]) == before + 1


def test_files_and_errors_come_back_as_tinkers_results(server, tmp_path):
    async def go():
        sb = await tinker.DsecSandbox.create(image="debian", ttl_s=600)
        try:
            w = await sb.write_file("/workspace/run.sh", "echo from-script", executable=True)
            assert isinstance(w, tinker.SandboxResult) and w.exit_code == 0
            r = await sb.run_command("/workspace/run.sh && pwd", workdir="/tmp")
            assert (r.stdout, r.exit_code) == ("from-script\n/tmp\n", 0)
            r = await sb.read_file("/workspace/run.sh")
            assert (r.stdout, r.stderr, r.exit_code) == ("echo from-script", "", 0)
            r = await sb.read_file("/workspace/run.sh", max_bytes=4)
            assert r.stdout == "echo"
            missing = await sb.read_file("/nope/reward.json")
            assert missing.exit_code != 0 and "/nope/reward.json" in missing.stderr
            r = await sb.run_command("sleep 30", timeout=1)
            assert r.exit_code != 0 and r.metrics["timed_out"]
        finally:
            await sb.cleanup()
        await sb.cleanup()  # idempotent
        with pytest.raises(tinker.SandboxTerminatedError):
            await sb.run_command("true")
        with pytest.raises(tinker.SandboxTerminatedError):
            await sb.read_file("/workspace/run.sh")
        with pytest.raises(tinker.SandboxTerminatedError):
            await sb.send_heartbeat()

    asyncio.run(go())
    assert issubclass(tinker.SandboxTerminatedError, RuntimeError)


def test_an_environment_without_a_dockerfile_needs_an_image(server, tmp_path):
    (tmp_path / "env").mkdir()
    with pytest.raises(UnsupportedOption, match="without a Dockerfile"):
        asyncio.run(tinker.sandbox_factory()(tmp_path / "env", 60))

    async def go():
        sb = await tinker.sandbox_factory(image="python:3.12-slim", image_map={"python:3.12-slim": "debian"},
                                          network="none")(tmp_path / "env", 60)
        try:
            return (await sb.run_command("python3 -c 'print(1)'")).stdout
        finally:
            await sb.cleanup()

    assert asyncio.run(go()) == "1\n"
