"""Connecting to Ray (:func:`connect`): an address (``--address`` or ``$RAY_ADDRESS``) probed first,
failing fast when it does not answer; without one, the satp cluster of this machine when one runs,
else a new local one (``address="local"``: plain ``ray.init()`` may attach to someone else's). The
local cluster's processes get a private ``TMPDIR``, removed at exit or by the next command
(:func:`sweep_orphans`).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

from runtime import fork_server, local_cluster
from runtime.command import warn
from runtime.ports import free_ports
from runtime.ray_address import probe, resolve_address

log = logging.getLogger(__name__)

#: what a driver on a local cluster sets, and Ray Train passes on to every actor of a run: no
#: preemption watcher (a local node is never drained), and a run's end is seen sooner
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
#: what every process of a satp job runs before it takes work
SETUP_HOOK = "runtime.ray_logs.quiet_ray_train_noise"

#: the environment of the connected cluster's worker processes (None: unknown), set by :func:`connect`
_worker_env: Optional[dict[str, str]] = None
#: a connection under way in a thread (:func:`connect_in_background`): (done event, outcome)
_background: Optional[tuple] = None


def connect_in_background(address: Optional[str] = None, **kwargs) -> None:
    """Start :func:`connect` in a thread while the main thread imports torch; the next :func:`connect`
    from the main thread waits for it and raises what it raised."""
    import threading

    global _background
    outcome: dict = {}

    def run() -> None:
        def quiet(record: logging.LogRecord) -> bool:  # Ray's SIGTERM handler is not set from a thread
            return "SIGTERM handler is not set" not in record.getMessage()

        worker_log = logging.getLogger("ray._private.worker")
        worker_log.addFilter(quiet)
        try:
            outcome["started"] = connect(address, **kwargs)
        except BaseException as exc:  # re-raised in the main thread
            outcome["error"] = exc
        finally:
            worker_log.removeFilter(quiet)
            done.set()
        if outcome.get("started"):
            # the local cluster's processes die with the thread that started them (Ray starts them
            # with PR_SET_PDEATHSIG, which fires when the creating thread ends): it stays
            threading.Event().wait()

    done = threading.Event()
    thread = threading.Thread(target=run, name="satp-ray-connect", daemon=True)
    _background = (done, outcome)
    thread.start()


def wait_for_background_connect() -> Optional[bool]:
    """Wait for :func:`connect_in_background`'s connection; return whether it started a local
    cluster (None: there was none under way)."""
    global _background
    if _background is None:
        return None
    done, outcome = _background
    done.wait()
    _background = None
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("started", False)


def connect(address: Optional[str] = None, env_vars: Optional[dict] = None, log_to_driver: bool = True,
            **local) -> bool:
    """Connect this process to Ray unless it is connected (see the module docstring); return True when
    a local cluster was started. ``env_vars``: environment the job's processes need;
    ``local``: further keyword arguments of :func:`init_local_ray`."""
    import threading

    import ray

    from runtime import interrupts

    if threading.current_thread() is threading.main_thread():
        started = wait_for_background_connect()
        if started is not None:
            interrupts.install()
            return started
    if ray.is_initialized():
        return False
    try:
        return _connect(address, env_vars, log_to_driver, **local)
    finally:
        interrupts.install()  # ray.init's own SIGTERM handling prints a stack dump: see there


def _connect(address: Optional[str], env_vars: Optional[dict], log_to_driver: bool, **local) -> bool:
    global _worker_env
    target = resolve_address(address)
    if target:
        probe(target)
        try:  # the satp cluster named by its address: its clients need its settings
            record = local_cluster.ClusterRecord.load()
        except ValueError:
            record = None
        if record is not None and not record.named_by(target.split("://")[-1]):
            record = None
    else:
        record = local_cluster.for_command(warn=warn)
        target = record.address if record is not None else None
    if target:
        log.info("connecting to the %s at %s", "satp cluster" if record is not None else "Ray cluster", target)
        if record is not None:
            local_cluster.check_private(record)
            os.environ.update(record.connect_env())
            _local_train_env()
        _worker_env = dict(record.worker_env) if record is not None else None
        fork_socket = record.fork_socket if record is not None else os.environ.get(fork_server.SOCKET_VAR)
        missing = missing_worker_env(env_vars or {})
        try:
            _ray_init(address=target, log_to_driver=log_to_driver, runtime_env=job_env(missing, fork_socket))
        except ConnectionError as exc:
            _worker_env = None
            raise ValueError(f"cannot connect to the Ray cluster at {target}: {str(exc).splitlines()[0]}") from None
        return False
    log.info("starting a local Ray cluster")
    init_local_ray(env_vars=env_vars, log_to_driver=log_to_driver, **local)
    return True


def job_env(env_vars: Optional[dict] = None, fork_socket: Optional[str] = None) -> dict:
    """The runtime environment of a satp job: every process runs :data:`SETUP_HOOK` first, has
    ``env_vars``, and is forked by the fork server at ``fork_socket`` (if any, with or without an
    address; docs/scale.md)."""
    env: dict = {"worker_process_setup_hook": SETUP_HOOK}
    if env_vars:
        env["env_vars"] = dict(env_vars)
    if fork_socket:
        env["py_executable"] = fork_server.executable(fork_socket)
    return env


def _ray_init(**kwargs) -> None:
    """``ray.init(**kwargs)`` with SIGINT and SIGTERM left to :mod:`runtime.interrupts`: no core-worker
    failure-signal handler (a SIGTERM while connecting would abort the command mid-clean-up; Python's
    fault handler prints a crash's stacks instead), and ``ray.init``'s own SIGTERM exit turned into
    :class:`~runtime.interrupts.Interrupted`."""
    import faulthandler
    import signal

    import ray

    from runtime.interrupts import Interrupted
    from runtime.ray_private import disable_failure_signal_handler

    disable_failure_signal_handler()
    if not faulthandler.is_enabled():
        faulthandler.enable()
    try:
        ray.init(**kwargs)
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM) from None


def _local_train_env() -> None:
    """Set :data:`LOCAL_TRAIN_ENV`; a value the user set stays."""
    for key, value in LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)


def missing_worker_env(needed: dict[str, str]) -> dict[str, str]:
    """What of ``needed`` the connected cluster's worker processes lack, i.e. what a task or actor must
    be given in its runtime env: known for a cluster satp started and inside a Ray worker (this
    process's own environment); a cluster satp did not start gets all of it."""
    have = _worker_env
    ray = sys.modules.get("ray")
    if have is None and ray is not None and ray.is_initialized() and \
            ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        have = os.environ
    if have is None:
        return dict(needed)
    return {k: v for k, v in needed.items() if have.get(k) != v}


def _private_tmpdir() -> str:
    """A temporary directory for the local cluster's processes, removed at exit after Ray's shutdown
    (registered before ``ray.init`` registers its own); named by this process's id for
    :func:`sweep_orphans`."""
    tempfile.gettempdir()  # fix this process's own choice first (not the private directory)
    path = tempfile.mkdtemp(prefix=f"{ORPHAN_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, path, True)
    return path


ORPHAN_PREFIX = "satp-ray-"


def sweep_orphans() -> list[str]:
    """Remove each private temporary folder (:func:`_private_tmpdir`) whose command no longer runs,
    after stopping the processes that still carry it; return the folders removed."""
    import psutil

    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{ORPHAN_PREFIX}*"):
        owner = folder.name[len(ORPHAN_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or psutil.pid_exists(int(owner)) or folder.stat().st_uid != os.getuid():
            continue  # its command runs, or another user's
        local_cluster.stop_processes(str(folder))
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def init_local_ray(num_cpus: Optional[int] = None, dashboard: bool = False, log_to_driver: bool = True,
                   env_vars: Optional[dict] = None) -> None:
    """Start a new local Ray instance on 127.0.0.1, its files in the user's 0700 folder; see the module
    docstring. ``dashboard``: Ray's dashboard (off by default: it costs seconds of the start)."""
    import ipaddress

    import ray

    global _worker_env
    if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
        needed = " ".join(f"{key}={value}" for key, value in local_cluster.LOOPBACK_ENV.items())
        raise ValueError(f"a local Ray listens on 127.0.0.1 only: set {needed} in the environment before Ray is "
                         "imported (satp commands do: runtime.command.set_command_environment)")
    for folder in sweep_orphans():
        log.info("removed %s, left by a satp command that was killed", folder)
    port = free_ports(1)[0]
    use_gpu = (env_vars or {}).get("DS_ACCELERATOR") == "cuda"
    api_server = f"http://{local_cluster.LOOPBACK}:{port if dashboard else 9}"
    env = {**local_cluster.cluster_env(use_gpu=use_gpu, api_server=api_server), **(env_vars or {})}
    kwargs = dict(address="local", num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=log_to_driver,
                  runtime_env=job_env(fork_socket=os.environ.get(fork_server.SOCKET_VAR)))
    if dashboard:
        kwargs.update(dashboard_host=local_cluster.LOOPBACK, dashboard_port=port)
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    # the cluster's processes inherit this process's environment: set while ray.init starts them
    saved = {key: os.environ.get(key) for key in ("TMPDIR", "RAY_TMPDIR", *env)}
    os.environ.update(env)
    os.environ["RAY_TMPDIR"] = local_cluster.user_folder()  # Ray's own files: below it, in ray/
    os.environ["TMPDIR"] = _private_tmpdir()  # inherited by the processes ray.init starts
    auth_log.setLevel(logging.ERROR)
    try:
        _ray_init(**kwargs)
    finally:
        auth_log.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _worker_env = env
    _local_train_env()
