"""Image builds and commits through the Python SDK, against a real server;
the context's .dockerignore rules checked on their own."""

import asyncio
import functools
import http.server
import io
import os
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
import uuid

import pytest

import dsec
from dsec.build import DockerIgnore, context_tar, from_map


def _context(tmp_path, dockerfile):
    (tmp_path / "Dockerfile").write_text(dockerfile)
    (tmp_path / "app.py").write_text("print('app')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("kept\n")
    (tmp_path / "data" / "drop.log").write_text("dropped\n")
    (tmp_path / "solution.txt").write_text("the answer\n")
    (tmp_path / ".dockerignore").write_text("# task files the agent must not see\nsolution.txt\ndata/*.log\n")
    return tmp_path


def test_a_context_is_built_into_an_image_with_its_config_and_a_rebuild_is_cached(client, tmp_path):
    ctx = _context(tmp_path, "FROM base-alias AS b\nARG GREETING=hello\nWORKDIR /app\nCOPY app.py data ./\n"
                             "RUN echo \"$GREETING\" > greeting && ls\nFROM b\nENV MODE=test\nUSER 1000\n")
    name = "py-build-" + uuid.uuid4().hex[:8]
    seen = []
    img = client.build_image(name, str(ctx), build_args={"GREETING": "hi"}, image_map={"base-alias": "busybox"},
                             on_progress=seen.append)
    assert img["name"] == name and img["source"] == "build"
    assert img["config"]["workdir"] == "/app" and img["config"]["user"] == "1000" and "MODE=test" in img["config"]["env"]
    steps = [m["message"] for m in seen if m.get("phase") == "step"]
    assert steps[0].startswith("[1/") and any("RUN echo" in s for s in steps)
    output = "".join(m.get("message", "") for m in seen if m.get("phase") == "output")
    assert "app.py" in output and "keep.txt" in output and "drop.log" not in output and "solution" not in output
    with client.create(name, ttl_s=300) as sb:
        r = sb.exec("id -u; pwd; cat greeting; ls /app; echo $MODE")
        assert r.stdout == "1000\n/app\nhi\napp.py\ngreeting\nkeep.txt\ntest\n", r.output
        # commit: the sandbox's change becomes an image; the sandbox goes on
        sb.exec("echo more > /tmp/more")
        c = sb.commit(name + "-c")
        assert c["name"] == name + "-c"
        assert sb.exec("cat /tmp/more").stdout == "more\n"
    with client.create(name + "-c", ttl_s=300) as sb:
        assert sb.exec("cat /tmp/more greeting").stdout == "more\nhi\n"
    seen.clear()
    again = client.build_image(name, str(ctx), build_args={"GREETING": "hi"}, image_map={"base-alias": "busybox"},
                               on_progress=seen.append)
    assert again["layers"] == img["layers"]
    assert all(m.get("cached") for m in seen if m.get("phase") == "step" and ("RUN" in m["message"] or "COPY" in m["message"]))
    pruned = client.prune_images()
    assert pruned["build_steps"] > 0 and pruned["copies"] == 0, pruned
    assert client.prune_build_cache() == 0


def test_a_failing_step_raises_invalid_with_its_output_and_stores_nothing(client, tmp_path):
    name = "py-broken-" + uuid.uuid4().hex[:8]
    with pytest.raises(dsec.InvalidRequest) as e:
        client.build_image(name, dockerfile_text="FROM busybox\nRUN echo compiling; exit 7\n")
    assert "exit code 7" in str(e.value) and "compiling" in str(e.value)
    assert e.value.infra is False
    assert name not in [i["name"] for i in client.images()]
    assert client.list(selector="dsec.io/build") == []
    with pytest.raises(dsec.InvalidRequest):
        client.build_image(name, str(_context(tmp_path, "FROM busybox\nCOPY solution.txt /\n")))


@pytest.fixture()
def registry(tmp_path):
    """The distribution's registry on a free loopback port (plain HTTP)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = tmp_path / "registry.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
                   f"http:\n  addr: {host}\n")
    p = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://{host}/v2/", timeout=1).close()
                break
            except OSError:
                assert p.poll() is None, "the registry exited"
                time.sleep(0.05)
        yield host
    finally:
        p.kill()
        p.wait()


def test_a_built_image_goes_to_a_registry_and_comes_back(client, registry, tmp_path):
    name = "py-push-" + uuid.uuid4().hex[:8]
    client.build_image(name, str(_context(tmp_path, "FROM busybox\nCOPY app.py /srv/\nCMD [\"cat\", \"/srv/app.py\"]\n")))
    pushed = client.push_image(name, f"{registry}/py/{name}:1", insecure=True)
    assert pushed.startswith(f"{registry}/py/{name}@sha256:")
    img = client.pull_image(f"{registry}/py/{name}:1", name + "-back", insecure=True)
    assert img["name"] == name + "-back" and img["config"]["cmd"] == ["cat", "/srv/app.py"]
    with client.create(name + "-back", ttl_s=300) as sb:
        assert sb.exec("cat /srv/app.py").stdout == "print('app')\n"
    with pytest.raises(dsec.NotFound):
        client.push_image("py-no-such-image", f"{registry}/py/x:1", insecure=True)


def test_an_image_pushed_on_demand_runs_on_another_server_without_its_data(client, registry, tmp_path):
    from conftest import Server

    name = "py-lazy-" + uuid.uuid4().hex[:8]
    client.build_image(name, str(_context(tmp_path, "FROM busybox\nCOPY app.py /srv/\nCMD [\"cat\", \"/srv/app.py\"]\n")))
    pushed = client.push_image(name, f"{registry}/py/{name}:1", insecure=True, on_demand=True)
    assert pushed.startswith(f"{registry}/py/{name}@sha256:")
    other = Server()
    try:
        c2 = dsec.Client(other.url)
        img = c2.pull_image(f"{registry}/py/{name}:1", name, insecure=True)
        assert "on demand" in img["source"] and img["config"]["cmd"] == ["cat", "/srv/app.py"]
        # The layer the build added is on the other server as its metadata
        # only, its data read from the registry as the sandbox reads it.
        top = img["layers"][-1].removeprefix("sha256:")
        layers = os.path.join(other.data_dir, "images", "layers")
        assert os.path.exists(os.path.join(layers, top + ".lazy"))
        assert not os.path.exists(os.path.join(layers, top + ".blob"))
        with c2.create(name, ttl_s=300) as sb:
            assert sb.exec("cat /srv/app.py").stdout == "print('app')\n"
        listed = [i for i in c2.images() if i["name"] == name][0]
        od = listed["onDemand"]
        assert int(od["dataBytes"]) > 0 and 0 < int(od.get("cachedBytes", 0)) <= int(od["dataBytes"])
    finally:
        other.stop()


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server that answers range requests, as object stores do."""

    def log_message(self, *args):
        pass

    def send_head(self):
        rng = self.headers.get("Range")
        if not rng:
            return super().send_head()
        path = self.translate_path(self.path)
        size = os.path.getsize(path)
        first, last = rng.removeprefix("bytes=").split("-")
        first, last = int(first), min(int(last or size - 1), size - 1)
        f = open(path, "rb")
        f.seek(first)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        return io.BytesIO(f.read(last - first + 1))


def test_an_exported_image_served_over_plain_http_runs_on_another_server(client, tmp_path):
    from conftest import Server

    name = "py-export-" + uuid.uuid4().hex[:8]
    client.build_image(name, str(_context(tmp_path, "FROM busybox\nCOPY app.py /srv/\nCMD [\"cat\", \"/srv/app.py\"]\n")))
    buf = io.BytesIO()
    client.export_image(name, buf)
    site = tmp_path / "site" / "tasks" / name
    site.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        names = tf.getnames()
        assert "index.json" in names and "oci-layout" in names, names
        for m in tf.getmembers():
            assert m.isfile() or m.isdir(), m.name
            assert not m.name.startswith("/") and ".." not in m.name.split("/"), m.name
        tf.extractall(site)
    handler = functools.partial(_RangeHandler, directory=str(tmp_path / "site"))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    other = Server()
    try:
        c2 = dsec.Client(other.url)
        img = c2.pull_image(f"http://127.0.0.1:{web.server_address[1]}/tasks/{name}/", name)
        assert "on demand" in img["source"] and img["config"]["cmd"] == ["cat", "/srv/app.py"]
        with c2.create(name, ttl_s=300) as sb:
            assert sb.exec("cat /srv/app.py").stdout == "print('app')\n"
    finally:
        other.stop()
        web.shutdown()


def test_the_async_client_builds_too(server, tmp_path):
    ctx = _context(tmp_path, "FROM busybox\nCOPY app.py /\n")

    async def go():
        async with dsec.AsyncClient(server.url) as c:
            img = await c.build_image("py-async-" + uuid.uuid4().hex[:8], str(ctx))
            sb = await c.create(img["name"], ttl_s=300)
            try:
                return (await sb.exec("cat /app.py")).stdout
            finally:
                await sb.close()

    assert asyncio.run(go()) == "print('app')\n"


@pytest.mark.parametrize("lines, path, excluded", [
    ("*.log", "x.log", True),
    ("*.log", "sub/x.log", False),  # * stays inside one path element
    ("**/*.log", "sub/deep/x.log", True),
    ("**/*.log", "x.log", True),  # ** matches no element as well
    ("build", "build/out/x", True),  # a directory's pattern excludes what is inside it
    ("build/**", "build", False),  # a trailing ** needs at least one element
    ("/secret", "secret", True),  # a leading / is the root
    ("data\n!data/keep.txt", "data/keep.txt", False),
    ("data\n!data/keep.txt", "data/other", True),
    ("!a\na", "a", True),  # the last matching line decides
    ("# comment\n\n  spaced  ", "spaced", True),
    (" #x", "#x", True),  # a # after a space is a pattern, as in Docker
    ("[a-c].txt", "b.txt", True),
    ("[a-c].txt", "d.txt", False),
])
def test_dockerignore_follows_dockers_rules(lines, path, excluded):
    assert DockerIgnore(lines).excluded(path) is excluded


def test_a_lone_exception_mark_is_refused():
    with pytest.raises(ValueError):
        DockerIgnore("!\n")


def test_the_context_tar_sends_exceptions_under_excluded_directories_and_never_follows_links(tmp_path):
    (tmp_path / "vendor" / "keep").mkdir(parents=True)
    (tmp_path / "vendor" / "keep" / "a.txt").write_text("a")
    (tmp_path / "vendor" / "junk.txt").write_text("j")
    (tmp_path / "link").symlink_to("/etc/passwd")
    (tmp_path / ".dockerignore").write_text("vendor\n!vendor/keep/a.txt\n")
    buf = io.BytesIO()
    assert context_tar(str(tmp_path), buf) == 2  # .dockerignore and a.txt
    buf.seek(0)
    with tarfile.open(fileobj=buf) as t:
        members = {m.name: m for m in t.getmembers()}
    assert sorted(members) == [".dockerignore", "link", "vendor", "vendor/keep", "vendor/keep/a.txt"]
    assert members["link"].issym() and members["link"].linkname == "/etc/passwd"
    assert members["vendor/keep"].isdir() and members["vendor/keep/a.txt"].isreg()


def test_from_map_renames_base_images_only():
    df = "FROM --platform=linux/amd64 python:3.11 AS build\nRUN echo FROM python:3.11\nFROM build\nfrom python:3.11\n"
    assert from_map(df, {"python:3.11": "py311"}) == (
        "FROM --platform=linux/amd64 py311 AS build\nRUN echo FROM python:3.11\nFROM build\nfrom py311\n")


def test_layers_compose_a_toolkit_and_a_workspace_over_a_task_image_at_create(client, tmp_path):
    tag = uuid.uuid4().hex[:8]
    # A toolkit built from scratch (its own files only) and a workspace
    # committed from a sandbox of the base.
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY run.sh /opt/tool/run.sh\n")
    (tmp_path / "run.sh").write_text("echo tool sees $(cat /work/task.txt)\n")
    toolkit = "py-toolkit-" + tag
    client.build_image(toolkit, str(tmp_path))
    workspace = "py-workspace-" + tag
    with client.create("busybox", ttl_s=300) as sb:
        sb.exec("mkdir -p /work && echo task-7 > /work/task.txt")
        sb.commit(workspace)
    with client.create("busybox", layers=[workspace, toolkit], ttl_s=300) as sb:
        assert sb.exec("sh /opt/tool/run.sh").stdout == "tool sees task-7\n"
        assert client.get(sb.id).info.raw["spec"]["layers"] == [workspace, toolkit]
    with pytest.raises(dsec.NotFound):
        client.create("busybox", layers=["py-no-such-" + tag])
