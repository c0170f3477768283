"""Prints the server-test pass rate of an E2B SDK test run against dsec (see run.sh).

usage: report.py SDK_DIR NOSERVER.json DSEC.json
"""
import json
import os
import sys


def results(path):
    with open(path) as f:
        report = json.load(f)
    out = {}
    for file in report["testResults"]:
        name = file["name"].split("/tests/", 1)[1]
        for t in file["assertionResults"]:
            msg = (t.get("failureMessages") or [""])[0]
            out[(name, t["fullName"])] = (t["status"], " ".join(msg.split())[:240])
    return out


def mocked(sdk, name):
    with open(os.path.join(sdk, "tests", name)) as f:
        return "from 'msw" in f.read()


sdk, noserver, dsec = sys.argv[1:4]
alone = results(noserver)
run = results(dsec)
server = [k for k in run if not mocked(sdk, k[0]) and alone.get(k, ("",))[0] != "passed"]
passed = [k for k in server if run[k][0] == "passed"]
skipped = [k for k in server if run[k][0] in ("skipped", "pending", "todo")]
print(f"client-only tests: {len(run) - len(server)}")
print(f"server tests: {len(server)}, passed {len(passed)} ({100 * len(passed) / max(len(server), 1):.1f}%), "
      f"skipped {len(skipped)}")
for k in server:
    status, msg = run[k]
    if status not in ("passed", "skipped", "pending", "todo"):
        print(f"FAIL {k[0]} > {k[1]} | {msg}")
