"""The Harbor adapter driven the way Harbor 0.13 drives an environment: built
by import path from a task directory with the trial's keywords (overrides,
persistent env, mounts of its log directories, the agent's network policy),
then the trial's sequence (preflight, start, healthcheck, the agent's exec
and uploads as its default user, the verifier's upload of tests/, chmod as
root, the test script with stdout to /logs/verifier, download of the
verifier directory, the reward file, stop). Harbor is not installed here:
the adapter runs on its stand-in base, and these calls are the ones
Harbor's trial.py and verifier.py make (see docs/rl.md)."""

import asyncio
import importlib
import os
import time
import tomllib
from pathlib import Path

import pytest

import dsec
from dsec.adapters import harbor
from dsec.adapters._common import UnsupportedOption

TASK_TOML = """
version = "1.0"

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 60.0

[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = 1024
network_mode = "no-network"
env = { TASK_GREETING = "${DSEC_TEST_UNSET:-hello}" }

[environment.healthcheck]
command = "test -f /app/ready"
interval_sec = 0.2
start_period_sec = 5.0
start_interval_sec = 0.2
retries = 3
"""

DOCKERFILE = """\
# A single-stage task image, as terminal-bench tasks bring.
FROM debian
ARG GREETING=hi
ENV APP_HOME=/app \\
    PATH=/app/bin:$PATH
WORKDIR /app
COPY app.py /app/app.py
COPY bin/ /app/bin/
RUN mkdir -p /app/data && echo "$GREETING" > /app/data/greeting && touch /app/ready
CMD ["sleep", "infinity"]
"""


def make_task(root: Path, name: str = "fix-add", dockerfile: str = DOCKERFILE, toml: str = TASK_TOML) -> Path:
    task = root / name
    (task / "environment" / "bin").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Fix add() in /app/app.py.\n")
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "environment" / "app.py").write_text("def add(a, b):\n    return a - b\n")
    (task / "environment" / "bin" / "check").write_text("#!/bin/sh\npython3 -c 'import app; print(app.add(2, 3))'\n")
    os.chmod(task / "environment" / "bin" / "check", 0o755)
    (task / "solution" / "solve.sh").write_text("sed -i 's/a - b/a + b/' /app/app.py\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        "cd /app\n"
        "out=$(check)\n"
        "echo \"check printed $out; greeting $TASK_GREETING; verifier $VERIFIER_FLAG\"\n"
        "if [ \"$out\" = 5 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    return task


class TrialPaths:
    """The host side of Harbor's trial directory (trial/agent, trial/verifier, ...)."""

    def __init__(self, root: Path) -> None:
        self.trial_dir = root
        self.agent_dir = root / "agent"
        self.verifier_dir = root / "verifier"
        self.artifacts_dir = root / "artifacts"
        for d in (self.agent_dir, self.verifier_dir, self.artifacts_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.reward_text_path = self.verifier_dir / "reward.txt"
        self.test_stdout_path = self.verifier_dir / "test-stdout.txt"


def load_env_config(task: Path):
    cfg = tomllib.loads((task / "task.toml").read_text())["environment"]
    return harbor.EnvironmentConfig(**cfg)


def import_path(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_environment(task: Path, trial: TrialPaths, *, session: str, config_kwargs=None, **extra):
    """EnvironmentFactory.create_environment_from_config with an import_path."""
    env_cfg = load_env_config(task)
    cls = import_path("dsec.adapters.harbor:DsecEnvironment")
    cls.preflight()
    caps = cls.resource_capabilities()
    assert caps.cpu_limit and caps.memory_limit and not caps.cpu_request
    mounts = [{"type": "bind", "source": str(d), "target": t}
              for d, t in ((trial.verifier_dir, "/logs/verifier"), (trial.agent_dir, "/logs/agent"),
                           (trial.artifacts_dir, "/logs/artifacts"))]
    kwargs = {"override_cpus": None, "override_memory_mb": None, "override_storage_mb": None, "override_gpus": None,
              "override_tpu": None, "persistent_env": {}, "extra_docker_compose": [],
              **(config_kwargs or {"build_network": "none"}),
              "mounts": mounts, "network_policy": env_cfg.resolve_baseline(), **extra}
    return cls(environment_dir=task / "environment", environment_name=task.name, session_id=session,
               trial_paths=trial, task_env_config=env_cfg, logger=None, **kwargs)


async def run_trial(env, task: Path, trial: TrialPaths) -> float:
    await env.start(force_build=False)
    try:
        await env.run_healthcheck()
        # The agent (oracle): solution/ uploaded and run as the task's agent user.
        with env.with_default_user(None):
            await env.upload_dir(source_dir=task / "solution", target_dir="/solution")
            r = await env.exec("bash /solution/solve.sh > /logs/agent/oracle.txt 2>&1; echo $PWD $APP_HOME")
            assert r.return_code == 0 and r.stdout == "/app /app\n", r
        await env.download_dir(source_dir="/logs/agent", target_dir=trial.agent_dir)
        # The verifier.
        await env.upload_dir(source_dir=task / "tests", target_dir="/tests")
        await env.exec(command="chmod +x /tests/test.sh", user="root")
        with env.with_default_user(None):
            await env.exec(command="(bash /tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1",
                           env={"VERIFIER_FLAG": "on"})
        await env.download_dir(source_dir="/logs/verifier", target_dir=trial.verifier_dir)
        return float(trial.reward_text_path.read_text())
    finally:
        await env.stop(delete=True)


def test_a_harbor_trial_builds_the_task_environment_and_scores_it(server, client, tmp_path):
    task = make_task(tmp_path / "tasks")
    trial = TrialPaths(tmp_path / "trial-1")
    env = build_environment(task, trial, session="fix-add__1")
    assert env.type() == "dsec" and env.type().value == "dsec"
    assert not env.capabilities.mounted and env.capabilities.disable_internet
    assert env.capabilities.network_allowlist and env.capabilities.dynamic_network_policy
    assert env.capabilities.docker_compose

    reward = asyncio.run(run_trial(env, task, trial))
    assert reward == 1.0
    out = trial.test_stdout_path.read_text()
    assert out == "check printed 5; greeting hello; verifier on\n", out
    assert (trial.agent_dir / "oracle.txt").exists()
    assert env.sandbox is None
    assert client.list(labels={"harbor-session": "fix-add__1"}) == []


def test_a_grpo_group_of_trials_shares_one_build_of_the_environment(server, client, tmp_path):
    task = make_task(tmp_path / "tasks", name="group-task")
    app = task / "environment" / "app.py"
    app.write_text(app.read_text() + "# group-task\n")  # content no earlier test built
    envs = [build_environment(task, TrialPaths(tmp_path / f"t{i}"), session=f"group-task__{i}") for i in range(3)]

    def builds():
        return len([i for i in client.images() if i["name"].startswith("harbor-build-")])

    async def group():
        return await asyncio.gather(*(run_trial(e, task, e.trial_paths) for e in envs))

    first = builds()
    assert asyncio.run(group()) == [1.0, 1.0, 1.0]
    assert builds() == first + 1  # three trials, one build
    before = builds()

    # A later trial of an unchanged task starts from the cached build...
    trial = TrialPaths(tmp_path / "t-later")
    assert asyncio.run(run_trial(build_environment(task, trial, session="group-task__later"), task, trial)) == 1.0
    assert builds() == before
    # ...and so does another task with the same environment content...
    twin = make_task(tmp_path / "tasks", name="twin-task")
    (twin / "environment" / "app.py").write_text(app.read_text())
    trial = TrialPaths(tmp_path / "t-twin")
    assert asyncio.run(run_trial(build_environment(twin, trial, session="twin-task__1"), twin, trial)) == 1.0
    assert builds() == before
    # ...while a changed build context is a new build.
    app.write_text("def add(a, b):\n    return a * b\n")
    trial = TrialPaths(tmp_path / "t-changed")
    asyncio.run(run_trial(build_environment(task, trial, session="group-task__changed"), task, trial))
    assert builds() == before + 1


def test_a_task_with_a_prebuilt_image_gets_its_environment_directory_in_the_workdir(server, tmp_path):
    toml = TASK_TOML.replace("[environment]\n", '[environment]\ndocker_image = "python:3.12-slim"\nworkdir = "/srv"\n')
    task = make_task(tmp_path / "tasks", name="prebuilt", toml=toml)
    (task / "environment" / "Dockerfile").unlink()
    trial = TrialPaths(tmp_path / "trial")
    env = build_environment(task, trial, session="prebuilt__1",
                            config_kwargs={"image_map": {"python:3.12-slim": "debian"}})

    async def go():
        await env.start(force_build=False)
        try:
            r = await env.exec("pwd; cat app.py; ls bin")
            return r.stdout, await env.is_file("/srv/app.py"), await env.is_dir("/srv/bin")
        finally:
            await env.stop(delete=True)

    assert asyncio.run(go()) == ("/srv\ndef add(a, b):\n    return a - b\ncheck\n", True, True)


def test_a_prebuilt_image_the_server_does_not_have_is_an_error_naming_it(server, tmp_path):
    toml = TASK_TOML.replace("[environment]\n", '[environment]\ndocker_image = "ghcr.io/org/missing:1"\n')
    task = make_task(tmp_path / "tasks", name="missing-image", toml=toml)
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="missing__1")
    with pytest.raises(UnsupportedOption, match="ghcr.io/org/missing:1"):
        asyncio.run(env.start(force_build=False))


@pytest.mark.parametrize("dockerfile,named", [
    ("FROM debian\nVOLUME /data\n", "VOLUME"),
    ("FROM debian\nRUN --mount=type=cache,target=/root/.cache true\n", "RUN --mount"),
    ("FROM debian\nADD https://example.com/x.tar.gz /x\n", "ADD https://example.com/x.tar.gz"),
    ("FROM debian\nHEALTHCHECK CMD true\n", "HEALTHCHECK"),
    ("FROM no-such-base:1\nRUN true\n", "FROM no-such-base:1"),
])
def test_a_dockerfile_the_builder_cannot_honour_is_refused_naming_the_instruction(server, tmp_path, dockerfile, named):
    task = make_task(tmp_path / "tasks", name="bad-dockerfile", dockerfile=dockerfile)
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="bad__1")
    with pytest.raises(UnsupportedOption) as e:
        asyncio.run(env.start(force_build=False))
    assert named in str(e.value)


def test_a_multi_stage_dockerfile_builds_as_docker_builds_it(server, tmp_path):
    dockerfile = ("FROM debian AS tools\nRUN mkdir -p /out && printf '#!/bin/sh\\necho built-in-stage\\n' > /out/tool"
                  " && chmod 755 /out/tool\nFROM debian\nCOPY --from=tools /out/tool /usr/local/bin/tool\n"
                  "ADD tools.tar.gz /opt/\nWORKDIR /app\n")
    task = make_task(tmp_path / "tasks", name="multi-stage", dockerfile=dockerfile)
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        data = b"unpacked\n"
        ti = tarfile.TarInfo("extra/readme")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    (task / "environment" / "tools.tar.gz").write_bytes(buf.getvalue())
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="multi-stage__1")

    async def go():
        await env.start(force_build=False)
        try:
            return (await env.exec("tool; cat /opt/extra/readme; pwd")).stdout
        finally:
            await env.stop(delete=True)

    assert asyncio.run(go()) == "built-in-stage\nunpacked\n/app\n"


def test_a_failing_build_step_is_harbors_build_failure(server, tmp_path):
    task = make_task(tmp_path / "tasks", name="failing-build", dockerfile="FROM debian\nRUN echo broken >&2; exit 3\n")
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="failing__1")
    with pytest.raises(harbor.SandboxBuildFailedError, match="broken"):
        asyncio.run(env.start(force_build=False))


def test_a_healthcheck_that_never_passes_raises_harbors_error(server, tmp_path):
    toml = TASK_TOML.replace('command = "test -f /app/ready"', 'command = "test -f /app/never"').replace(
        "start_period_sec = 5.0", "start_period_sec = 0.0")
    task = make_task(tmp_path / "tasks", name="unhealthy", toml=toml)
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="unhealthy__1")

    async def go():
        await env.start(force_build=False)
        try:
            await env.run_healthcheck()
        finally:
            await env.stop(delete=True)

    with pytest.raises(harbor.HealthcheckError):
        asyncio.run(go())


NET_TOML = """
version = "1.0"

[environment]
docker_image = "busybox"
network_mode = "allowlist"
allowed_hosts = ["mirror.pkgs.example", "*.cdn.example"]

[verifier]
network_mode = "allowlist"
allowed_hosts = ["grader.example"]
"""


def _dns_verdicts(sb, names, after_seq):
    """The node's verdict on each name's DNS query since after_seq (it
    answers every query of a policed sandbox and logs it)."""
    deadline = time.time() + 10
    while True:
        got = {r.host: r for r in sb.network_log(after_seq=after_seq).records if r.protocol == "dns"}
        if all(n in got for n in names) or time.time() > deadline:
            return {n: (got[n].verdict, got[n].reason) if n in got else None for n in names}
        time.sleep(0.1)


async def _lookups(env, names):
    """Each name looked up from inside the sandbox; the verdicts the node
    logged for them."""
    sb = env.sandbox
    seq = (await sb.network_log()).next_seq
    for n in names:
        await env.exec(f"timeout 5 nslookup {n} >/dev/null 2>&1; true", timeout_sec=30)
    return await asyncio.to_thread(_dns_verdicts, sb.sync, names, seq)


def test_an_allowlist_task_reaches_its_hosts_only_and_the_verifier_phase_changes_it(server, tmp_path):
    """Harbor's allowlist is a dsec policy allowing exactly allowed_hosts;
    the trial's phase change (Trial._phase_network_policy: the verifier's
    policy, then the baseline back) is dsec's set_network_policy while the
    sandbox runs. No internet here: an allowed name is passed on to the
    node's resolvers, a name off the list is answered NXDOMAIN by the node
    and its connections refused."""
    task = make_task(tmp_path / "tasks", name="allow", toml=NET_TOML)
    (task / "environment" / "Dockerfile").unlink()
    env_cfg = load_env_config(task)
    baseline = env_cfg.resolve_baseline()
    verifier_phase = harbor.NetworkPolicy(network_mode=harbor.NetworkMode.ALLOWLIST, allowed_hosts=["grader.example"])
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="allow__1")
    names = ["mirror.pkgs.example", "a.cdn.example", "cdn.example", "grader.example", "evil.example"]

    async def go():
        await env.start(force_build=False)
        try:
            out = {"agent": (await env.sandbox.network(), await _lookups(env, names))}
            r = await env.exec("wget -q -T 5 -O- http://evil.example/ 2>&1; echo rc=$?; "
                               "wget -q -T 5 -O- http://203.0.113.9/ 2>&1; echo rc=$?", timeout_sec=60)
            out["wget"] = r.stdout
            await env.set_network_policy(verifier_phase)  # the verifier's phase
            out["verifier"] = (await env.sandbox.network(), await _lookups(env, names))
            await env.set_network_policy(baseline)  # and back
            out["after"] = (await env.sandbox.network(), await _lookups(env, names[:1] + names[3:4]))
            await env.set_network_policy(harbor.NetworkPolicy(network_mode=harbor.NetworkMode.PUBLIC))
            out["public"] = (await env.sandbox.network()).policy
            await env.set_network_policy(harbor.NetworkPolicy(network_mode=harbor.NetworkMode.NO_NETWORK))
            out["none"] = (await env.sandbox.network()).policy
            return out
        finally:
            await env.stop(delete=True)

    out = asyncio.run(go())
    nw, dns = out["agent"]
    assert nw.mode == "egress" and nw.policy == dsec.NetworkPolicy(allow=["mirror.pkgs.example", "*.cdn.example"])
    assert dns == {"mirror.pkgs.example": ("allow", "allow mirror.pkgs.example"),
                   "a.cdn.example": ("allow", "allow *.cdn.example"),
                   "cdn.example": ("deny", "no rule"),  # dsec's *.name is the names below it only
                   "grader.example": ("deny", "no rule"), "evil.example": ("deny", "no rule")}
    assert out["wget"].count("rc=0") == 0 and out["wget"].count("rc=") == 2, out["wget"]
    nw, dns = out["verifier"]
    assert nw.policy == dsec.NetworkPolicy(allow=["grader.example"])
    assert dns["grader.example"] == ("allow", "allow grader.example")
    assert dns["mirror.pkgs.example"] == ("deny", "no rule") and dns["evil.example"] == ("deny", "no rule")
    nw, dns = out["after"]
    assert nw.policy == dsec.NetworkPolicy(allow=["mirror.pkgs.example", "*.cdn.example"])
    assert dns == {"mirror.pkgs.example": ("allow", "allow mirror.pkgs.example"), "grader.example": ("deny", "no rule")}
    assert out["public"] is None and out["none"] == dsec.NetworkPolicy()


def test_a_no_network_task_is_denied_everything_and_never_widened(server, tmp_path):
    task = make_task(tmp_path / "tasks", name="net")
    trial = TrialPaths(tmp_path / "trial")
    env = build_environment(task, trial, session="net__1")  # the task asks for no network

    async def go():
        await env.start(force_build=False)
        try:
            nw = await env.sandbox.network()
            same = harbor.NetworkPolicy(network_mode=harbor.NetworkMode.NO_NETWORK)
            await env.set_network_policy(same)  # unchanged: accepted
            r = await env.exec("exec 3<>/dev/tcp/203.0.113.9/8080 && echo connected; "
                               "getent hosts example.com || echo unresolved", timeout_sec=60)
            return nw, r.stdout
        finally:
            await env.stop(delete=True)

    nw, out = asyncio.run(go())
    assert nw.mode == "egress" and nw.policy == dsec.NetworkPolicy()  # deny everything
    assert "connected" not in out and "unresolved" in out, out

    # microVMs and VMs are on the sandbox network as containers are: the
    # same capabilities. Where dsec has no network (function sandboxes),
    # an allowlist is refused naming the hosts, never "public"; so is a
    # phase change.
    for i, k in enumerate(("microvm", "vm")):
        env = build_environment(task, trial, session=f"net__{4 + i}", config_kwargs={"kind": k, "build_network": "none"})
        assert env.capabilities.network_allowlist and env.capabilities.dynamic_network_policy, k
    allow = harbor.NetworkPolicy(network_mode=harbor.NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org"])
    with pytest.raises(UnsupportedOption, match="allowlist.*pypi.org.*kind function"):
        build_environment(task, trial, session="net__2", network_policy=allow,
                          config_kwargs={"kind": "function", "build_network": "none"})
    vm = build_environment(task, trial, session="net__3", config_kwargs={"kind": "function", "build_network": "none"})
    assert not vm.capabilities.network_allowlist and not vm.capabilities.dynamic_network_policy
    with pytest.raises(ValueError, match="cannot change network policy"):
        asyncio.run(vm.set_network_policy(harbor.NetworkPolicy(network_mode=harbor.NetworkMode.PUBLIC)))


@pytest.mark.parametrize("change,named", [
    (dict(config_kwargs={"build_network": "none", "gpu_type": "h100"}), "gpu_type"),
    (dict(override_storage_mb=20480, config_kwargs={"kind": "function", "build_network": "none"}),
     "storage_mb=20480 on kind function"),
    (dict(cpu_enforcement_policy="request"), "cpu_enforcement_policy=request"),
    (dict(memory_enforcement_policy="guarantee"), "memory_enforcement_policy=guarantee"),
    (dict(override_tpu={"type": "v6e", "topology": "2x4"}), "override_tpu"),
    (dict(override_gpus=1), "override_gpus=1"),
    (dict(mounts=[{"type": "bind", "source": "/data", "target": "/data"}]), "mount /data -> /data"),
])
def test_an_option_dsec_cannot_honour_is_an_error_naming_it(server, tmp_path, change, named):
    task = make_task(tmp_path / "tasks", name="opts")
    with pytest.raises((UnsupportedOption, TypeError)) as e:
        build_environment(task, TrialPaths(tmp_path / "trial"), session="opts__1", **change)
    assert named in str(e.value)


def test_a_storage_size_is_the_sandboxs_disk(server, tmp_path):
    toml = TASK_TOML.replace("memory_mb = 1024\n", "memory_mb = 1024\nstorage_mb = 512\n")
    task = make_task(tmp_path / "tasks", name="storage", toml=toml)
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="storage__1")
    assert env._resources == {"cpu": 1.0, "memory_mb": 1024, "disk_mb": 512}

    async def go():
        await env.start(force_build=False)
        try:
            size = (await env.exec("df -k / | tail -1")).stdout.split()
            fill = await env.exec("dd if=/dev/zero of=/fill bs=1M count=1024 2>&1; echo rc=$?", timeout_sec=120)
            return int(size[1]), fill.stdout
        finally:
            await env.stop(delete=True)

    size_kb, fill = asyncio.run(go())
    assert 400 * 1024 <= size_kb <= 512 * 1024, size_kb
    assert "No space left on device" in fill and "rc=0" not in fill, fill
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="storage__2",
                            config_kwargs={"kind": "microvm", "build_network": "none"})
    assert env._resources == {"cpu": 1.0, "memory_mb": 1024, "disk_mb": 512}


COMPOSE = """\
services:
  main:
    environment:
      API_URL: http://api:8080/answer
    depends_on:
      api: {condition: service_healthy}
  api:
    image: ${API_IMAGE:-busybox}
    command: ["sh", "-c", "mkdir -p /www && echo $${ANSWER} > /www/answer && exec httpd -f -p 8080 -h /www"]
    environment:
      ANSWER: "5"
      CONTEXT: ${CONTEXT_DIR}
    healthcheck:
      test: ["CMD", "wget", "-qO-", "http://localhost:8080/answer"]
      start_interval: 100ms
      retries: 50
"""

COMPOSE_TEST = (
    "#!/bin/bash\n"
    "cd /app\n"
    "want=$(python3 -c 'import os, urllib.request; print(urllib.request.urlopen(os.environ[\"API_URL\"]).read().decode().strip())')\n"
    "out=$(check)\n"
    "echo \"check printed $out; the api answers $want\"\n"
    "if [ -n \"$want\" ] && [ \"$out\" = \"$want\" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")


def test_a_compose_task_runs_with_its_sidecar_and_is_scored(server, client, tmp_path):
    """Harbor's compose task: the main container built from the task's
    Dockerfile, a service the tests query by name, the task's no-network
    policy on the group (the sidecar is reachable, the internet is not)."""
    task = make_task(tmp_path / "tasks", name="compose")
    (task / "environment" / "docker-compose.yaml").write_text(COMPOSE)
    (task / "tests" / "test.sh").write_text(COMPOSE_TEST)
    trial = TrialPaths(tmp_path / "trial")
    env = build_environment(task, trial, session="compose__1")
    assert env.capabilities.docker_compose

    async def trial_with_checks() -> float:
        await env.start(force_build=False)
        sb = env.sandbox
        info = await sb.refresh()
        assert [(s["name"], s["state"]) for s in info.sidecars] == [("api", "healthy")]
        # Harbor's CONTEXT_DIR reached the sidecar; the api is served, and
        # the no-network policy still denies the internet.
        r = await sb.container("api").exec("echo $CONTEXT")
        assert r.stdout.strip() == str((task / "environment").resolve())
        r = await sb.exec(["bash", "-c", "exec 3<>/dev/tcp/203.0.113.9/8080 && echo connected; "
                                          "getent hosts example.com || echo unresolved"], timeout_s=60)
        assert "connected" not in r.stdout and "unresolved" in r.stdout, r.stdout
        env._sb = None  # run_trial starts it again
        await sb.close()
        return await run_trial(env, task, trial)

    reward = asyncio.run(trial_with_checks())
    assert reward == 1.0, trial.test_stdout_path.read_text()
    assert trial.test_stdout_path.read_text() == "check printed 5; the api answers 5\n"
    assert client.list(labels={"harbor-session": "compose__1"}) == []


def test_a_jobs_extra_compose_file_adds_a_sidecar_to_any_task(server, client, tmp_path):
    """Harbor's --extra-docker-compose: a job-level overlay (here an MCP-like
    service and an environment variable for main) laid over a task that
    has no compose file of its own."""
    task = make_task(tmp_path / "tasks", name="overlay")
    overlay = tmp_path / "mcp.yaml"
    overlay.write_text(
        "services:\n"
        "  main:\n"
        "    environment:\n"
        "      MCP_URL: http://mcp-server:9000/\n"
        "  mcp-server:\n"
        "    image: busybox\n"
        "    command: [sh, -c, 'mkdir -p /w && echo tools > /w/index.html && exec httpd -f -p 9000 -h /w']\n")
    env = build_environment(task, TrialPaths(tmp_path / "trial"), session="overlay__1",
                            extra_docker_compose=[str(overlay)])

    async def go():
        await env.start(force_build=False)
        try:
            r = await env.exec('python3 -c "import os, urllib.request; '
                               'print(urllib.request.urlopen(os.environ[\'MCP_URL\']).read().decode())"')
            return r.stdout
        finally:
            await env.stop(delete=True)

    assert asyncio.run(go()) == "tools\n\n"
    assert client.list(labels={"harbor-session": "overlay__1"}) == []


def test_a_compose_task_on_a_kind_without_sidecars_is_refused(server, tmp_path):
    task = make_task(tmp_path / "tasks", name="compose-vm")
    (task / "environment" / "docker-compose.yaml").write_text(COMPOSE)
    with pytest.raises(UnsupportedOption, match="docker-compose.yaml"):
        build_environment(task, TrialPaths(tmp_path / "trial"), session="compose__2", config_kwargs={"kind": "microvm"})

