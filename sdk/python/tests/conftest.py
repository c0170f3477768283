"""Starts a real `dsec serve` for the SDK tests (root, crun, busybox-static)."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary() -> str:
    path = os.environ.get("DSEC_BIN")
    if not path and os.environ.get("DSEC_TEST_BIN"):  # make test-python: the binaries just built
        path = os.path.join(os.environ["DSEC_TEST_BIN"], "dsec")
    path = path or os.path.join(ROOT, "bin", "dsec")
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing: run `make build`")
    return path


class Server:
    def __init__(self, api_keys=()):
        if os.geteuid() != 0:
            pytest.skip("needs root (container sandboxes)")
        for tool in ("crun", "nft"):
            if not shutil.which(tool):
                pytest.skip(f"needs {tool}")
        self.data_dir = tempfile.mkdtemp(prefix="dsec-py-")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Names and a subnet of this process's own: under pytest-xdist
        # (make test-python runs workers side by side) each worker's server
        # gets a second octet of its own.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        n = int(worker[2:]) if worker.startswith("gw") else os.getpid() % 10000
        self.bridge = f"dpy{n}-{self.port % 1000}"
        self.table = f"dsecpy_{n}_{self.port}"
        args = [
            _binary(), "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", self.data_dir,
            "--bootstrap", "busybox,debian", "--log-level", "warn", "--bridge", self.bridge,
            "--subnet", f"10.{150 + n % 50}.{self.port % 256}.0/24", "--nft-table", self.table,
        ]
        for k in api_keys:
            args += ["--api-key", k]
        self.log = open(os.path.join(self.data_dir, "serve.log"), "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900  # a cold debian bootstrap takes a minute or more
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("dsec serve did not start:\n" + open(self.log.name).read())
            time.sleep(0.05)

    def stop(self):
        import dsec

        try:
            c = dsec.Client(self.url, os.environ.get("DSEC_TEST_KEY"))
            for s in c.list():
                c.delete(s.id)
        except Exception:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for family in ("inet", "bridge"):  # the server keeps its tables for a restart
            subprocess.run(["nft", "delete", "table", family, self.table], capture_output=True)
        if os.environ.get("DSEC_TEST_KEEP"):  # for a post-mortem: the data directory and serve.log
            print(f"kept {self.data_dir}")
            return
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server():
    s = Server()
    os.environ["DSEC_URL"] = s.url  # for code that builds its own client, as frameworks do
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    import dsec

    c = dsec.Client(server.url)
    yield c
    c.close()


@pytest.fixture()
def sandbox(client):
    sb = client.create(image="busybox", ttl_s=600, labels={"test": "py"})
    yield sb
    sb.close()
