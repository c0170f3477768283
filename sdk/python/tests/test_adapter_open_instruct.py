"""The open-instruct adapter selected and driven as open-instruct's
GenericSandboxEnv selects and drives a backend. open-instruct builds
backends with ``create_backend(backend_type, **kwargs)`` from
``open_instruct.environments.backends``, which ``generic_sandbox`` imports
by name; open-instruct is not installed here, so the test puts modules of
those names in place (a table that knows only "docker", as open-instruct's
does), registers dsec with ``register()`` as docs/rl.md says, and makes
GenericSandboxEnv's calls: ``create_backend(backend, image=, mem_limit=,
timeout=)``, ``start()``, the reset's setup commands, ``execute_bash``
through a wrapper script that keeps cwd and exported variables in files,
the editor's ``read_file``/``write_file``, and ``close()``."""

import shlex
import sys
import types

import pytest

from dsec.adapters import open_instruct
from dsec.adapters._common import UnsupportedOption

# The env's own state-keeping wrapper (the same idea as open-instruct's: the
# environment and cwd are saved to files after each command).
WRAPPER = r"""#!/bin/bash
set -a; . /tmp/.env 2>/dev/null; set +a
cd "$(cat /tmp/.cwd 2>/dev/null || echo /testbed)" 2>/dev/null
eval "$1"
rc=$?
export -p > /tmp/.env
pwd > /tmp/.cwd
exit $rc
"""


@pytest.fixture()
def oi_modules(monkeypatch):
    def create_backend(backend_type, **kwargs):
        if backend_type == "docker":
            return ("open-instruct's own", kwargs)
        raise ValueError(f"Unknown backend type: {backend_type}. Currently only 'docker' is supported.")

    names = ("open_instruct", "open_instruct.environments", "open_instruct.environments.backends",
             "open_instruct.environments.generic_sandbox")
    mods = {n: types.ModuleType(n) for n in names}
    mods["open_instruct.environments.backends"].create_backend = create_backend
    mods["open_instruct.environments.generic_sandbox"].create_backend = create_backend  # imported by name
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return mods


def test_generic_sandbox_env_runs_on_dsec_after_register(server, client, oi_modules):
    gs = oi_modules["open_instruct.environments.generic_sandbox"]
    with pytest.raises(ValueError, match="Unknown backend type: dsec"):
        gs.create_backend("dsec")
    open_instruct.register(image_map={"python:3.12-slim": "debian"}, network="none")
    assert gs.create_backend("docker", image="x")[0] == "open-instruct's own"

    # GenericSandboxEnv._do_reset
    backend = gs.create_backend("dsec", image="python:3.12-slim", mem_limit="4g", timeout=5)
    backend.start()
    try:
        assert backend.run_command("mkdir -p /testbed/input /testbed/output").exit_code == 0
        backend.run_command("which git")
        backend.write_file("/tmp/.wrapper.sh", WRAPPER)
        backend.run_command("chmod +x /tmp/.wrapper.sh")
        backend.run_command("echo /testbed > /tmp/.cwd")

        def bash(command):  # GenericSandboxEnv._execute_bash
            return backend.run_command(f"bash /tmp/.wrapper.sh {shlex.quote(command)}")

        r = bash("cd /testbed/input && export TOKEN=abc")
        assert isinstance(r, open_instruct.ExecutionResult) and r.exit_code == 0
        r = bash("echo $TOKEN; pwd; ls /nope")
        assert r.stdout == "abc\n/testbed/input\n" and "/nope" in r.stderr and r.exit_code == 2
        # Timeouts: exit code 124 and DockerBackend's message before stderr.
        r = backend.run_command("echo started >&2; sleep 30")
        assert r.exit_code == 124 and r.stderr.startswith("Command timed out after 5s.\n")
        # The editor: view, create, str_replace.
        backend.write_file("/testbed/input/a.py", "x = 1\n")
        assert backend.read_file("/testbed/input/a.py") == "x = 1\n"
        backend.write_file("/testbed/input/b.bin", b"\x00\x01")
        assert backend.read_file("/testbed/input/b.bin", binary=True) == b"\x00\x01"
        with pytest.raises(FileNotFoundError):
            backend.read_file("/testbed/missing.py")
        with pytest.raises(IsADirectoryError):
            backend.read_file("/testbed/input")
        # Output is capped as DockerBackend caps it (1 MB per stream).
        r = backend.run_command("head -c 3000000 /dev/zero | tr '\\0' x")
        assert 900_000 <= len(r.stdout) <= 1_000_000
    finally:
        backend.close()
    backend.close()  # idempotent
    with pytest.raises(RuntimeError, match="start"):
        backend.run_command("true")


def test_the_persistent_shell_keeps_state_and_splits_stderr(server):
    b = open_instruct.DsecBackend(image="debian", timeout=30, network="none", persistent_shell=True)
    b.start()
    try:
        b.run_command("cd /tmp && export X=7")
        r = b.run_command("echo $X; pwd; echo to-stderr >&2; false")
        assert (r.stdout, r.stderr, r.exit_code) == ("7\n/tmp\n", "to-stderr\n", 1)
    finally:
        b.close()


def test_a_memory_limit_dsec_cannot_read_and_unknown_keywords_are_refused(server):
    with pytest.raises(UnsupportedOption, match="mem_limit='lots'"):
        open_instruct.DsecBackend(image="debian", mem_limit="lots")
    with pytest.raises(TypeError):
        open_instruct.DsecBackend(image="debian", privileged=True)
    assert open_instruct.DsecBackend(image="debian", mem_limit="512m")._spec["memory_mb"] == 512
