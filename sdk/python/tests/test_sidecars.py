"""Sidecars and Compose files through the Python SDK, against a real server."""

import asyncio

import pytest

import dsec
from dsec.aio import AsyncClient
from dsec.compose import interpolate, sidecar_wire

WEB = {
    "name": "web",
    "image": "busybox",
    "command": ["sh", "-c", "mkdir -p /www && echo \"$GREETING\" > /www/index.html && echo serving && exec httpd -f -p 8080 -h /www"],
    "env": {"GREETING": "hello-from-web"},
    "healthcheck": {"command": ["wget", "-qO-", "http://127.0.0.1:8080/"], "start_interval_ms": 100, "retries": 50},
    "aliases": ["web.internal"],
    "memory_mb": 64,
}


def test_a_sidecar_serves_the_main_container_by_name(client):
    with client.create("busybox", ttl_s=300, sidecars=[WEB]) as sb:
        assert [(s["name"], s["state"]) for s in sb.info.sidecars] == [("web", "healthy")]
        assert sb.exec("wget -qO- http://web.internal:8080/").stdout == "hello-from-web\n"
        web = sb.container("web")
        assert web.exec("hostname; cat /www/index.html").stdout == "web\nhello-from-web\n"
        assert not sb.exists("/www/index.html")  # the main container's file system is its own
        web.write_file("/www/page.html", "from the files API\n")
        assert web.read_file("/www/page.html") == b"from the files API\n"
        assert sb.exec("wget -qO- http://web:8080/page.html").stdout == "from the files API\n"
        with pytest.raises(dsec.NotFound):
            sb.container("nope").exec("true")
        # The sidecar's log: what its process printed, followed live.
        for ev in web.logs(timeout_s=5):
            if ev.kind == "stdout":
                assert ev.data == b"serving\n"
                break


def test_a_sidecar_that_fails_fails_the_create_with_its_output(client):
    bad = {"name": "db", "image": "busybox", "command": ["sh", "-c", "echo missing config >&2; exit 2"]}
    with pytest.raises(dsec.InvalidRequest) as e:
        client.create("busybox", ttl_s=300, sidecars=[bad], labels={"sidecar-test": "bad"})
    assert 'sidecar "db"' in str(e.value) and "missing config" in str(e.value)
    assert not e.value.infra
    assert client.list(labels={"sidecar-test": "bad"}) == []


COMPOSE = """
services:
  main:
    image: busybox
    command: sleep infinity
  api:
    image: ${API_IMAGE:-busybox}
    command: sh -c 'mkdir -p /w && echo "$${WHO}" > /w/index.html && exec httpd -f -p 9000 -h /w'
    environment:
      WHO: ${WHO:?set WHO}
    healthcheck:
      test: ["CMD", "wget", "-qO-", "http://localhost:9000/"]
      start_interval: 100ms
      retries: 50
"""


def test_a_compose_file_makes_the_sandbox(client):
    with client.create(compose=COMPOSE, compose_env={"WHO": "compose"}, ttl_s=300) as sb:
        assert sb.info.image == "busybox"
        assert sb.exec("wget -qO- http://api:9000/").stdout == "compose\n"
    with pytest.raises(ValueError, match="set WHO"):
        client.create(compose=COMPOSE, compose_env={}, ttl_s=300)
    with pytest.raises(dsec.InvalidRequest, match="privileged"):
        client.create(compose="services:\n  main:\n    image: busybox\n    privileged: true\n", ttl_s=300)


def test_the_async_client_reaches_sidecars(server):
    async def run():
        async with AsyncClient(server.url) as c:
            sb = await c.create("busybox", ttl_s=300, sidecars=[WEB])
            try:
                r = await sb.exec("wget -qO- http://web:8080/")
                assert r.stdout == "hello-from-web\n"
                web = sb.container("web")
                assert (await web.exec("cat /www/index.html")).stdout == "hello-from-web\n"
                assert (await web.read_file("/www/index.html")) == b"hello-from-web\n"
                assert any(p.get("tag") == "service" for p in await web.processes())
            finally:
                await sb.close()

    asyncio.run(run())


def test_interpolation_and_wire_forms():
    env = {"A": "x", "E": ""}
    assert interpolate("$A ${A} ${B:-d} ${E:-d} ${E-d} $$A ${A:+y}${B+n}", env) == "x x d d  $A y"
    with pytest.raises(ValueError):
        interpolate("${B?needed}", env)
    w = sidecar_wire({"name": "db", "image": "pg", "depends_on": ["x", {"name": "y", "condition": "healthy"}],
                      "healthcheck": {"command": ["true"], "interval_ms": 500, "retries": 2}, "cpu": 0.5})
    assert w["dependsOn"] == [{"name": "x"}, {"name": "y", "condition": "healthy"}]
    assert w["healthcheck"] == {"command": ["true"], "intervalMs": "500", "retries": 2}
    assert w["resources"] == {"cpu": 0.5}
    with pytest.raises(ValueError, match="unknown keys"):
        sidecar_wire({"name": "db", "image": "pg", "ports": [5432]})
    with pytest.raises(ValueError, match="list of strings"):
        sidecar_wire({"name": "db", "image": "pg", "command": "postgres -D /data"})


def test_shared_volumes_between_the_containers(client):
    writer = {"name": "writer", "image": "busybox", "volumes": ["data:/out"],
              "command": ["sh", "-c", "echo hi > /out/f && chown 1000 /out/f && exec sleep 600"]}
    with client.create("busybox", ttl_s=300, sidecars=[writer], shared_volumes=[{"name": "data", "size_mb": 64}],
                       volumes=["data:/data:ro"]) as sb:
        r = sb.exec("for i in $(seq 100); do [ \"$(stat -c %u /data/f 2>/dev/null)\" = 1000 ] && break; sleep 0.05; done; "
                    "cat /data/f; stat -c %u /data/f; "
                    "touch /data/g 2>&1 | grep -c 'Read-only'; df -m /data | awk 'NR==2 {print $2}'")
        out = r.stdout.split()
        assert out[:3] == ["hi", "1000", "1"], r
        assert 40 < int(out[3]) <= 64, r
