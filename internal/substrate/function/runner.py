"""dsec function runner: a warm Python interpreter that forks call processes.

The dsec agent starts it with fd 3 a unix socket. Each request is one JSON
line with the call process's stdin, stdout and stderr attached as file
descriptors, and with "mntns" a fourth: the mount namespace of the call's
slot (where the call's own directories are bound over /tmp, /var/tmp and
/dev/shm). The runner forks; the child enters that namespace, sets its
limits, drops to the call's uid and either runs a Python script in this
already initialised interpreter (modules pre-imported, nothing to start) or
execs a program. The runner answers {"id", "pid"} once the child is in the
namespace ({"id", "error": "runner: ..."} if it cannot be) and {"id",
"status", ...} when the child exits. It never prints: its stdout is not the
calls'.
"""

import builtins
import ctypes
import io
import json
import os
import resource
import selectors
import socket
import sys
import traceback

PRELOAD = [
    "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "fractions",
    "functools", "hashlib", "heapq", "itertools", "json", "math", "operator", "random", "re",
    "statistics", "string", "textwrap", "typing", "unittest", "numpy", "sympy",
]
for _m in PRELOAD:
    try:
        __import__(_m)
    except Exception:
        pass

import gc  # noqa: E402
import random  # noqa: E402

# Forked children write to every object they touch (reference counts);
# freezing keeps the collector from touching all of them too, so a call
# copies far fewer pages.
gc.collect()
gc.freeze()

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000


def enter_mount_namespace(fd):
    if libc.setns(fd, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNS): " + os.strerror(ctypes.get_errno()))


sock = socket.socket(fileno=3)
sel = selectors.DefaultSelector()


def send(obj):
    sock.sendall((json.dumps(obj) + "\n").encode())


def run_python(argv):
    # A fresh interpreter would have fresh random state: so does a fork.
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed(None)
        except Exception:
            pass
    sys.argv = list(argv)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=False)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), write_through=True)
    sys.path.insert(0, os.getcwd())
    status = 0
    try:
        with open(argv[0], "rb") as f:
            source = f.read()
        code = compile(source, argv[0], "exec")
        g = {"__name__": "__main__", "__file__": argv[0], "__builtins__": builtins}
        exec(code, g)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        # Show the program's frames only, as a fresh interpreter would.
        try:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != argv[0]:
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            # No memory left for the traceback (a program that exhausted
            # it): its type at least, so the verdict can name it.
            try:
                os.write(2, (type(e).__name__ + "\n").encode())
            except BaseException:
                pass
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = status or 1
    try:
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status)


def child(req, fds, ready):
    # The call's namespace first, as root, before anything else of the call
    # happens; the runner answers the agent once ready says so.
    try:
        if req.get("mntns"):
            enter_mount_namespace(fds[3])
        os.write(ready, b"ok")
        os.close(ready)
    except BaseException as e:
        try:
            os.write(ready, str(e).encode()[:1000] or b"failed")
        finally:
            os._exit(127)
    try:
        os.setsid()
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        os.closerange(3, 1 << 20)
        for name, (soft, hard) in req.get("rlimits", {}).items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        uid = req["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.umask(0o077)
        os.chdir(req["cwd"])
        env = dict(e.split("=", 1) for e in req.get("env", []) if "=" in e)
        if req.get("python"):
            os.environ.clear()
            os.environ.update(env)
            run_python(req["argv"])
        os.execvpe(req["argv"][0], req["argv"], env)
    except BaseException as e:
        try:
            os.write(2, (f"{req['argv'][0]}: {e}\n").encode())
        except BaseException:
            pass
        os._exit(127)


class Child:
    """A call process: its request id, pid, pidfd and, until the child
    has answered, the pipe it answers on."""

    def __init__(self, rid, pid, pfd, ready):
        self.rid, self.pid, self.pfd, self.ready = rid, pid, pfd, ready


children = {}  # pidfd -> Child
readies = {}  # ready pipe -> Child


def spawn(req, fds):
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        for fd in fds + [r, w]:
            os.close(fd)
        send({"id": req["id"], "error": f"fork: {e}"})
        return
    if pid == 0:
        os.close(r)
        child(req, fds, w)
    os.close(w)
    for fd in fds:
        os.close(fd)
    c = Child(req["id"], pid, os.pidfd_open(pid), r)
    children[c.pfd] = c
    readies[r] = c
    # The pid goes to the agent once the child is in the call's namespace;
    # the runner serves others meanwhile.
    sel.register(r, selectors.EVENT_READ, ("ready", c))
    sel.register(c.pfd, selectors.EVENT_READ, ("child", c))


def answered(c):
    """Reads the child's answer (it has written it, or died) and tells the
    agent the pid, or why the call cannot run."""
    r, c.ready = c.ready, None
    del readies[r]
    sel.unregister(r)
    try:
        ready = os.read(r, 1024)
    finally:
        os.close(r)
    if ready != b"ok":
        why = ready.decode(errors="replace") or "the call process died before it ran"
        send({"id": c.rid, "error": "runner: enter the call's mount namespace: " + why})
        return
    send({"id": c.rid, "pid": c.pid})


def exited(c):
    if c.ready is not None:
        answered(c)  # the pid (or the error) goes first
    del children[c.pfd]
    sel.unregister(c.pfd)
    _, status, ru = os.wait4(c.pid, 0)
    os.close(c.pfd)
    send({"id": c.rid, "status": status, "utime": ru.ru_utime, "stime": ru.ru_stime, "maxrss": ru.ru_maxrss})


def main():
    sel.register(sock, selectors.EVENT_READ, "sock")
    buf = b""
    fdq = []
    while True:
        for key, _ in sel.select():
            if key.data == "sock":
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
                if not data:
                    sys.exit(0)
                fdq.extend(fds)
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    n = req.get("nfds", 0)
                    mine, fdq[:] = fdq[:n], fdq[n:]
                    spawn(req, mine)
            else:
                # An event of this batch may be for a descriptor an earlier
                # one closed (and a spawn reused): act only on the child it
                # was registered for.
                kind, c = key.data
                if kind == "ready" and readies.get(key.fd) is c:
                    answered(c)
                elif kind == "child" and children.get(key.fd) is c:
                    exited(c)


if __name__ == "__main__":
    main()
