"""The SWE-ReX adapter driven as SWE-agent 1.1's SWEEnv drives a deployment:
every call in its own ``asyncio.run`` (SWEEnv is synchronous), the bash
session started with ``startup_source=["/root/.bashrc"]``, commands through
``run_in_session(BashAction(command, timeout, check="silent"|"ignore"))``,
the repository copied with ``runtime.upload(UploadRequest)`` and chowned
with ``runtime.execute(Command(shell=True, check=True))``, files through
``ReadFileRequest``/``WriteFileRequest``, ``BashInterruptAction`` after a
timeout, and ``deployment.stop()``. SWE-ReX is not installed here: the
request and response models are the adapter's stand-ins with SWE-ReX
1.4's fields, and the exceptions the ones SWE-agent catches."""

import asyncio

import pytest

from dsec.adapters import swerex as rex
from dsec.adapters._common import UnsupportedOption


def run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def deployment(server):
    d = rex.DsecDeployment(image="debian", ttl_s=600, labels={"test": "swerex"})
    yield d
    run(d.stop())


def communicate(d, command, timeout=25, check="ignore"):
    """SWEEnv.communicate: check "ignore" skips the exit code, anything else
    asks for it silently and raises RuntimeError on non-zero itself."""
    r = run(d.runtime.run_in_session(rex.BashAction(command=command, timeout=timeout,
                                                    check="silent" if check != "ignore" else "ignore")))
    if check != "ignore" and r.exit_code != 0:
        raise RuntimeError(f"Command {command!r} failed ({r.exit_code=})")
    return r.output


def test_swe_agent_starts_copies_the_repo_runs_commands_and_stops(deployment, client, tmp_path):
    repo = tmp_path / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "README").write_text("calc\n")

    # SWEEnv._init_deployment
    run(deployment.start())
    assert run(deployment.is_alive()).is_alive
    run(deployment.runtime.create_session(rex.CreateBashSessionRequest(startup_source=["/root/.bashrc"])))
    communicate(deployment, "export LANG=C.UTF-8 && export LC_ALL=C.UTF-8", check="raise")
    # SWEEnv.reset and Repo.copy
    communicate(deployment, "cd /", check="raise")
    assert "calc" not in communicate(deployment, "ls", check="raise").split("\n")
    run(deployment.runtime.upload(rex.UploadRequest(source_path=str(repo), target_path="/calc")))
    r = run(deployment.runtime.execute(rex.Command(command="chown -R root:root /calc && ls /calc", shell=True,
                                                   check=True, timeout=30)))
    assert isinstance(r, rex.CommandResponse) and r.stdout.split() == ["README", "calc"]

    # The agent's turns: state persists in the session.
    assert communicate(deployment, "cd /calc && export STEP=1 && echo $LANG") == "C.UTF-8\n"
    assert communicate(deployment, "echo $STEP; pwd") == "1\n/calc\n"
    obs = run(deployment.runtime.run_in_session(rex.BashAction(command="python3 -c 'import calc; print(calc.add(2, 3))'",
                                                              timeout=30, check="silent")))
    assert (obs.output, obs.exit_code) == ("-1\n", 0)
    content = run(deployment.runtime.read_file(rex.ReadFileRequest(path="/calc/calc/__init__.py"))).content
    run(deployment.runtime.write_file(rex.WriteFileRequest(path="/calc/calc/__init__.py",
                                                           content=content.replace("a - b", "b + a  # fixed"))))
    assert communicate(deployment, "python3 -c 'import calc; print(calc.add(2, 3))'", check="raise") == "5\n"
    # A new file's parents are made, as SWE-ReX's local runtime makes them.
    run(deployment.runtime.write_file(rex.WriteFileRequest(path="/calc/new/dir/f.txt", content="x")))
    assert communicate(deployment, "cat /calc/new/dir/f.txt") == "x"

    # A failing command: check="silent" reports it, SWEEnv raises.
    with pytest.raises(RuntimeError):
        communicate(deployment, "false", check="raise")
    # check="raise" (SWE-ReX's default) raises SWE-ReX's own error.
    with pytest.raises(rex.NonZeroExitCodeError):
        run(deployment.runtime.run_in_session(rex.BashAction(command="ls /nope", session="default")))
    # A syntax error is caught before it reaches the shell.
    with pytest.raises(rex.BashIncorrectSyntaxError):
        run(deployment.runtime.run_in_session(rex.BashAction(command="echo 'unterminated", check="silent")))
    # A command that times out raises CommandTimeoutError; SWE-agent then interrupts the session.
    with pytest.raises(rex.CommandTimeoutError):
        run(deployment.runtime.run_in_session(rex.BashAction(command="sleep 60", timeout=1, check="silent")))
    run(deployment.runtime.run_in_session(rex.BashInterruptAction()))
    assert communicate(deployment, "echo $STEP", check="raise") == "1\n"
    # A command that ignores the interrupt: BashInterruptAction ends it, and the session lives on.
    with pytest.raises(rex.CommandTimeoutError):
        run(deployment.runtime.run_in_session(rex.BashAction(command="bash -c \"trap '' INT; sleep 60\"",
                                                              timeout=1, check="silent")))
    run(deployment.runtime.run_in_session(rex.BashInterruptAction()))
    assert communicate(deployment, "echo $STEP", check="raise") == "1\n"

    # Subprocess commands: stderr apart, or merged on request; env replaces the environment.
    r = run(deployment.runtime.execute(rex.Command(command="echo out; echo err >&2", shell=True)))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    r = run(deployment.runtime.execute(rex.Command(command=["sh", "-c", "echo out; echo err >&2"],
                                                   merge_output_streams=True)))
    assert r.stdout == "out\nerr\n" and r.stderr == ""
    r = run(deployment.runtime.execute(rex.Command(command="/usr/bin/env", env={"ONLY": "this"})))
    assert r.stdout == "ONLY=this\n"
    with pytest.raises(rex.NonZeroExitCodeError):
        run(deployment.runtime.execute(rex.Command(command="exit 3", shell=True, check=True)))
    with pytest.raises(FileNotFoundError):
        run(deployment.runtime.read_file(rex.ReadFileRequest(path="/calc/missing")))

    # Sessions are named; a second one with the same name is SessionExistsError.
    with pytest.raises(rex.SessionExistsError):
        run(deployment.runtime.create_session(rex.CreateBashSessionRequest()))
    with pytest.raises(rex.SessionDoesNotExistError):
        run(deployment.runtime.run_in_session(rex.BashAction(command="true", session="other")))
    run(deployment.runtime.close_session(rex.CloseBashSessionRequest()))

    sid = deployment.sandbox.id
    run(deployment.stop())
    run(deployment.stop())  # idempotent
    with pytest.raises(rex.DeploymentNotStartedError):
        deployment.runtime
    with pytest.raises(rex.DeploymentNotStartedError):
        run(deployment.is_alive())
    assert all(s.id != sid for s in client.list(labels={"test": "swerex"}))


def test_a_sandbox_that_died_is_a_swerex_exception_marked_infra(deployment, client):
    run(deployment.start())
    rt = deployment.runtime
    run(rt.create_session(rex.CreateBashSessionRequest()))
    client.delete(deployment.sandbox.id)  # the sandbox dies under the agent
    with pytest.raises(rex.SwerexException) as e:
        run(rt.run_in_session(rex.BashAction(command="echo hi", timeout=10)))
    assert isinstance(e.value, rex.SandboxTerminated) and e.value.infra
    with pytest.raises(rex.SandboxTerminated):
        run(rt.execute(rex.Command(command="true")))
    assert run(rt.is_alive()).is_alive is False


def test_interactive_commands_are_refused_naming_the_option(deployment):
    run(deployment.start())
    run(deployment.runtime.create_session(rex.CreateBashSessionRequest()))
    with pytest.raises(UnsupportedOption, match="is_interactive_command"):
        run(deployment.runtime.run_in_session(rex.BashAction(command="python3", is_interactive_command=True,
                                                              expect=[">>> "])))
    with pytest.raises(UnsupportedOption, match="expect"):
        run(deployment.runtime.run_in_session(rex.BashAction(command="python3", expect=[">>> "])))
