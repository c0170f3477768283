"""The model gateway from the SDK, against a real `dsec serve`: an agent in a
sandbox without network calls its session's model at OPENAI_BASE_URL, the
key stays on the server, each call lands in the trajectory log, and the
agent example survives a SIGKILLed trainer by fast-forwarding."""

import json
import os
import subprocess
import sys
import time

import pytest

import dsec

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import model_server  # noqa: E402  (the example's deterministic model, started below as its own process)

CALL = r'''
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
    data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": "Begin."}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
print(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"])
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    port_file = str(tmp_path_factory.mktemp("model") / "port")
    proc = subprocess.Popen([sys.executable, model_server.__file__, "--port-file", port_file])
    deadline = time.time() + 30
    while not os.path.exists(port_file):
        assert proc.poll() is None and time.time() < deadline, "the model server did not start"
        time.sleep(0.01)
    with open(port_file) as f:
        yield f"http://127.0.0.1:{f.read().strip()}"
    proc.terminate()
    proc.wait(10)


def test_an_agent_without_network_reaches_its_sessions_model(client, model):
    with client.session("py-gateway") as sess:
        reg = sess.set_model_upstreams([{"name": "local", "base_url": model + "/v1", "api_key": "sk-kept-on-the-server",
                                         "models": ["policy"]}])
        assert reg["upstreams"][0]["hasApiKey"] and "apiKey" not in reg["upstreams"][0]
        assert sess.model_upstreams()["upstreams"][0]["baseUrl"] == model + "/v1"
        sb = client.create("debian", session=sess, model_gateway=True)
        r = sb.exec(["python3", "-c", CALL])
        assert r.exit_code == 0, r.stderr
        assert "cat task.txt" in r.stdout
        assert "sk-kept-on-the-server" not in sb.exec("env; cat /proc/1/environ").stdout
        # No network at all: only the gateway answers, on the sandbox's own loopback.
        assert sb.network().mode == "none"
        calls = [e for e in sb.log() if e["op"] == "model_call"]
        assert len(calls) == 1
        mc = calls[0]["modelCall"]
        assert mc["index"] == "1" and mc["status"] == 200 and mc["upstream"] == "local"
        assert int(mc["completionTokens"]) > 0 and len(mc["logprobs"]) == len(mc["tokenIds"]) > 0
        assert "sk-kept-on-the-server" not in json.dumps(calls)

        again = client.create("debian", session=sess, model_gateway=True, fast_forward_from=sb)
        r2 = again.exec(["python3", "-c", CALL])
        assert r2.stdout == r.stdout
        mc2 = [e for e in again.log() if e["op"] == "model_call"][0]["modelCall"]
        assert mc2.get("replayed") is True


def test_a_sandbox_without_a_session_reaches_its_projects_upstreams(client, model):
    sb = client.create("debian", model_gateway=True)
    try:
        # Nothing registered: the model is refused (403), not forwarded.
        r = sb.exec(["python3", "-c", CALL])
        assert r.exit_code != 0 and "403" in r.stderr, r.stderr
        client.set_model_upstreams([{"name": "shared", "base_url": model + "/v1"}])
        assert client.model_upstreams()["upstreams"][0]["name"] == "shared"
        r = sb.exec(["python3", "-c", CALL])  # the next call sees it
        assert r.exit_code == 0 and "cat task.txt" in r.stdout, r.stderr
    finally:
        client.set_model_upstreams([])
        sb.close()


EXAMPLE = os.path.join(EXAMPLES, "agent_gateway.py")


def run_example(server, *args, check=True):
    p = subprocess.run([sys.executable, EXAMPLE, "--url", server.url, "--rollouts", "3", *args],
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"agent_gateway {args} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


@pytest.mark.parametrize("kill_after", [1, 5, 10])  # model calls served before the SIGKILL (12 in all)
def test_the_agent_example_resumes_a_killed_trainer_from_the_log(server, client, tmp_path, kill_after):
    run = f"py-agents-{kill_after}"
    state = str(tmp_path / "agents.jsonl")
    killed = run_example(server, "--run", run, "--state", state, "--kill-after", str(kill_after), check=False)
    assert killed.returncode == -9, killed.stdout + killed.stderr

    out = tmp_path / "summary.json"
    run_example(server, "--run", run, "--state", state, "--resume", "--json", str(out))
    s = json.loads(out.read_text())
    assert s["rewards"] == [1.0, 1.0, 1.0] and s["infra_failures"] == 0, s
    # Every call the killed run completed is answered from its log, and
    # none reached the model twice.
    # (The model had served kill_after calls: those of rollouts the killed
    # run finished, and the completed prefixes of the others.)
    assert s["prefix_calls"] + s["finished_before_calls"] >= kill_after and s["prefix_replay_hits"] == s["prefix_calls"], s
    assert s["prefix_duplicates_at_model"] == 0, s
    # So is every command it ran in its task sandbox, and none ran twice.
    assert s["prefix_commands"] >= 1 and s["prefix_command_replay_hits"] == s["prefix_commands"], s
    assert s["commands_run_twice"] == 0, s
    assert s["sandboxes_leaked"] == 0
    assert client.list(labels={"run": run}) == []


TRAINER = r'''
import os, signal, sys
sys.path.insert(0, sys.argv[3])
import dsec
c = dsec.Client(sys.argv[1])
sb = c.get(sys.argv[2])
r = sb.rollout("read x < /tmp/go; echo solved > /tmp/answer", "traj-1",
               verifier="test -s /tmp/answer && echo 1 || echo 0")
print(r.state, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_rollout_outlives_its_trainer_and_is_scored(server, client):
    sdk = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sb = client.create("busybox")
    try:
        sb.exec("mkfifo /tmp/go")  # the agent waits on it for the trainer's word
        p = subprocess.run([sys.executable, "-c", TRAINER, server.url, sb.id, sdk], capture_output=True, text=True, timeout=120)
        assert p.returncode == -9 and p.stdout.strip() == "running", p.stdout + p.stderr
        # A new trainer reattaches: the agent never stopped.
        r = client.rollout(sb.id, "traj-1")
        assert r.state == "running" and not r.done
        # Its progress streams while it runs: the trainer's command, then
        # (once the agent is told to go) the rest and its end.
        sb.exec("echo step")
        events = r.events()
        first = next(events)
        assert first["op"] == "exec" and "echo step" in " ".join(first["argv"]) and not r.done, (first, r.raw)
        sb.exec("echo go > /tmp/go")
        rest = list(events)
        # The exec that let the agent go may be logged after the rollout's
        # end (the agent exits as the fifo is written): then it is not in it.
        assert [e["op"] for e in rest] in (["exec"], []), rest
        assert r.state == "succeeded" and r.reward == 1.0 and not r.infra, r.raw
        # Starting it again answers it, runs nothing.
        again = sb.rollout("touch /tmp/second", "traj-1")
        assert again.state == "succeeded" and not sb.exists("/tmp/second")
    finally:
        sb.close()


# An agent that runs two commands in its worker through the dsec API at
# DSEC_URL (busybox's wget: the base image has no Python), and prints what
# the worker answered.
WORKER_AGENT = r'''call() { wget -q -O - --header 'Content-Type: application/json' --post-data "{\"sandboxId\":\"$DSEC_WORKERS\",\"cmd\":\"$1\"}" "$DSEC_URL/dsec.v1.ProcessService/Exec" || exit 9; echo; }
call 'echo one >> /tmp/count; wc -l < /tmp/count'
call 'echo two >> /tmp/count; wc -l < /tmp/count'
'''


def test_a_rollouts_agent_drives_its_worker_and_a_resume_replays_its_calls(client):
    worker = client.create("busybox")
    agents = []
    try:
        worker.exec("touch /tmp/count")
        agents.append(client.create("busybox", model_gateway=True))
        first = agents[0].rollout(WORKER_AGENT, "traj-w", workers=[worker]).wait(120)
        assert first.state == "succeeded" and first.worker_calls == 2 and first.worker_replays == 0, first.raw
        assert worker.exec("wc -l < /tmp/count").stdout.strip() == "2"
        # The trainer resumes the rollout in a new agent sandbox: the
        # agent's commands are answered from the worker's log, run nowhere.
        agents.append(client.create("busybox", model_gateway=True, fast_forward_from=agents[0]))
        again = agents[1].rollout(WORKER_AGENT, "traj-w", workers=[worker.id]).wait(120)
        assert again.state == "succeeded" and again.worker_replays == 2 and not again.divergence, again.raw
        assert again.result["stdout"] == first.result["stdout"]
        assert worker.exec("wc -l < /tmp/count").stdout.strip() == "2"
    finally:
        for sb in agents + [worker]:
            sb.close()
