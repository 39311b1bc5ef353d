"""A process forked for another one: the request over a Unix socket, the caller's side, the runner's.

Two servers of satp fork processes from a process that imported the heavy modules once, instead of
starting a new interpreter that imports them again: the warm driver (``satp train`` commands,
:mod:`pipeline.cli.warm_driver`) and the worker fork server (Ray worker processes,
:mod:`runtime.forked_workers`). Both speak this protocol. The caller sends one JSON line (what to
run, its directory, environment and import path) with its standard streams (their file descriptors,
``SCM_RIGHTS``); the server forks a *runner* for the connection, which checks the request and forks
the process, answers ``{"pid": N}`` (or ``{"refused": why}``), then ``{"status": S}`` when the process
ended. The caller waits, forwarding signals to the forked process, and ends as it ended; should the
caller die, the runner kills the forked process at once (the connection closed).

Both check what the forked process shares with the server (:func:`identity`, :func:`difference`).
Standard library only: the caller's side runs in processes that import nothing else first.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from typing import Callable, Optional

#: signals the caller passes on to the forked process (Ctrl-Z's SIGTSTP is handled apart: see follow)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)


# ----------------------------------------------------------------------------- what must be the same
#: variables a module sets in its own process when it is imported, to the value it reads when they are
#: unset: a caller that imported it (a script or notebook that imported Ray, then ran ``satp train``)
#: carries them, and is the same to the shared modules as one that did not. Ray sets ``RAY_CLIENT_MODE=0``.
SET_ON_IMPORT = {"RAY_CLIENT_MODE": "0"}


def identity(env, prefixes: tuple[str, ...], read_later=frozenset()) -> dict:
    """What a process forked from this one shares with it and must be the caller's own: the
    interpreter, and the variables of ``env`` whose names start with ``prefixes`` (those read when
    the shared modules were imported; ``read_later``: of those, the ones read only when used), but
    not those at the value an import sets (:data:`SET_ON_IMPORT`)."""
    return {"python": os.path.realpath(sys.executable),
            "env": {k: v for k, v in sorted(env.items())
                    if k.startswith(prefixes) and k not in read_later and SET_ON_IMPORT.get(k) != v}}


def difference(mine: dict, theirs: dict, *entries: tuple[str, str]) -> Optional[str]:
    """What differs between two identities (None: nothing), in a few words: the interpreter, then
    each of ``entries`` (``(key, what to say, with {} for their value)``), then the variables."""
    if mine["python"] != theirs["python"]:
        return f"another interpreter ({theirs['python']})"
    for key, says in entries:
        if mine[key] != theirs[key]:
            return says.format(theirs[key])
    keys = sorted(k for k in set(mine["env"]) | set(theirs["env"]) if mine["env"].get(k) != theirs["env"].get(k))
    return f"another {', '.join(keys)} in the environment" if keys else None


# ----------------------------------------------------------------------------- the caller's side
def request(socket_path: str, message: dict) -> Optional[tuple[socket.socket, object, dict]]:
    """Send ``message`` and this process's standard streams to the server at ``socket_path``;
    return ``(connection, its reader, reply)``, or None when no server listens there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:
        conn.close()
        return None
    socket.send_fds(conn, [json.dumps(message).encode() + b"\n"], [0, 1, 2])
    lines = conn.makefile("r")
    return conn, lines, json.loads(lines.readline() or "{}")


def follow(socket_path: str, conn: socket.socket, lines, pid: int) -> int:
    """Wait for the forked process ``pid`` to end, forwarding :data:`FORWARDED` signals to it, and
    return its exit status; a signal that ended it ends this process the same way."""
    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def stop(signum, frame):  # Ctrl-Z: the forked process stops, then this one, as one job
        forward(signal.SIGSTOP, frame)
        # SIGSTOP: a SIGTSTP of this process's own would be discarded in an orphaned process group
        # (no shell's job), leaving the forked process stopped behind a process that runs on
        os.kill(os.getpid(), signal.SIGSTOP)  # continued by SIGCONT, forwarded too

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.signal(signal.SIGTSTP, stop)
    with conn:
        ended = json.loads(lines.readline() or '{"status": null}')
    status = ended.get("status")
    if status is None:
        raise OSError(f"{socket_path}: the server ended before the process it forked (pid {pid})")
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:  # its handler cannot be set, nor needs to be
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


# ----------------------------------------------------------------------------- the server's side
def listen(socket_path: str) -> socket.socket:
    """A listening Unix socket at ``socket_path``, this user's only (mode 0600)."""
    from pathlib import Path

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(socket_path).unlink(missing_ok=True)
    old_mask = os.umask(0o177)
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runners are reaped by the kernel
    return listener


def accept_forking(listener: socket.socket, run: Callable[[socket.socket], None]) -> None:
    """Accept one connection and fork a runner that calls ``run(connection)``, then ends."""
    conn, _ = listener.accept()
    if os.fork() == 0:
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = 1
        try:
            run(conn)
            code = 0
        finally:
            os._exit(code)
    conn.close()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request on ``conn`` and the caller's standard streams (their descriptors)."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while message and not message.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        message += more
    return json.loads(message or b"{}"), fds


def refuse(conn: socket.socket, why: str) -> None:
    conn.sendall(json.dumps({"refused": why}).encode() + b"\n")


def fork_and_report(conn: socket.socket, fds: list[int], child: Callable[[], None],
                    said: Callable[[int], None]) -> None:
    """In a runner: fork ``child()`` (which never returns) with the caller's streams ``fds`` as its
    own, tell the caller its pid (and ``said(pid)``), then report how it ended; kill it should the
    caller go first."""
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        child()
    for fd in fds:
        os.close(fd)
    status = None
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        said(pid)
        ended = os.pidfd_open(pid)
        while status is None:
            readable, _, _ = select.select([conn, ended], [], [])
            if ended in readable:
                _, status = os.waitpid(pid, 0)
            elif not conn.recv(1):
                break
    except (BrokenPipeError, ConnectionResetError):  # the caller died before it read the reply
        pass
    if status is None:  # the caller is gone: so is what it asked for
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return
    with contextlib.suppress(OSError):  # a caller gone meanwhile has no use for it
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")


def exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1


def exit_as_interpreter(code: int) -> None:
    """End a forked process as the interpreter ends one (its threads joined, then its exit handlers),
    then ``_exit``: what lies below it in this process's stack is the server's."""
    import atexit
    import threading

    try:
        threading._shutdown()  # what Py_FinalizeEx does first (no public equivalent)
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
