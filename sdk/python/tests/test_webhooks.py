"""Webhooks registered through the Python SDK, received by a plain HTTP
server as a trainer's would be, and checked with dsec.verify_signature."""

import http.server
import threading
import time

import pytest

import dsec


class _Receiver(http.server.BaseHTTPRequestHandler):
    got = []  # (headers, body), shared by the server's handler instances
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.lock:
            self.got.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _Receiver.got = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/hook"
    srv.shutdown()


def test_a_webhook_delivers_signed_events_until_deleted(client, receiver):
    job = f"py-hook-{time.monotonic_ns()}"
    secret = "py-webhook-secret"
    hook = client.create_webhook(receiver, secret, name="py", labels={"job": job}, types=["created"])
    assert isinstance(hook, dsec.Webhook) and hook.id and hook.enabled and hook.types == ["created"]
    assert hook.label_selector == f"job={job}" and hook.format == "dsec"
    assert any(w.id == hook.id for w in client.webhooks())
    try:
        sb = client.create(image="busybox", labels={"job": job}, ttl_s=600)
        deadline = time.monotonic() + 60
        while not _Receiver.got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _Receiver.got, "no delivery within a minute"
        headers, body = _Receiver.got[0]
        assert dsec.verify_signature(secret, headers, body)
        assert not dsec.verify_signature("another secret", headers, body)
        assert not dsec.verify_signature(secret, headers, body.replace(b"created", b"createx"))
        ev = dsec.Event._from(__import__("json").loads(body))
        assert ev.type == "created" and ev.sandbox_id == sb.id and ev.labels["job"] == job
        sb.close()
    finally:
        client.delete_webhook(hook)
    assert all(w.id != hook.id for w in client.webhooks())


def test_a_bad_registration_is_refused(client):
    with pytest.raises(dsec.InvalidRequest):
        client.create_webhook("file:///etc/passwd", "s")
    with pytest.raises(dsec.InvalidRequest):
        client.create_webhook("http://127.0.0.1:9/x", "")
