"""A warm driver beside the satp cluster: ``satp train`` forked from a process that imported it all.

On a warm cluster a ``satp train`` command spends most of its start-up in its own process: ~11 s of
CPU on 2 cores importing satp's driver, torch, PyG, MLflow's stores and Ray Train before it asks
for anything (benchmarks/RESULTS.md, 2026-11-29 05:34). ``satp cluster start --warm-driver`` leaves
a process beside the cluster (``python -m pipeline.cli.warm_driver``, :func:`start`) that imports all
that once, then listens on a Unix socket in the cluster's private folder (mode 0600; ``satp cluster
stop`` ends it with the cluster's other processes). A ``satp train`` without
``--address`` (:func:`run_command`) hands it its arguments, working directory, environment and
standard streams (their file descriptors, ``SCM_RIGHTS``); the driver forks a runner for the
connection, which forks the command: a process of its own that runs ``satp`` as the command would
have, its output on the command's streams. The command's process waits and forwards SIGINT, SIGTERM,
SIGHUP and SIGCONT to it (Ctrl-Z's SIGTSTP stops it, then the command's process), and ends as it
ended (its status, or the signal that ended it); should the command's process itself die (SIGKILL),
the runner kills the forked command at once. The run's lease and its start-up name and time the
command's process, the one the user started (:mod:`runtime.command`).

What is reused is checked (:func:`identity`): the interpreter, satp's code (every ``.py`` file of its
packages: path, size and modification time, read when the driver started) and the environment
variables modules read when they are imported (:data:`IMPORT_TIME_PREFIXES`). A command that
differs runs in its own process, as without the warm driver, after one line saying what differs;
where satp's code changed, the driver then starts over (``exec``), importing the edited code, and
the commands after it are forked again.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import socket
import sys
from pathlib import Path
from typing import Optional

from runtime import forking
from runtime.command import COMMAND_PID_VAR, forked_for_a_command, set_command_environment

SOCKET_NAME = "warm-driver.sock"
LOG_NAME = "satp-warm-driver.log"  # beside it: a line per command, forked or refused (and why)
#: prefixes of the environment variables read when a module is imported (Ray's settings, DeepSpeed's
#: accelerator, torch's and Triton's, MLflow's, ogb's version check): a command whose values differ
#: from the warm driver's is not forked from it (the import path is the command's own: see _command)
IMPORT_TIME_PREFIXES = ("RAY_", "DS_", "TORCH", "TRITON", "OMP_", "MKL_", "CUDA", "MLFLOW_", "OUTDATED")
#: of those, variables read only when used (the command's own values apply): when Ray starts or
#: prints (satp's console sets RAY_COLOR_PREFIX in every command whose output is not a terminal);
#: when a Train run starts (a driver of a local cluster sets the preemption watcher's and the health
#: check's, runtime.worker_pool.LOCAL_TRAIN_ENV, an elastic run the group's start timeout, passed on to
#: Train's controller); when Inductor or Triton compile (satp points their caches at the run's
#: storage: pipeline.train.engine.keep_compile_caches); when an MLflow client is made, or sends a
#: request (satp sets its retries and timeout: pipeline.registry.addresses.HTTP_ENV)
READ_LATER = frozenset({"RAY_COLOR_PREFIX", "RAY_ADDRESS", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
                        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                        "MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"})
#: satp's packages, whose code the warm driver imported
PACKAGES = ("pipeline", "sat", "runtime", "preprocessing")
#: what the warm driver imports before it listens (the modules a ``satp train`` process loads)
MODULES = ("pipeline.cli", "pipeline.cli.train_commands", "pipeline.train.driver", "pipeline.train.mlflow_run",
           "pipeline.train.preflight", "pipeline.registry.versions", "mlflow.tracking",
           "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
           "ray.train.torch", "preprocessing")
ROOT = Path(__file__).resolve().parents[2]


def code_fingerprint(root: Path = ROOT) -> str:
    """A digest of satp's code in ``root``: every ``.py`` file of :data:`PACKAGES`, its path, size and
    modification time (an edited file changes it)."""
    digest = hashlib.sha256(str(root).encode())
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def identity(env: Optional[dict] = None) -> dict:
    """What a forked command shares with the warm driver and must be the command's own: the
    interpreter and import-time variables (:func:`runtime.forking.identity`), satp's folder and code."""
    env = os.environ if env is None else env
    return {**forking.identity(env, IMPORT_TIME_PREFIXES, READ_LATER), "root": str(ROOT), "code": code_fingerprint()}


def difference(mine: dict, theirs: dict) -> Optional[str]:
    """What differs between two identities (None: nothing), in a few words."""
    return forking.difference(mine, theirs, ("root", "satp's code of another folder ({})"),
                              ("code", "satp's code changed since it started"))


def start(record, env: dict, wait: bool = True) -> None:
    """Start the warm driver of the satp cluster of ``record`` in its folder, with ``env`` (that of
    the commands it will fork); record its socket. ``wait``: until it listens."""
    import subprocess
    import time

    folder = Path(record.temp_dir)
    socket_path, log_path = folder / SOCKET_NAME, folder / LOG_NAME
    env = dict(env, TMPDIR=str(folder / "tmp"),  # TMPDIR: a process of the cluster's folder
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "pipeline.cli.warm_driver", "--socket", str(socket_path)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    record.driver_socket = str(socket_path)
    record.save()
    deadline = time.monotonic() + 300
    while wait and not socket_path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text().strip().splitlines()
            raise ValueError(f"the warm driver did not start listening on {socket_path} "
                             f"({tail[-1] if tail else 'no output'}; its log: {log_path})")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- the command's side
def run_command(socket_path: str, argv: list[str], warn) -> Optional[int]:
    """Run ``satp argv`` in a process forked by the warm driver at ``socket_path``; return its exit
    status (a signal that ended it ends this process the same way). None: the driver is not there,
    or refused (``warn(line)`` says why): the caller runs the command itself."""
    if forked_for_a_command():  # a forked command never asks the driver again
        return None
    asked = forking.request(socket_path, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                                          "path": sys.path, "identity": identity(), "pid": os.getpid()})
    if asked is None:
        return None
    conn, lines, reply = asked
    if "pid" not in reply:
        conn.close()
        warn(f"the satp cluster's warm driver did not run this command ({reply.get('refused', 'no reply')}); "
             "it runs in its own process")
        return None
    return forking.follow(socket_path, conn, lines, reply["pid"])


# ----------------------------------------------------------------------------- the driver's side
def serve(socket_path: str) -> None:
    """Import :data:`MODULES`, then fork a runner per connection (:func:`_run`) until SIGTERM."""
    import importlib

    started_env = dict(os.environ)  # what it starts over with: importing Ray or MLflow adds to os.environ
    set_command_environment()  # as a command's process does first (Ray reads its authentication once)
    mine = identity()
    for name in MODULES:
        importlib.import_module(name)
    listener = forking.listen(socket_path)
    print(f"warm driver pid {os.getpid()} on {socket_path}", flush=True)
    while True:
        forking.accept_forking(listener, lambda conn: _run(conn, mine))
        if code_fingerprint() != mine["code"]:  # satp was edited (its runner refused the command)
            print("satp's code changed since the warm driver started: it imports it again", flush=True)
            listener.close()
            Path(socket_path).unlink(missing_ok=True)  # meanwhile commands run in their own processes
            os.execve(sys.executable, [sys.executable, "-m", "pipeline.cli.warm_driver", "--socket", socket_path],
                      started_env)


def _run(conn: socket.socket, mine: dict) -> None:
    """The runner of one connection: check the request, fork the command, report how it ended."""
    request, fds = forking.receive(conn)
    if not request:
        return
    why = difference(mine, request["identity"])
    command = " ".join(["satp", *request["argv"]])
    if why is not None or len(fds) != 3:
        print(f"refused: {command} ({why or 'no standard streams'})", flush=True)  # to the log
        forking.refuse(conn, why or "no standard streams")
        return
    forking.fork_and_report(conn, fds, lambda: _command(request),
                            lambda pid: print(f"forked pid {pid}: {command}", flush=True))


def _command(request: dict) -> None:
    """The forked command: the caller's directory, environment and import path, then ``satp``."""
    import tempfile

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], **{COMMAND_PID_VAR: str(request["pid"])})
    sys.path[:] = request["path"]
    tempfile.tempdir = None  # read from the command's TMPDIR again
    sys.argv = ["satp", *request["argv"]]
    code = 1
    try:
        runpy.run_module("pipeline.cli", run_name="__main__", alter_sys=True)  # python -m pipeline.cli: exits
    except SystemExit as exc:
        code = forking.exit_code(exc)
    except BaseException:  # noqa: BLE001 - said as the command's own process would say it
        import traceback

        traceback.print_exc()
    finally:
        forking.exit_as_interpreter(code)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.cli.warm_driver", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    serve(parser.parse_args().socket)


if __name__ == "__main__":
    main()
