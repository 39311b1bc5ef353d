"""Ray worker processes forked from a process that imported torch, PyG and DeepSpeed once.

A Ray Train worker starts as a new interpreter that imports torch, PyG and DeepSpeed before it
trains: ~6-8 s of CPU on 2 cores for each worker of each run, and of each trial of a sweep, where
Ray's prestarted processes cannot help (a runtime environment binds them, and on a busy machine the
pool does not refill between trials: benchmarks/RESULTS.md). On a CPU-only satp cluster
(:mod:`runtime.local_cluster`) a fork server runs beside the raylet (``python -m
runtime.forked_workers --serve SOCKET``) that imported those modules, and satp's Train workers (and
every process of a sweep's job: its trials' actors and Train controllers, :func:`runtime.ray_cluster.sweep_job_env`)
are given its client as their Python (the runtime environment's ``py_executable``, :func:`executable`):
where Ray would run ``python default_worker.py ARGS``, the client hands ``default_worker.py ARGS``,
its environment, directory, import path and standard streams to the server (:mod:`runtime.forking`),
which forks a process that runs Ray's worker from there. The worker registers with the raylet under
its own pid (the one Ray's kills reach); the client waits for it, forwarding signals, and ends as it
ended; should the client die (the raylet ended it), the worker is killed with it. The server's log
names each worker with its client (:func:`forked_pids`). The nodes of a cluster satp did not start
can run a server each, at the path their environment and the driver's name (docs/scale.md).

What is shared is checked (:func:`identity`): the interpreter, and the environment variables that
torch, PyG and DeepSpeed read when imported (:data:`IMPORT_TIME_PREFIXES`). A worker whose values
differ, or that finds no server, runs as Ray would have run it (``exec python default_worker.py``),
and the server's log (:data:`LOG_NAME`) says why. Never forked: Ray itself (its C++ core reads the
job's id from the environment when it loads, so every worker imports Ray anew, ~1.5 s), satp's own
code (an edited checkout is what the next worker imports), and CUDA (a process that initialised it
cannot fork a worker that uses it: satp clusters with GPUs start no fork server).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

from runtime import forking

#: the server's socket in a satp cluster's folder, and its log beside it
SOCKET_NAME = "worker-fork.sock"
LOG_NAME = "satp-worker-fork.log"
#: the variable naming a satp cluster's fork server to its processes (runtime.local_cluster.cluster_env)
SOCKET_VAR = "SATP_WORKER_FORK_SOCKET"
#: on the command line of a forked worker's client (the raylet's child while the worker runs)
CLIENT = "runtime.forked_workers"
#: what the server imports before it listens: what a Train worker imports that is not Ray nor satp
MODULES = ("torch", "torch_geometric", "deepspeed")
#: in a forked worker's environment: when its server had imported :data:`MODULES` (wall clock)
FORKED_FROM_VAR = "SATP_FORKED_FROM"
#: prefixes of the environment variables those modules read when imported
IMPORT_TIME_PREFIXES = ("DS_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NCCL", "TRITON", "OUTDATED", "LD_")


def forked_from() -> Optional[float]:
    """When the server this worker was forked from had imported :data:`MODULES` (None: not forked)."""
    value = os.environ.get(FORKED_FROM_VAR)
    return float(value) if value else None


def executable(socket_path: str) -> str:
    """The ``py_executable`` of a runtime environment whose workers are forked by the server at
    ``socket_path`` (Ray runs ``exec <it> default_worker.py ARGS`` in a shell)."""
    return f"{sys.executable} -m {CLIENT} --client {socket_path}"


def identity(env=None) -> dict:
    """What a forked worker shares with the server and must be the worker's own (:func:`runtime.forking.identity`)."""
    return forking.identity(os.environ if env is None else env, IMPORT_TIME_PREFIXES)


# ----------------------------------------------------------------------------- the worker's side
def client(socket_path: str, argv: list[str]) -> None:
    """Run Ray's worker ``argv`` (``default_worker.py ARGS``) forked by the server, else here."""
    path = [os.path.dirname(os.path.abspath(argv[0])), *sys.path[1:]]  # as `python default_worker.py`
    asked = forking.request(socket_path, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": path,
                                          "identity": identity(), "client": os.getpid()})
    if asked is not None:
        conn, lines, reply = asked
        if "pid" in reply:
            sys.exit(forking.follow(socket_path, conn, lines, reply["pid"]))
        conn.close()
    os.execv(sys.executable, [sys.executable, *argv])  # what Ray would have run


# ----------------------------------------------------------------------------- the server's side
def serve(socket_path: str) -> None:
    """Import :data:`MODULES`, then fork a runner per connection until SIGTERM."""
    import importlib

    mine = identity()
    for name in MODULES:
        importlib.import_module(name)
    imported = time.time()
    if "ray" in sys.modules:  # its core would keep this process's job id in every worker
        raise SystemExit(f"{', '.join(MODULES)} imported Ray: no worker can be forked from this process")
    listener = forking.listen(socket_path)
    print(f"worker fork server pid {os.getpid()} on {socket_path}", flush=True)
    while True:
        forking.accept_forking(listener, lambda conn: _run(conn, mine, imported))


def _run(conn, mine: dict, imported: float) -> None:
    request, fds = forking.receive(conn)
    if not request:
        return
    why = forking.difference(mine, request["identity"]) or (None if len(fds) == 3 else "no standard streams")
    if why is not None:
        print(f"refused ({why}): a worker started by the raylet instead", flush=True)
        forking.refuse(conn, why)
        return
    said = f"for client pid {request.get('client')}"
    forking.fork_and_report(conn, fds, lambda: _worker(request, imported),
                            lambda pid: print(f"forked worker pid {pid} {said}", flush=True))


def forked_pids(log_path) -> dict[int, int]:
    """``{client pid: worker pid}`` of the workers the server logging to ``log_path`` forked (the
    raylet's child is the client; the process that runs Ray's worker is the server's)."""
    from pathlib import Path

    try:
        lines = Path(log_path).read_text().splitlines()
    except OSError:
        return {}
    found = (line.split() for line in lines if line.startswith("forked worker pid "))
    return {int(words[-1]): int(words[3]) for words in found if words[-1].isdigit()}


def _worker(request: dict, imported: float) -> None:
    """The forked worker: the client's directory, environment and import path, then Ray's worker."""
    import runpy
    import tempfile

    os.setpgid(0, 0)  # a process group of its own, as the raylet gives its workers: it ends the group with the worker
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], **{FORKED_FROM_VAR: repr(imported)})
    sys.path[:] = request["path"]
    tempfile.tempdir = None  # read from the worker's TMPDIR again
    sys.argv = list(request["argv"])
    code = 1
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = forking.exit_code(exc)
    except BaseException:  # noqa: BLE001 - said as Ray's worker process would say it
        import traceback

        traceback.print_exc()
    finally:
        forking.exit_as_interpreter(code)


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "--serve":
        serve(args[1])
    elif len(args) >= 3 and args[0] == "--client":
        client(args[1], args[2:])
    else:
        raise SystemExit("usage: python -m runtime.forked_workers --serve SOCKET | --client SOCKET WORKER.py ARGS...")


if __name__ == "__main__":
    main()
