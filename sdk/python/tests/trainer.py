"""A tiny trainer for the preemption test: a session, a group of sandboxes,
steps with request IDs. `--resume` reopens the session and re-issues every
step; completed ones come back replayed."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dsec  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--url")
p.add_argument("--session")
p.add_argument("--state")  # file the trainer writes its sandbox IDs and progress to
p.add_argument("--steps", type=int, default=6)
p.add_argument("--resume", action="store_true")
args = p.parse_args()

client = dsec.Client(args.url)
sess = client.session(args.session, heartbeat_s=1, grace_s=3)
if args.resume:
    state = json.load(open(args.state))
    sandboxes = [client.sandbox(i) for i in state["ids"]]
else:
    sandboxes = client.create(image="busybox", count=3, session=sess, labels={"job": args.session})
    state = {"ids": [s.id for s in sandboxes], "done": 0}
    json.dump(state, open(args.state, "w"))

replayed = live = 0
for step in range(args.steps):
    for i, sb in enumerate(sandboxes):
        # Not idempotent: appends to a file. Exactly-once makes resuming safe.
        r = sb.exec(f"echo step{step} >> /tmp/trace; wc -l < /tmp/trace", request_id=dsec.request_id(f"traj{i}", step))
        replayed += r.replayed
        live += not r.replayed
        assert r.exit_code == 0, r
    state["done"] = step + 1
    json.dump(state, open(args.state, "w"))
    print(json.dumps({"step": step, "replayed": replayed, "live": live}), flush=True)
    time.sleep(0.3)

traces = [sb.exec("cat /tmp/trace").stdout for sb in sandboxes]
print(json.dumps({"final": True, "replayed": replayed, "live": live, "traces": traces}), flush=True)
sess.close()  # deletes the session's sandboxes
