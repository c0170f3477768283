"""The ROCK adapter driven as ROLL drives ROCK's ``Sandbox``: every call in
its own ``asyncio.run`` (ROLL's managers are synchronous), with the argument
shapes of

- ``roll/pipeline/agentic/env/rock/sandbox_manager_v2.py`` (SandboxManagerV2:
  ``start_sandbox``, ``create_session``, ``run_in_session`` with its own
  ``asyncio.wait_for`` and ``execute_enable``, ``_setup_speedup``,
  ``upload_file``, ``run_session_with_timeout``/``_extract_pid``/
  ``is_process_running``/``read_content``, ``stop_sandbox``),
- ``roll/pipeline/agentic/env/sandbox/sokoban_sandbox_env.py``
  (``_lazy_init``, ``_wait_for_sandbox_alive``, ``_wait_for_server``,
  ``_execute_command``, ``close``),
- ``roll/pipeline/agentic/agent_runner/rock/rock_agent_runner.py`` (the
  reward report found with ``execute(Command([...find...]))`` and read with
  ``read_file(ReadFileRequest)``) and ``pull_runner.py`` (``arun`` without a
  session),

all at alibaba/ROLL 8eb27cc2dc34. ROCK is not installed here: the config,
request and response models are the adapter's stand-ins with ROCK
4889118bde2d's fields, and the exceptions ROCK's."""

import asyncio
import json
import re
import time

import pytest

from dsec.adapters import rock as rk
from dsec.adapters._common import UnsupportedOption


def run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def started(server):
    """Sandboxes a test starts, stopped at its end whatever happens."""
    made = []
    yield made
    for sb in made:
        run(sb.stop())


def roll_run_in_session(sandbox, command, session, timeout=60.0, execute_enable=False):
    """SandboxManagerV2.run_in_session's call, without its retries: ROLL
    bounds the call itself with asyncio.wait_for, and with execute_enable
    runs the command through execute() as ``/bin/bash -c``."""

    async def go():
        if execute_enable:
            rsp = await sandbox.execute(rk.Command(command=["/bin/bash", "-c", command]))
            return rk.BashObservation(output=rsp.stdout, exit_code=rsp.exit_code, failure_reason=rsp.stderr)
        return await sandbox.run_in_session(rk.BashAction(session=session, command=command, check="silent"))

    return run(asyncio.wait_for(go(), timeout=timeout))


def roll_extract_pid(output):
    """SandboxManagerV2._extract_pid: the PID on bash's "[N] PID" line."""
    lines = output.splitlines()
    m = re.match(r"\[\d+\]\s+(\d+)$", lines[-1].strip()) if lines else None
    return m.group(1) if m else ""


def test_roll_sandbox_manager_v2_runs_an_agent_session_and_a_test_run(started, server, client, tmp_path):
    # start_sandbox: ROLL's config, its keywords and values (base_url names the dsec server).
    config = rk.SandboxConfig(base_url=server.url, image="debian", auto_clear_seconds=60 * 60,
                              startup_timeout=600.0, user_id="0000", experiment_id="test", xrl_authorization="")
    sandbox = rk.Sandbox(config)
    started.append(sandbox)
    run(sandbox.start())
    assert sandbox.sandbox_id and sandbox.host_ip  # ROLL treats a start without host_ip as failed
    info = client.get(sandbox.sandbox_id).info
    assert info.labels["rock-experiment-id"] == "test" and info.labels["rock-user-id"] == "0000"
    assert run(sandbox.is_alive()).is_alive

    # create_session
    run(sandbox.create_session(rk.CreateBashSessionRequest(
        session="agent", startup_source=["/root/.bashrc"], env_enable=True,
        env={"HOME": "/root", "IFLOW_ENV": "train", "DISABLE_SEND_PV": "1", "HF_ENDPOINT": "https://hf-mirror.com",
             "UV_INDEX_URL": "https://mirrors.aliyun.com/pypi/simple/"})))
    r = roll_run_in_session(sandbox, "echo $IFLOW_ENV $HOME", "agent")
    assert (r.exit_code, r.output) == (0, "train /root")
    # ROCK sessions keep state between commands.
    roll_run_in_session(sandbox, "cd /tmp && export STEP=1", "agent")
    assert roll_run_in_session(sandbox, "echo $STEP; pwd", "agent").output == "1\n/tmp"

    # _setup_speedup: APT and PIP mirrors; a failure is only logged by ROLL.
    apt = run(sandbox.network.speedup(speedup_type=rk.SpeedupType.APT,
                                      speedup_value="http://mirrors.cloud.aliyuncs.com", timeout=300))
    assert apt.exit_code == 0, apt
    grep = roll_run_in_session(sandbox, "grep -rh mirrors.cloud.aliyuncs.com /etc/apt/ | head -1", "agent")
    assert "mirrors.cloud.aliyuncs.com" in grep.output
    pip = run(sandbox.network.speedup(speedup_type=rk.SpeedupType.PIP,
                                      speedup_value="http://mirrors.cloud.aliyuncs.com/pypi/simple/", timeout=60))
    assert pip.exit_code == 0 or pip.failure_reason == "Precheck failed", pip

    # run_tests: a test session, the test files uploaded, run in the background, polled, read.
    run(sandbox.create_session(rk.CreateBashSessionRequest(session="test", startup_source=["/root/.bashrc"],
                                                           env_enable=True, env={"HOME": "/root"})))
    test_dir = "/tests"
    assert roll_run_in_session(sandbox, f"mkdir -p {test_dir}", "test").exit_code == 0
    script = tmp_path / "run-tests.sh"
    script.write_text("#!/bin/bash\necho 'test session starts'\nsleep 2\necho 'test_add PASSED'\n")
    resp = run(sandbox.upload_by_path(str(script), f"{test_dir}/run-tests.sh"))
    assert (resp.success, resp.message) == (True, f"Successfully uploaded file run-tests.sh to {test_dir}/run-tests.sh")
    missing = run(sandbox.upload_by_path(str(tmp_path / "nope.sh"), f"{test_dir}/nope.sh"))
    assert missing.success is False and "File not found" in missing.message
    pwd = roll_run_in_session(sandbox, "pwd", "test")
    assert pwd.exit_code == 0
    cwd = pwd.output.strip()
    assert roll_run_in_session(sandbox, f"chmod +x {test_dir}/run-tests.sh", "test").exit_code == 0
    roll_run_in_session(sandbox, f"cd {cwd}", "test")
    # run_session_with_timeout
    response = roll_run_in_session(sandbox, f"nohup bash {test_dir}/run-tests.sh < /dev/null > test.txt 2>&1 &",
                                   "test")
    assert response.exit_code == 0
    pid = roll_extract_pid(response.output)
    assert pid, response.output
    deadline = time.time() + 60
    while roll_run_in_session(sandbox, f"kill -0 {pid}", "test").exit_code == 0:  # is_process_running
        assert time.time() < deadline, "the test script did not finish"
        time.sleep(0.5)
    content = roll_run_in_session(sandbox, "head -c 10485760 test.txt", "test", execute_enable=True)  # read_content
    assert content.exit_code == 0 and "test_add PASSED" in content.output

    # A command past ROLL's own wait_for is cut short; the session goes on.
    with pytest.raises(asyncio.TimeoutError):
        roll_run_in_session(sandbox, "sleep 30", "agent", timeout=2)
    assert roll_run_in_session(sandbox, "echo back; echo $STEP", "agent").output == "back\n1"
    # A BashAction's own timeout raises CommandTimeout: ROCK's CommandRockError and a TimeoutError.
    with pytest.raises(rk.CommandTimeout) as e:
        run(sandbox.run_in_session(rk.BashAction(session="agent", command="sleep 30", timeout=1, check="silent")))
    assert isinstance(e.value, rk.CommandRockError) and isinstance(e.value, asyncio.TimeoutError)
    assert roll_run_in_session(sandbox, "echo again", "agent").output == "again"
    # check="raise" (BashAction's default) raises on a non-zero exit; "ignore" gives no exit code.
    with pytest.raises(rk.CommandRockError):
        run(sandbox.run_in_session(rk.BashAction(session="agent", command="ls /nope")))
    assert run(sandbox.run_in_session(rk.BashAction(session="agent", command="false", check="ignore"))).exit_code is None
    with pytest.raises(rk.CommandRockError, match="syntax error"):
        run(sandbox.run_in_session(rk.BashAction(session="agent", command="echo 'unterminated", check="silent")))
    with pytest.raises(rk.BadRequestRockError):
        run(sandbox.run_in_session(rk.BashAction(session="nosuch", command="true", check="silent")))
    with pytest.raises(rk.BadRequestRockError):  # a session name is taken once
        run(sandbox.create_session(rk.CreateBashSessionRequest(session="agent")))

    # rock_agent_runner: the evaluation report, found with execute() and read with read_file().
    report = {"tests_status": {"FAIL_TO_PASS": {"success": ["t1"], "failure": []}}}
    job_dir = "/jobs/job1"
    w = run(sandbox.write_file(rk.WriteFileRequest(content=json.dumps(report),
                                                   path=f"{job_dir}/trial/verifier/evaluation/report.json")))
    assert w.success
    find_result = run(sandbox.execute(rk.Command(command=["find", job_dir, "-path",
                                                          "*/verifier/evaluation/report.json"])))
    files = [line.strip() for line in (find_result.stdout or "").strip().split("\n") if line.strip()]
    assert files == [f"{job_dir}/trial/verifier/evaluation/report.json"]
    response = run(sandbox.read_file(rk.ReadFileRequest(path=files[0])))
    assert json.loads(response.content) == report
    with pytest.raises(FileNotFoundError):
        run(sandbox.read_file(rk.ReadFileRequest(path=f"{job_dir}/missing.json")))
    # execute: no shell, env added to the environment, cwd honoured.
    r = run(sandbox.execute(rk.Command(command=["sh", "-c", "echo $ROCK_X; pwd; echo err >&2"],
                                       env={"ROCK_X": "y"}, cwd="/jobs")))
    assert (r.stdout, r.stderr, r.exit_code) == ("y\n/jobs\n", "err\n", 0)

    # stop_sandbox
    run(sandbox.close_session(rk.CloseBashSessionRequest(session="test")))
    sid = sandbox.sandbox_id
    run(sandbox.stop())
    run(sandbox.stop())  # idempotent, never raises
    assert sandbox.sandbox_id == sid  # ROLL logs it after the stop
    assert all(s.id != sid for s in client.list(labels={"rock-experiment-id": "test"}))


def test_roll_sokoban_env_runs_a_server_session_and_client_commands(started, server):
    # SokobanSandboxEnv.__init__: its image is ROCK's registry's; image_map names dsec's.
    config = rk.SandboxConfig(base_url=server.url,
                              image="rock-n-roll-registry.cn-hangzhou.cr.aliyuncs.com/rock/sokoban-sandbox:latest",
                              auto_clear_seconds=60 * 120, startup_timeout=360)
    sandbox = rk.Sandbox(config, image_map={config.image: "debian"})
    started.append(sandbox)
    # _lazy_init
    run(sandbox.start())
    assert sandbox._sandbox_id == sandbox.sandbox_id and sandbox._host_name and sandbox._host_ip
    status = run(sandbox.get_status())  # _wait_for_sandbox_alive
    assert status.is_alive and status.sandbox_id == sandbox.sandbox_id and status.state == "running"
    session = run(sandbox.create_session(rk.CreateBashSessionRequest(session="default")))
    assert isinstance(session, rk.CreateBashSessionResponse)
    run(sandbox.create_session(rk.CreateBashSessionRequest(session="server_session")))
    # The game server: a background process in its own session (here: a file it keeps current).
    w = run(sandbox.write_file_by_path(
        "import json, time\nn = 0\nwhile True:\n"
        "    json.dump({'status': 'ok', 'tick': n}, open('/app/health.json.tmp', 'w'))\n"
        "    __import__('os').replace('/app/health.json.tmp', '/app/health.json')\n"
        "    n += 1\n    time.sleep(0.2)\n", "/app/server.py"))
    assert w.success
    run(sandbox.arun(cmd="cd /app && python3 server.py &", session="server_session", mode="normal"))
    # _wait_for_server: arun in the client session until the health check passes (errors retried).
    deadline = time.time() + 60
    while True:
        try:
            response = run(sandbox.arun(cmd="grep -q ok /app/health.json && echo HC_CODE_200_HC_CODE",
                                        session="default", mode="normal"))
            if "HC_CODE_200_HC_CODE" in response.output:
                break
        except Exception:  # noqa: BLE001 - as sokoban's loop
            pass
        assert time.time() < deadline, "the server never answered"
        time.sleep(0.5)
    # _execute_command: JSON from a client command.
    response = run(sandbox.arun(cmd="cd /app && python3 -c 'import json; print(json.dumps({\"obs\": [1, 2]}))'",
                                session="default", mode="normal"))
    assert json.loads(response.output.strip()) == {"obs": [1, 2]}
    # The environment is ROCK's: env_enable=False starts the session without the exported variables
    # (TERM here), PATH kept.
    term, path = run(sandbox.arun(cmd="echo ${TERM:-none} $PATH", session="default")).output.split()
    assert term == "none" and "/bin" in path

    # pull_runner: arun without a session runs in a fresh one.
    obs = run(sandbox.arun("hostname -I 2>/dev/null | awk '{print $1}'"))
    assert obs.exit_code == 0
    # nohup mode: the output once the process ends; exit code 1 if it does not in time.
    # (ROCK writes "nohup {cmd} < /dev/null > {file} 2>&1 &": a compound command goes through bash -c.)
    obs = run(sandbox.arun("bash -c 'sleep 1; echo done'", mode="nohup", wait_timeout=60, wait_interval=5))
    assert (obs.output, obs.exit_code) == ("done\n", 0)
    obs = run(sandbox.arun("sleep 30", session="default", mode="nohup", wait_timeout=1))
    assert obs.exit_code == 1 and "did not complete" in obs.failure_reason
    obs = run(sandbox.arun("echo kept", mode="nohup", ignore_output=True, output_file="/app/out/log.txt"))
    assert obs.exit_code == 0 and "/app/out/log.txt" in obs.output
    assert run(sandbox.read_file(rk.ReadFileRequest(path="/app/out/log.txt"))).content == "kept\n"
    obs = run(sandbox.arun("bash -c 'yes | head -c 100000'", mode="nohup", response_limited_bytes_in_nohup=10))
    assert obs.output == "y\ny\ny\ny\ny\n"
    with pytest.raises(rk.InvalidParameterRockException):
        run(sandbox.arun("true", mode="detached"))

    # Options dsec cannot honour are refused, naming them.
    with pytest.raises(UnsupportedOption, match="remote_user"):
        run(sandbox.create_session(rk.CreateBashSessionRequest(session="as_admin", remote_user="admin")))
    with pytest.raises(UnsupportedOption, match="restart"):
        run(sandbox.restart())

    # close
    run(sandbox.stop())
    with pytest.raises(rk.BadRequestRockError):  # nothing to drive after stop
        run(sandbox.arun("true", session="default"))


def test_a_sandbox_that_died_is_rocks_not_found_error_marked_infra(started, server, client):
    sandbox = rk.Sandbox(rk.SandboxConfig(base_url=server.url, image="debian", memory="1g", cpus=1))
    started.append(sandbox)
    run(sandbox.start())
    run(sandbox.create_session(rk.CreateBashSessionRequest(session="default")))
    client.delete(sandbox.sandbox_id)  # the sandbox dies under the rollout
    with pytest.raises(rk.SandboxNotFoundRockError) as e:
        run(sandbox.run_in_session(rk.BashAction(command="echo hi", check="silent")))
    assert isinstance(e.value, rk.SandboxTerminated) and e.value.infra
    assert isinstance(e.value, rk.RockException)
    with pytest.raises(rk.SandboxTerminated):
        run(sandbox.execute(rk.Command(command=["true"])))
    assert run(sandbox.is_alive()).is_alive is False
    run(sandbox.stop())  # never raises


def test_unsupported_config_options_are_refused_before_anything_starts(server, client):
    for kw, option in ((dict(num_gpus=1), "num_gpus"), (dict(registry_username="u", registry_password="p"),
                                                         "registry_username"),
                       (dict(limit_cpus=4), "limit_cpus"), (dict(auto_archive_seconds=60), "auto_archive_seconds"),
                       (dict(image_os="windows"), "image_os"), (dict(extra_headers={"X-Trace": "1"}), "extra_headers"),
                       (dict(use_kata_runtime=True), "use_kata_runtime")):
        sandbox = rk.Sandbox(rk.SandboxConfig(base_url=server.url, image="debian", experiment_id="refused", **kw))
        with pytest.raises(UnsupportedOption, match=option):
            run(sandbox.start())
        assert sandbox.sandbox_id is None
    assert client.list(labels={"rock-experiment-id": "refused"}) == []
