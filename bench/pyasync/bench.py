#!/usr/bin/env python3
"""Benchmarks the Python SDK's clients side by side from one process (not a
test: it prints numbers). Three measurements, each run with every client
against the same server and sandboxes:

  long     N concurrent long execs (`sleep S`) spread over the sandboxes:
           calls in flight at once, wall time, client CPU per call.
  short    M short execs (`true`) at concurrency C: calls/s, client CPU per call.
  issue    64 concurrent `sleep 1` (the case issue 23 measured at 11.1 s).

Clients: dsec.AsyncClient (native asyncio, pooled connections), the sync
dsec.Client with one thread per call in flight, and the previous
AsyncClient's design (the sync client in asyncio.to_thread: the default
executor's width in flight).

    python3 bench/pyasync/bench.py                       # starts bin/dsec serve
    python3 bench/pyasync/bench.py --url http://127.0.0.1:7070 --long 1000 --sleep 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "sdk", "python"))
import dsec  # noqa: E402


class Server:
    """A throwaway `dsec serve` (root, crun) on a free port."""

    def __init__(self, binary: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="dsec-bench-py-")
        self.url = f"http://127.0.0.1:{self.port}"
        n = os.getpid() % 10000
        self.bridge, self.table = f"dbp{n}-{self.port % 1000}", f"dsecbp_{n}_{self.port}"
        args = [binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", self.dir,
                "--bootstrap", "busybox", "--log-level", "warn", "--bridge", self.bridge,
                "--subnet", f"10.{200 + n % 50}.{self.port % 256}.0/24", "--nft-table", self.table]
        self.log = open(os.path.join(self.dir, "serve.log"), "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit("dsec serve did not start:\n" + open(self.log.name).read())
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Gauge:
    """Calls in flight now and at most."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.now = self.peak = 0

    def enter(self) -> None:
        with self.mu:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.mu:
            self.now -= 1


class Sampler(threading.Thread):
    """Counts the benchmark's processes running in the sandboxes, as the
    server lists them, every 0.2 s: calls really in flight. Its own CPU
    time is kept apart from the client's."""

    def __init__(self, url: str, ids: List[str], word: str) -> None:
        super().__init__(daemon=True)
        self.c = dsec.Client(url)
        self.ids, self.word = ids, word
        self.peak = 0
        self.cpu = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.thread_time()
        while not self.stop.wait(0.2):
            n = 0
            for i in self.ids:
                m = self.c._t.unary("dsec.v1.ProcessService", "ListProcesses", {"sandboxId": i})
                n += sum(1 for p in m.get("processes", []) if p.get("running") and self.word in " ".join(p.get("argv", [])))
            self.peak = max(self.peak, n)
        self.cpu = time.thread_time() - t0


def measure(f: Callable[[], int], sampler: Optional[Sampler] = None) -> Tuple[float, float, int]:
    """(wall s, client CPU s, calls) of f, which returns its call count."""
    if sampler:
        sampler.start()
    w0, c0 = time.perf_counter(), time.process_time()
    n = f()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if sampler:
        sampler.stop.set()
        sampler.join()
        cpu -= sampler.cpu
    return wall, cpu, n


def run_native(url: str, ids: List[str], cmds: List[str], conc: int, g: Gauge) -> int:
    async def main() -> int:
        ac = dsec.AsyncClient(url)
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                g.enter()
                try:
                    r = await ac.sandbox(ids[i % len(ids)]).exec(cmds[i], timeout_s=600)
                    assert r.exit_code == 0, r
                finally:
                    g.leave()

        await asyncio.gather(*(one(i) for i in range(len(cmds))))
        await ac.close()
        return len(cmds)

    return asyncio.run(main())


def run_threads(url: str, ids: List[str], cmds: List[str], conc: int, g: Gauge) -> int:
    c = dsec.Client(url)
    sbs = [c.sandbox(i) for i in ids]

    def one(i: int) -> None:
        g.enter()
        try:
            r = sbs[i % len(sbs)].exec(cmds[i], timeout_s=600)
            assert r.exit_code == 0, r
        finally:
            g.leave()

    with ThreadPoolExecutor(conc) as pool:
        list(pool.map(one, range(len(cmds))))
    return len(cmds)


def run_to_thread(url: str, ids: List[str], cmds: List[str], conc: int, g: Gauge) -> int:
    """The previous AsyncClient: every call in asyncio.to_thread."""
    c = dsec.Client(url)
    sbs = [c.sandbox(i) for i in ids]

    async def main() -> int:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                g.enter()
                try:
                    r = await asyncio.to_thread(sbs[i % len(sbs)].exec, cmds[i], timeout_s=600)
                    assert r.exit_code == 0, r
                finally:
                    g.leave()

        await asyncio.gather(*(one(i) for i in range(len(cmds))))
        return len(cmds)

    return asyncio.run(main())


CLIENTS: Dict[str, Callable[..., int]] = {
    "AsyncClient (native)": run_native,
    "sync Client, 1 thread/call": run_threads,
    "sync Client in to_thread (old AsyncClient)": run_to_thread,
}


def row(name: str, wall: float, cpu: float, n: int, peak: int) -> str:
    return (f"  {name:<44}{peak:>8}{wall:>10.2f}{n / wall:>10.1f}{1000 * cpu / n:>12.3f}")


def header(title: str) -> None:
    print(f"\n{title}")
    print(f"  {'client':<44}{'peak':>8}{'wall s':>10}{'calls/s':>10}{'CPU ms/call':>12}")
    print("  (peak: for sleeps, processes seen running in the sandboxes at once; for `true`, calls the client had in flight)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing server (default: start bin/dsec serve)")
    p.add_argument("--sandboxes", type=int, default=16)
    p.add_argument("--long", type=int, default=1000, help="concurrent long execs")
    p.add_argument("--sleep", type=float, default=5.0, help="seconds each long exec sleeps")
    p.add_argument("--short", type=int, default=2000, help="short execs")
    p.add_argument("--conc", type=int, default=64, help="concurrency of the short execs")
    p.add_argument("--skip", default="", help="comma-separated measurements to skip (long,short,issue)")
    args = p.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per call in flight
    srv = None
    url = args.url
    if not url:
        srv = Server(os.path.join(ROOT, "bin", "dsec"))
        url = srv.url
    c = dsec.Client(url)
    sbs = c.create(image="busybox", count=args.sandboxes, labels={"bench": "pyasync"}, pids=4096, ttl_s=3600)
    ids = [s.id for s in sbs]
    skip = set(args.skip.split(","))
    try:
        print(f"server {url}; {len(ids)} busybox sandboxes; python {sys.version.split()[0]}; "
              f"{os.cpu_count()} CPUs; max_connections {dsec.AsyncClient(url).max_connections}")
        if "long" not in skip:
            header(f"long: {args.long} concurrent `sleep {args.sleep:g}` execs")
            cmds = [f"sleep {args.sleep:g}"] * args.long
            for name, f in list(CLIENTS.items())[:2]:
                g = Gauge()
                smp = Sampler(url, ids, "sleep")
                wall, cpu, n = measure(lambda: f(url, ids, cmds, args.long, g), smp)
                print(row(name, wall, cpu, n, smp.peak), flush=True)
            print(f"  (the old AsyncClient would hold {min(32, (os.cpu_count() or 1) + 4)} in flight: "
                  f"~{args.long / min(32, (os.cpu_count() or 1) + 4) * args.sleep:.0f} s; not run)")
        if "short" not in skip:
            header(f"short: {args.short} `true` execs, {args.conc} in flight")
            cmds = ["true"] * args.short
            for name, f in CLIENTS.items():
                g = Gauge()
                wall, cpu, n = measure(lambda: f(url, ids, cmds, args.conc, g))
                print(row(name, wall, cpu, n, g.peak), flush=True)
        if "issue" not in skip:
            header("issue: 64 concurrent `sleep 1` execs")
            cmds = ["sleep 1"] * 64
            for name, f in CLIENTS.items():
                g = Gauge()
                smp = Sampler(url, ids, "sleep")
                wall, cpu, n = measure(lambda: f(url, ids, cmds, 64, g), smp)
                print(row(name, wall, cpu, n, smp.peak), flush=True)
    finally:
        for s in sbs:
            try:
                s.close()
            except dsec.DsecError:
                pass
        if srv is not None:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
