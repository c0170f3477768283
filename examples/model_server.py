#!/usr/bin/env python3
"""A deterministic OpenAI-compatible model server, standing in for vLLM.

Its "policy" solves the agent task of examples/agent_gateway.py in a few
turns, reading the observations the agent sends back: it looks at the task
file, sums the numbers it sees, writes the answer and submits. Answers are a
function of the conversation alone, with token IDs and log probabilities as
vLLM returns them (``return_token_ids``), so a recorded rollout can be
compared with a replayed one.

It counts every request by a digest of its body: GET /stats returns
``{"calls": n, "by_digest": {digest: count}}``, which is how the example
proves that a resumed rollout did not send a recorded call again.

    python3 examples/model_server.py --port 0 --port-file /tmp/port
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import re
import threading
from typing import Any, Dict, List

_lock = threading.Lock()
_by_digest: Dict[str, int] = {}


def policy(messages: List[Dict[str, Any]]) -> str:
    """The next assistant message: a thought and one <bash> tool call, or
    <submit/>."""
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    last = str(messages[-1].get("content", "")) if messages else ""
    if turn == 0:
        return "Let me look at the task.\n<bash>cat task.txt</bash>"
    if turn == 1:
        nums = [int(x) for x in re.findall(r"-?\d+", last.split("numbers:", 1)[-1])]
        return f"The numbers sum to {sum(nums)}.\n<bash>echo {sum(nums)} > answer.txt</bash>"
    if turn == 2:
        return "Check what I wrote.\n<bash>cat answer.txt</bash>"
    return "Done.\n<submit/>"


def completion(body: Dict[str, Any]) -> Dict[str, Any]:
    text = policy(body.get("messages") or [])
    words = text.split()
    ids = [int(hashlib.sha256(w.encode()).hexdigest()[:6], 16) % 50000 for w in words]
    prompt_ids = [int(hashlib.sha256(json.dumps(body.get("messages")).encode()).hexdigest()[:6], 16) % 50000]
    return {
        "id": "cmpl-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12],
        "object": "chat.completion", "model": body.get("model", ""),
        "prompt_token_ids": prompt_ids,
        "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "token_ids": ids,
            "logprobs": {"content": [{"token": w, "logprob": -0.1 * (i % 7)} for i, w in enumerate(words)]},
        }],
        "usage": {"prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or []),
                  "completion_tokens": len(words)},
    }


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, obj: Any) -> None:
        b = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self) -> None:
        if self.path == "/stats":
            with _lock:
                self._send(200, {"calls": sum(_by_digest.values()), "by_digest": dict(_by_digest)})
            return
        self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        digest = hashlib.sha256(raw).hexdigest()
        with _lock:
            _by_digest[digest] = _by_digest.get(digest, 0) + 1
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, {"error": {"message": "only /v1/chat/completions"}})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, {"error": {"message": "not JSON"}})
            return
        self._send(200, completion(body))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", help="write the port here once listening")
    a = ap.parse_args()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    if a.port_file:
        with open(a.port_file + ".tmp", "w") as f:
            f.write(str(srv.server_address[1]))
        import os
        os.replace(a.port_file + ".tmp", a.port_file)
    srv.serve_forever()


if __name__ == "__main__":
    main()
