"""The code interpreter of dsec's E2B facade, run inside the sandbox.

    python3 -c 'import sys; exec(sys.argv[1])' "$SOURCE" manager PORT
        Starts the manager in the background and exits once it listens on
        127.0.0.1:PORT (or once it finds one already listening).

The manager keeps one worker per context: a long-lived python3 process
whose globals persist between executions. A client connects, sends one
JSON request line and reads the answer: a header line, {} or
{"error": "not_found" | "invalid", "message": ...} (dsec's error kinds),
and then, for "execute", the execution's output as NDJSON lines in E2B's
format (stdout, stderr, result, error, number_of_executions). Closing the
connection during an execution interrupts it (KeyboardInterrupt).

Requests: {"op": "execute", "code", "context_id", "language", "env_vars"},
{"op": "create_context", "language", "cwd"}, {"op": "list_contexts"},
{"op": "delete_context", "id"}, {"op": "restart_context", "id"}.
"""

import base64
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid

BOOT = "import sys; exec(sys.argv[1])"
SOURCE = sys.argv[1] if len(sys.argv) > 1 else ""
LANGUAGES = ("", "python", "python3")


def send_line(f, obj):
    f.write(json.dumps(obj).encode() + b"\n")
    f.flush()


class Context:
    def __init__(self, cid, cwd):
        self.id = cid
        self.cwd = cwd
        self.lock = threading.Lock()
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", BOOT, SOURCE, "worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=self.cwd, start_new_session=True)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()

    def restart(self):
        self.stop()
        self.start()

    def info(self):
        return {"id": self.id, "language": "python", "cwd": self.cwd}

    def execute(self, conn, out, req):
        """Runs one request in the worker and relays its output to out."""
        with self.lock:
            if self.proc.poll() is not None:
                self.start()
            done = threading.Event()
            gone = threading.Event()

            def watch_client():
                # The client sends nothing more; EOF means it went away.
                try:
                    while conn.recv(1):
                        pass
                except OSError:
                    pass
                if not done.is_set():
                    gone.set()
                    try:
                        os.kill(self.proc.pid, signal.SIGINT)
                    except OSError:
                        pass

            threading.Thread(target=watch_client, daemon=True).start()
            try:
                send_line(self.proc.stdin, {"code": req.get("code") or "", "env_vars": req.get("env_vars") or {}})
            except OSError:
                pass
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait()
                    msg = {"type": "error", "name": "KernelDied",
                           "value": "the interpreter process ended (exit status %s); the context restarts with a fresh state" % self.proc.returncode,
                           "traceback": ""}
                    if not gone.is_set():
                        try:
                            send_line(out, msg)
                        except OSError:
                            pass
                    break
                if line.startswith(b'{"type": "__done__"'):
                    break
                if not gone.is_set():
                    try:
                        out.write(line)
                        out.flush()
                    except OSError:
                        gone.set()
                        try:
                            os.kill(self.proc.pid, signal.SIGINT)
                        except OSError:
                            pass
            done.set()


class Manager:
    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}

    def context(self, cid, language, create_default):
        if (language or "") not in LANGUAGES:
            return None, ("invalid", "language %r is not supported by this sandbox (only python)" % language)
        with self.lock:
            if cid:
                ctx = self.contexts.get(cid)
                if ctx is None:
                    return None, ("not_found", "context %s not found" % cid)
                return ctx, None
            ctx = self.contexts.get("default")
            if ctx is None and create_default:
                ctx = self.contexts["default"] = Context("default", os.getcwd())
            return ctx, None

    def handle(self, conn):
        f = conn.makefile("rwb")
        try:
            line = f.readline()
            try:
                req = json.loads(line)
            except ValueError:
                send_line(f, {"error": "invalid", "message": "the request is not JSON"})
                return
            op = req.get("op")
            if op == "execute":
                ctx, err = self.context(req.get("context_id"), req.get("language"), True)
                if err:
                    send_line(f, {"error": err[0], "message": err[1]})
                    return
                send_line(f, {})
                ctx.execute(conn, f, req)
            elif op == "create_context":
                if (req.get("language") or "") not in LANGUAGES:
                    send_line(f, {"error": "invalid", "message": "language %r is not supported by this sandbox (only python)" % req.get("language")})
                    return
                cwd = req.get("cwd") or os.getcwd()
                if not os.path.isdir(cwd):
                    send_line(f, {"error": "invalid", "message": "cwd %s is not a directory" % cwd})
                    return
                ctx = Context(uuid.uuid4().hex, cwd)
                with self.lock:
                    self.contexts[ctx.id] = ctx
                send_line(f, {})
                send_line(f, ctx.info())
            elif op == "list_contexts":
                with self.lock:
                    infos = [c.info() for c in self.contexts.values()]
                send_line(f, {})
                send_line(f, infos)
            elif op in ("delete_context", "restart_context"):
                with self.lock:
                    ctx = self.contexts.get(req.get("id") or "")
                    if ctx is not None and op == "delete_context":
                        del self.contexts[ctx.id]
                if ctx is None:
                    send_line(f, {"error": "not_found", "message": "context %s not found" % req.get("id")})
                    return
                with ctx.lock:
                    if op == "delete_context":
                        ctx.stop()
                    else:
                        ctx.restart()
                send_line(f, {})
                send_line(f, {})
            else:
                send_line(f, {"error": "invalid", "message": "unknown op %r" % op})
        except OSError:
            pass
        finally:
            # shutdown, not just close: the client watcher thread is blocked
            # in recv on this socket, and close alone would neither wake it
            # nor send the client its EOF.
            for end in (lambda: conn.shutdown(socket.SHUT_RDWR), f.close, conn.close):
                try:
                    end()
                except OSError:
                    pass


def manager(port):
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        status = os.read(r, 4096).decode(errors="replace")
        if status in ("ok", "busy"):
            sys.exit(0)
        sys.stderr.write("code interpreter: %s\n" % status)
        sys.exit(1)
    os.close(r)
    os.setsid()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("127.0.0.1", port))
    except OSError as e:
        os.write(w, b"busy" if e.errno == errno.EADDRINUSE else str(e).encode())
        os._exit(0)
    srv.listen(128)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.write(w, b"ok")
    os.close(w)
    m = Manager()
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            continue
        threading.Thread(target=m.handle, args=(conn,), daemon=True).start()


def worker():
    import ast
    import builtins
    import io
    import linecache
    import traceback

    # The protocol runs on private copies of stdin and stdout; the
    # process's own fds point at /dev/null so user code cannot disturb it.
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(null, 2)
    lock = threading.Lock()

    def emit(obj):
        with lock:
            proto_out.write(json.dumps(obj).encode() + b"\n")
            proto_out.flush()

    class Stream(io.TextIOBase):
        """Line-buffered output: one message per line (a partial line goes
        out when the execution ends or a lot of it piles up)."""

        def __init__(self, name):
            self.kind = name
            self.buf = ""

        def write(self, s):
            s = str(s)
            self.buf += s
            cut = self.buf.rfind("\n") + 1
            if cut == 0 and len(self.buf) >= 8192:
                cut = len(self.buf)
            if cut:
                text, self.buf = self.buf[:cut], self.buf[cut:]
                emit({"type": self.kind, "text": text})
            return len(s)

        def flush(self):
            if self.buf:
                text, self.buf = self.buf, ""
                emit({"type": self.kind, "text": text})

        def isatty(self):
            return False

        def writable(self):
            return True

    sys.stdout = Stream("stdout")
    sys.stderr = Stream("stderr")
    sys.stdin = open(os.devnull)
    sys.argv = [""]

    def formats(value):
        try:
            data = {"text": repr(value)}
        except Exception as e:  # a broken __repr__
            data = {"text": "<%s object (repr failed: %s)>" % (type(value).__name__, e)}
        for attr, key, binary in (("_repr_html_", "html", False), ("_repr_markdown_", "markdown", False),
                                  ("_repr_svg_", "svg", False), ("_repr_png_", "png", True),
                                  ("_repr_jpeg_", "jpeg", True), ("_repr_latex_", "latex", False),
                                  ("_repr_json_", "json", False), ("_repr_javascript_", "javascript", False)):
            fn = getattr(value, attr, None)
            if callable(fn):
                try:
                    v = fn()
                except Exception:
                    continue
                if v is None:
                    continue
                if binary and isinstance(v, bytes):
                    v = base64.b64encode(v).decode()
                data[key] = v
        return data

    def display(*objs):
        for o in objs:
            emit(dict(formats(o), type="result", is_main_result=False))

    ns = {"__name__": "__main__", "__builtins__": builtins, "display": display}

    def run(code, n):
        # Each cell gets a file name of its own, with its source in
        # linecache, so tracebacks and inspect show its lines.
        name = "<cell-%d>" % n
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), ns)
            sys.stdout.flush()
            sys.stderr.flush()
            if value is not None:
                ns["_"] = value
                emit(dict(formats(value), type="result", is_main_result=True))

    # An interrupt (the client went away) stops the execution it was meant
    # for and is ignored between executions.
    running = [False]

    def interrupt(signum, frame):
        if running[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    count = 0
    while True:
        line = proto_in.readline()
        if not line:
            return
        req = json.loads(line)
        count += 1
        saved = {}
        try:
            for k, v in (req.get("env_vars") or {}).items():
                saved[k] = os.environ.get(k)
                os.environ[k] = str(v)
            running[0] = True
            run(req["code"], count)
            running[0] = False
        except BaseException as e:  # user code may raise anything, SystemExit included
            running[0] = False
            sys.stdout.flush()
            sys.stderr.flush()
            tb = e.__traceback__
            while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
                tb = tb.tb_next  # the kernel's own frames
            tb = traceback.format_exception(type(e), e, tb)
            emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(tb)})
        finally:
            running[0] = False
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            sys.stdout.flush()
            sys.stderr.flush()
            emit({"type": "number_of_executions", "execution_count": count})
            emit({"type": "__done__"})


if __name__ == "__main__":
    role = sys.argv[2] if len(sys.argv) > 2 else ""
    if role == "manager":
        manager(int(sys.argv[3]))
    elif role == "worker":
        worker()
    else:
        sys.stderr.write("usage: python3 -c %r SOURCE manager PORT\n" % BOOT)
        sys.exit(2)
