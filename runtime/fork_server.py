"""One process per CPU-only satp cluster that imported the heavy stack once, and forks on request.

The server (started by :mod:`runtime.local_cluster`) imports :data:`MODULES` once, then forks per
request on its Unix socket a Ray worker (:func:`executable`) or a ``satp train`` command
(:func:`run_command`) with the client's argv, environment, folder and standard streams. A client
whose interpreter or imported settings differ is refused; the socket is 0600 in the cluster's 0700
folder and both ends check the peer's user id. Standard library only at import.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import MutableMapping
from typing import Optional

#: the socket in the cluster's folder, and the server's log beside it (a line per fork or refusal)
SOCKET_NAME = "fork.sock"
LOG_NAME = "satp-fork-server.log"
#: names the server to every process of its cluster (a job's driver reads it: runtime.ray_cluster)
SOCKET_VAR = "SATP_FORK_SOCKET"
#: in a forked process: the pid of its client (the process the user or the raylet started)
CLIENT_PID_VAR = "SATP_FORK_CLIENT_PID"
#: in a forked process: when its server had imported MODULES (wall clock)
FORKED_FROM_VAR = "SATP_FORKED_FROM"
#: what the server imports before it listens: what satp's Train workers and commands import that is
#: neither Ray nor satp (MLflow's SQL store: ~1 s of CPU in the driver and in each rank-0 worker)
MODULES = ("torch", "torch_geometric", "deepspeed", "mlflow", "mlflow.store.tracking.sqlalchemy_store",
           "matplotlib.pyplot", "pyarrow.dataset", "pydantic")
#: signals the client passes on to the forked process (Ctrl-Z's SIGTSTP is handled apart: see _follow)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)
#: satp's packages, never kept from the server's imports in a forked process
SATP_PACKAGES = ("runtime", "pipeline", "sat", "preprocessing")
#: variables the imports read that a forked process reads again or takes from its client, or a
#: terminal's size (``shutil.get_terminal_size`` reads it again when asked): not compared
NOT_COMPARED = frozenset({"TMPDIR", "TEMP", "TMP", "PWD", "OLDPWD", "_", "PYTHONPATH", "PYTHONBREAKPOINT",
                          "COLUMNS", "LINES"})


class PeerRefused(OSError):
    """The other end of the socket is another user's process: nothing was sent to it."""


def forked_from() -> Optional[float]:
    """When the server this process was forked from had imported :data:`MODULES` (None: not forked)."""
    value = os.environ.get(FORKED_FROM_VAR)
    return float(value) if value else None


def forked_for() -> Optional[int]:
    """The pid of the client this process was forked for (None: not forked)."""
    value = os.environ.get(CLIENT_PID_VAR)
    return int(value) if value else None


def executable(socket_path: str) -> str:
    """The runtime environment's ``py_executable`` whose workers the server at ``socket_path`` forks
    (Ray runs ``exec <it> default_worker.py ARGS`` in a shell)."""
    return f"{sys.executable} -m runtime.fork_server --worker {socket_path}"


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of the Unix socket ``conn`` (``SO_PEERCRED``)."""
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


# ----------------------------------------------------------------------------- the client's side
def _connect(socket_path: str) -> Optional[socket.socket]:
    """A connection to the server at ``socket_path`` (None: none listens there); raises
    :class:`PeerRefused` when another user's process listens there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:
        conn.close()
        return None
    uid = peer_uid(conn)
    if uid != os.getuid():
        conn.close()
        raise PeerRefused(f"{socket_path} belongs to user id {uid}, not to this user ({os.getuid()}); nothing sent")
    return conn


def _request(socket_path: str, message: dict) -> Optional[tuple[socket.socket, object, dict]]:
    """Send ``message`` with this process's standard streams; ``(connection, its reader, reply)``, or
    None when no server listens."""
    conn = _connect(socket_path)
    if conn is None:
        return None
    socket.send_fds(conn, [json.dumps(message).encode() + b"\n"], [0, 1, 2])
    lines = conn.makefile("r")
    return conn, lines, json.loads(lines.readline() or "{}")


def _message(kind: str, argv: list[str], path: list[str]) -> dict:
    return {"kind": kind, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": path,
            "python": os.path.realpath(sys.executable), "client": os.getpid()}


def _follow(socket_path: str, conn: socket.socket, lines, pid: int) -> int:
    """Wait for the forked process ``pid``, forwarding :data:`FORWARDED` signals to it; return its exit
    status (a signal that ended it ends this process the same way)."""
    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def stop(signum, frame):  # Ctrl-Z: the forked process stops, then this one, as one job
        forward(signal.SIGSTOP, frame)
        os.kill(os.getpid(), signal.SIGSTOP)  # continued by SIGCONT, which is forwarded too

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.signal(signal.SIGTSTP, stop)
    with conn:
        status = json.loads(lines.readline() or '{"status": null}').get("status")
    if status is None:
        raise OSError(f"{socket_path}: the fork server ended before the process it forked (pid {pid})")
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


def run_command(socket_path: str, argv: list[str], warn, defaults: Optional[dict] = None) -> Optional[int]:
    """Run ``satp argv`` forked by the server at ``socket_path``; return its exit status. None: no
    server there, it refused, or it is another user's (``warn(line)`` says why). ``defaults``:
    environment of the cluster's processes, the command's where it sets no value of its own."""
    message = _message("command", argv, sys.path)
    message["env"] = {**(defaults or {}), **message["env"]}
    try:
        asked = _request(socket_path, message)
    except PeerRefused as exc:
        warn(f"{exc}; this command runs in its own process")
        return None
    if asked is None:
        return None
    conn, lines, reply = asked
    if "pid" not in reply:
        conn.close()
        warn(f"the satp cluster's fork server did not run this command ({reply.get('refused', 'no reply')}); "
             "it runs in its own process")
        return None
    return _follow(socket_path, conn, lines, reply["pid"])


def worker_client(socket_path: str, argv: list[str]) -> None:
    """Ray's worker ``argv`` (``default_worker.py ARGS``) forked by the server, else run here as Ray
    would have run it."""
    path = [os.path.dirname(os.path.abspath(argv[0])), *sys.path[1:]]  # as `python default_worker.py`
    try:
        asked = _request(socket_path, _message("worker", argv, path))
    except PeerRefused as exc:
        print(f"satp: warning: {exc}; the worker runs in its own process", file=sys.stderr, flush=True)
        asked = None
    if asked is not None:
        conn, lines, reply = asked
        if "pid" in reply:
            sys.exit(_follow(socket_path, conn, lines, reply["pid"]))
        conn.close()
    os.execv(sys.executable, [sys.executable, *argv])


def wait_ready(socket_path: str, timeout_s: float) -> bool:
    """Whether the server at ``socket_path`` answers a ping within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            conn = _connect(socket_path)
            if conn is not None:
                with conn:
                    conn.sendall(b'{"kind": "ping"}\n')
                    if json.loads(conn.makefile("r").readline() or "{}").get("ready"):
                        return True
        time.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- the server's side
class _RecordingEnviron(MutableMapping):
    """``os.environ`` while the server imports: remembers which variables were looked up."""

    def __init__(self, environ) -> None:
        self.environ, self.read = environ, set()

    def __getitem__(self, key):
        self.read.add(key)
        return self.environ[key]

    def __setitem__(self, key, value) -> None:
        self.environ[key] = value

    def __delitem__(self, key) -> None:
        del self.environ[key]

    def __iter__(self):
        return iter(self.environ)

    def __len__(self) -> int:
        return len(self.environ)

    def copy(self) -> dict:
        return dict(self.environ)


def _import_recording_reads() -> frozenset:
    """Import :data:`MODULES`; return the environment variables they looked up (in Python) meanwhile,
    but :data:`NOT_COMPARED`."""
    import importlib

    environ, recording = os.environ, _RecordingEnviron(os.environ)
    os.environ = recording
    try:
        for name in MODULES:
            importlib.import_module(name)
    finally:
        os.environ = environ
    if "ray" in sys.modules:  # its core would keep this process's job id in every worker
        raise SystemExit(f"{', '.join(MODULES)} imported Ray: nothing can be forked from this process")
    return frozenset(k for k in recording.read if isinstance(k, str)) - NOT_COMPARED


def serve(socket_path: str) -> dict:
    """Import :data:`MODULES`, then fork a runner per connection. Returns only in a forked process,
    the request it runs (see :func:`main`)."""
    before = dict(os.environ)
    # what a forked process shares with the server and must be its client's: the interpreter, and the
    # values of the environment variables the imports read
    mine = {"python": os.path.realpath(sys.executable),
            "env": {k: before.get(k) for k in sorted(_import_recording_reads())}}
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}  # kept in a forked process
    imported = time.time()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    old_mask = os.umask(0o177)  # 0600 from its creation
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runners are reaped by the kernel
    print(f"fork server pid {os.getpid()} on {socket_path}", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() != 0:
            conn.close()
            continue
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request = _runner(conn, mine)  # returns in the forked process only
        if request is None:
            os._exit(0)  # the runner's work is done: what lies below in its stack is the server's loop
        request.update(imported=imported, set_by_imports=set_by_imports)
        return request


def _runner(conn: socket.socket, mine: dict) -> Optional[dict]:
    """One connection: check the peer and the request, fork, report how the process ended. Returns
    the request in the forked process, None in the runner."""
    uid = peer_uid(conn)
    if uid != os.getuid():
        print(f"refused a client of user id {uid} (this server's: {os.getuid()}): nothing read", flush=True)
        return None
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while message and not message.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        message += more
    request = json.loads(message or b"{}")
    if request.get("kind") == "ping":
        conn.sendall(b'{"ready": true}\n')
        return None
    if not request:
        return None
    theirs, why = request.get("env", {}), None
    if mine["python"] != request.get("python"):
        why = f"another interpreter ({request.get('python')})"
    elif keys := sorted(k for k in mine["env"] if mine["env"][k] != theirs.get(k)):
        why = f"another {', '.join(keys)} in the environment"
    elif len(fds) != 3:
        why = "no standard streams"
    if why is not None:
        print(f"refused {request.get('kind')} for client pid {request.get('client')} ({why})", flush=True)
        conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
        return None
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        return request
    for fd in fds:
        os.close(fd)
    print(f"forked pid {pid} for client pid {request.get('client')}: {' '.join(request['argv'])}", flush=True)
    _report(conn, pid)
    return None


def _report(conn: socket.socket, pid: int) -> None:
    """Tell the client ``pid``, then how it ended; kill it should the client go first."""
    status = None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client died before it read the reply
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        ended = os.pidfd_open(pid)
        while status is None:
            readable, _, _ = select.select([conn, ended], [], [])
            if ended in readable:
                _, status = os.waitpid(pid, 0)
            elif not conn.recv(1):
                break
    if status is None:  # the client is gone: so is what it asked for
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(f"killed pid {pid}: its client went first", flush=True)
        return
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")


def _become(request: dict) -> None:
    """In the forked process: the client's folder, environment, import path and argv; satp's own
    modules dropped from the server's imports (the checkout's are imported anew)."""
    import tempfile

    if request["kind"] == "worker":
        os.setpgid(0, 0)  # a process group of its own, as the raylet gives its workers
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **request["set_by_imports"], CLIENT_PID_VAR: str(request["client"]),
                       FORKED_FROM_VAR: repr(request["imported"])})
    sys.path[:] = request["path"]
    tempfile.tempdir = None  # read from the client's TMPDIR again
    for name in [n for n in sys.modules if n.split(".")[0] in SATP_PACKAGES]:
        del sys.modules[name]


def _run(request: dict) -> int:
    """Run the request as ``python ARGV`` (a worker) or ``satp ARGV`` (a command) would; its exit status."""
    import runpy

    _become(request)
    argv = list(request["argv"])
    try:
        if request["kind"] == "command":
            sys.argv = ["satp", *argv]
            runpy.run_module("pipeline.cli", run_name="__main__", alter_sys=True)
        elif argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return 0


def main() -> None:
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "--serve":
        sys.exit(_run(serve(args[1])))  # only a forked process gets here: it exits as an interpreter does
    elif len(args) >= 3 and args[0] == "--worker":
        worker_client(args[1], args[2:])
    else:
        raise SystemExit("usage: python -m runtime.fork_server --serve SOCKET | --worker SOCKET WORKER.py ARGS...")


if __name__ == "__main__":
    main()
