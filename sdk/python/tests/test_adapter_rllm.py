"""The rLLM adapter selected and driven as rLLM 0.3 selects and drives a
sandbox backend. rLLM picks backends by name in
``rllm.sandbox.sandboxed_flow.create_sandbox``'s if/elif table; rLLM is not
installed here, so the test puts a module of that name in place with a
table of the same shape (its own backends, ValueError for any other name),
registers dsec with ``register()`` as docs/rl.md says, and then makes the
calls of rLLM's cold path (``eval/_resolution.py``): ``create_sandbox(backend,
name=, image=)`` with the task's docker_image (or python:3.11-slim),
Dockerfile RUN steps replayed through ``_safe_exec`` (RuntimeError becomes
its message), the agent's and verifier's ``exec``/``upload_file``/
``upload_dir``, the warm queue's ``is_alive``, and ``close``."""

import subprocess
import sys
import types

import pytest

from dsec.adapters import rllm
from dsec.adapters._common import UnsupportedOption


@pytest.fixture()
def rllm_modules(monkeypatch):
    """rLLM's module path with a backend table shaped like its own."""
    calls = []

    def create_sandbox(backend, name, image, **kwargs):
        calls.append(backend)
        if backend in ("docker", "local", "modal", "daytona"):
            return ("rllm's own", backend)
        raise ValueError(f"Unknown sandbox backend: {backend}. Available: docker, local, modal, daytona")

    pkgs = {n: types.ModuleType(n) for n in ("rllm", "rllm.sandbox", "rllm.sandbox.sandboxed_flow")}
    pkgs["rllm.sandbox.sandboxed_flow"].create_sandbox = create_sandbox
    for n, m in pkgs.items():
        monkeypatch.setitem(sys.modules, n, m)
    return pkgs["rllm.sandbox.sandboxed_flow"], calls


def safe_exec(sandbox, command, timeout=None):
    """rLLM's _safe_exec: a failed command's message instead of raising."""
    try:
        return sandbox.exec(command, timeout=timeout)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        return str(e)


def test_rllm_selects_dsec_by_name_and_runs_a_task_on_it(server, client, rllm_modules, tmp_path):
    flow, calls = rllm_modules
    with pytest.raises(ValueError, match="Unknown sandbox backend: dsec"):
        flow.create_sandbox("dsec", name="x", image="debian")
    rllm.register(image_map={"python:3.11-slim": "debian"}, network="none", ttl_s=600)
    rllm.register(image_map={"python:3.11-slim": "debian"}, network="none", ttl_s=600)  # idempotent
    assert flow.create_sandbox("docker", name="x", image="y") == ("rllm's own", "docker")

    tests = tmp_path / "tests"
    (tests / "data").mkdir(parents=True)
    (tests / "test.sh").write_text("set -e\ntest \"$(cat /task/answer)\" = 42\necho PASSED\n")
    (tests / "data" / "expected.txt").write_text("42\n")

    # _create_base_sandbox: create_sandbox imported from its module at call time.
    from rllm.sandbox.sandboxed_flow import create_sandbox

    sb = create_sandbox("dsec", name="rllm-task-1-abc123", image="python:3.11-slim")
    try:
        assert sb.image == "debian"
        assert client.list(labels={"rllm-sandbox": "rllm-task-1-abc123"})[0].id == sb.sandbox.id
        # _replay_dockerfile: RUN steps, best effort.
        for cmd in ["mkdir -p /task && echo prepared > /task/state", "exit 9"]:
            safe_exec(sb, cmd, timeout=900)
        assert sb.exec("cat /task/state") == "prepared\n"
        assert "Command failed (exit 9)" in safe_exec(sb, "exit 9")
        # The agent works, the verifier uploads its tests and runs them.
        sb.exec("echo 42 > /task/answer", user="root")
        sb.upload_file(str(tests / "test.sh"), "/tests/test.sh")
        sb.upload_dir(str(tests), "/verifier/tests")
        assert sb.exec("cat /verifier/tests/data/expected.txt; sh /tests/test.sh") == "42\nPASSED\n"
        with pytest.raises(RuntimeError, match="exit 1") as e:
            sb.exec("echo nope >&2; exit 1")
        assert "nope" in str(e.value)
        with pytest.raises(RuntimeError, match="timed out"):
            sb.exec("sleep 30", timeout=1)
        assert sb.is_alive()
    finally:
        sb.close()
    sb.close()  # idempotent
    assert sb.is_alive() is False  # never raises
    assert calls == ["dsec", "docker"]  # dsec never reached rLLM's table after register()


def test_the_older_protocols_agent_process_and_endpoint(server, tmp_path):
    sb = rllm.create_dsec_sandbox(name="worker", image="debian", network="none")
    try:
        sb.start_agent_process("python3 -m http.server 8123 --bind 127.0.0.1", port=8123, timeout=30)
        assert "Directory listing" in sb.exec("python3 -c \"import urllib.request as u; "
                                              "print(u.urlopen('http://127.0.0.1:8123/').read().decode())\"")
        with pytest.raises(UnsupportedOption, match="get_endpoint"):
            sb.get_endpoint(8123)
        with pytest.raises(TimeoutError):
            sb.start_agent_process("sleep 30", port=8124, timeout=1)
    finally:
        sb.close()


def test_unknown_keywords_are_refused(server):
    with pytest.raises(TypeError):
        rllm.DsecRllmSandbox(name="x", image="debian", gpu_type="h100")
