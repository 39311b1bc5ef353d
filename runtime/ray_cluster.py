"""Connecting to Ray: the satp cluster, a named cluster (fast failure when it does not answer), or a
new local one.

:func:`connect` is how every satp command reaches Ray (training, sweeps, preprocessing):

* With an address (``--address``, or ``$RAY_ADDRESS``, which Ray sets inside a Ray job), the
  address is first probed (:func:`runtime.ray_address.probe`, a few seconds): a dead address, or one
  where something else answers, is a one-line error, not ``ray.init``'s minute of retries.
* Without one, the satp cluster of this machine when one runs (``satp cluster start``:
  :mod:`runtime.local_cluster`, whose processes are forked warm), else :func:`init_local_ray`
  starts a new local cluster (``address="local"``): plain ``ray.init()`` attaches to a cluster it
  finds on the machine (``/tmp/ray/ray_current_cluster`` or a running GCS), possibly someone else's.
  :func:`connect_in_background` does the same from a thread, while the command imports.

Every process of the job imports :mod:`runtime.ray_logs` first (the job's
``worker_process_setup_hook``); on a CPU-only satp cluster every one is forked by the cluster's fork
server (the job's ``py_executable``: :mod:`runtime.fork_server`), which imported torch, PyG and
DeepSpeed once. Train workers get in their runtime env only what the cluster's processes lack
(:func:`missing_worker_env`).

About the local cluster (see :func:`runtime.local_cluster.cluster_env` for its environment):

* Ray Train V2's placement-group cleaner (of Ray Train runs other than satp's, which start none:
  :func:`runtime.ray_private.trainer_class`) queries the State API of "the" cluster, resolved the
  same way: with several clusters on one machine it may ask another cluster whether our
  controller is alive, get "no", and remove our placement group (killing our training).
  ``RAY_API_SERVER_ADDRESS`` in the cluster's environment pins it to our own dashboard (or, without
  a dashboard, to nothing: :mod:`runtime.ray_logs` keeps its every-second warning off the console).
* Token authentication stays as Ray 2.60 sets it for a new local cluster (on, unless
  ``RAY_AUTH_MODE`` says otherwise), without the warning Ray prints about it on every start.
* Train's preemption watcher is off (:data:`LOCAL_TRAIN_ENV`, set in the
  driver, which Ray Train passes on to every actor of a run): it watches nodes being drained (spot
  instances); a local cluster is never drained. Its controller polls the workers every 0.5 s (Ray's
  default: 2 s), so that a run's end is seen sooner (the tests' and a sweep's many short runs).
* As ``satp cluster start``'s, on 127.0.0.1 only (Ray imported with ``LOOPBACK_ENV``, which every
  satp command sets first: :mod:`runtime.local_cluster`), Ray's files in the user's 0700 folder
  (:func:`runtime.local_cluster.user_folder`), not in ``/tmp/ray``, which every user may write.
* The head's processes (dashboard, raylet, workers) get a private ``TMPDIR``, removed when this
  process exits after Ray's own shutdown: the dashboard leaves a ``pymp-*`` directory in the
  temporary directory each time it is killed, and workers are killed too. A command killed with
  SIGKILL runs no exit handler: the next one finds the folder by its owner's id and stops what
  still carries it (:func:`sweep_orphans`).
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
from runtime.ports import free_ports
from runtime.ray_address import probe, resolve_address

log = logging.getLogger(__name__)

#: what a driver on a local cluster sets in its environment, and Ray Train so passes on to every
#: actor of a run: Train's preemption watcher (one more actor per run) watches nodes being drained,
#: which a local cluster's never are; the controller polls its workers every 0.5 s, not 2 s (a run's
#: end and a worker's failure are seen 0.75 s sooner on average, each a cheap call on one machine)
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
#: what every process of a satp job runs before it takes work
SETUP_HOOK = "runtime.ray_logs.quiet_ray_train_noise"

#: what the connected cluster's worker processes have in their environment (None: a cluster satp did
#: not start, whose workers' environment is unknown); set by :func:`connect`, read by
#: :func:`missing_worker_env`. Process-wide, as Ray's own connection is.
_worker_env: Optional[dict[str, str]] = None


#: a connection under way in a thread (:func:`connect_in_background`): (thread, outcome)
_background: Optional[tuple] = None


def connect_in_background(address: Optional[str] = None, **kwargs) -> None:
    """Start :func:`connect` in a thread, so that this process imports what it needs meanwhile (a
    new local cluster's processes start, and the connection waits on them, while the main thread
    imports torch); the next :func:`connect` from the main thread waits for it and raises what it
    raised. Ray's SIGTERM handling is not installed from a thread: that next call installs satp's.
    A thread that started a local cluster never ends (see there)."""
    import threading

    global _background
    outcome: dict = {}

    def run() -> None:
        worker_log = logging.getLogger("ray._private.worker")
        quiet = _DropMessage("SIGTERM handler is not set")
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


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


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
    """Connect this process to Ray unless it is connected; return True when a local cluster was started.

    Without an address (and without ``$RAY_ADDRESS``) the satp cluster of this machine is used when
    one runs (:func:`runtime.local_cluster.for_command`), else a new local one starts here
    (:func:`init_local_ray`).

    ``env_vars``: environment the job's processes need: of the connection's runtime env (a named
    cluster; what a satp cluster's processes have already is left out) or
    added to the local cluster's; ``local``: further keyword arguments of :func:`init_local_ray`."""
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
    record = None
    if target:
        probe(target)
        record = _recorded_cluster_at(target)
    else:
        record = local_cluster.for_command(warn=_warn)
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
    ``env_vars``, and is forked by the fork server at ``fork_socket`` (if any: a CPU-only satp
    cluster's, or on a cluster satp did not start the one its nodes run, named by
    ``$SATP_FORK_SOCKET``, with or without an address: docs/scale.md)."""
    env: dict = {"worker_process_setup_hook": SETUP_HOOK}
    if env_vars:
        env["env_vars"] = dict(env_vars)
    if fork_socket:
        env["py_executable"] = fork_server.executable(fork_socket)
    return env


def _ray_init(**kwargs) -> None:
    """``ray.init(**kwargs)``, with SIGINT and SIGTERM left to :mod:`runtime.interrupts` (whose
    handlers :func:`connect` installs right after it):

    * the driver's core worker installs no failure-signal handler. Ray's takes SIGTERM too, until
      satp's handler replaces it: a SIGTERM meanwhile (while the command connects) printed a stack
      dump of every thread, and the alarm that handler sets aborted the command three seconds later
      (status -6) in the middle of its clean-up. Python's fault handler prints a crash's stacks.
    * ``ray.init``'s own SIGTERM handler, set while it connects, exits with the signal's number: the
      command was interrupted, as satp's handler would have said.
    """
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
    """What a driver of a local cluster's runs sets for Ray Train to pass on to every actor of a run
    (:data:`LOCAL_TRAIN_ENV`); a value the user set stays."""
    for key, value in LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)


def _recorded_cluster_at(target: str):
    """The satp cluster's record when ``target`` is its address (its clients need its settings)."""
    try:
        record = local_cluster.ClusterRecord.load()
    except ValueError:
        return None
    return record if record is not None and record.named_by(target.split("://")[-1]) else None


def _warn(line: str) -> None:
    print(f"satp: warning: {line}", file=sys.stderr, flush=True)


def missing_worker_env(needed: dict[str, str]) -> dict[str, str]:
    """What of ``needed`` the connected cluster's worker processes do not have in their environment
    already, i.e. what a task or actor must be given in its runtime env. Processes of a satp
    cluster (or of the local cluster started here) have what it was started with; inside a Ray
    worker, what this process has; a cluster satp did not start gets all of it."""
    have = _known_worker_env()
    if have is None:
        return dict(needed)
    return {k: v for k, v in needed.items() if have.get(k) != v}


def _known_worker_env():
    """The environment the connected cluster's worker processes have, where known (a satp cluster's,
    the local one started here, or inside a Ray worker this process's own), else None."""
    if _worker_env is not None:
        return _worker_env
    return os.environ if _in_ray_worker() else None


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def _private_tmpdir() -> str:
    """A temporary directory for the local cluster's processes, removed at this process's exit.

    Registered with ``atexit`` before ``ray.init`` registers its shutdown: exit handlers run in
    reverse order, so the directory goes after Ray's processes. Its name carries this process's
    id: one left by a command that was killed (no exit handlers ran) is found by the next one
    (:func:`sweep_orphans`)."""
    tempfile.gettempdir()  # fix this process's own choice first (not the private directory)
    path = tempfile.mkdtemp(prefix=f"{ORPHAN_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, path, True)
    return path


ORPHAN_PREFIX = "satp-ray-"


def sweep_orphans() -> list[str]:
    """Remove what killed commands left of their local clusters: each private temporary folder
    (:func:`_private_tmpdir`) whose command no longer runs, after stopping the processes that
    still carry it (Ray's processes outlive a command killed with SIGKILL: a Train worker may
    still be writing a checkpoint). Returns the folders removed."""
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
                   env_vars: Optional[dict] = None, resources: Optional[dict] = None) -> None:
    """Start a new local Ray instance; see the module docstring. ``dashboard``: Ray's dashboard on
    127.0.0.1 (off by default: a command's own cluster lives as long as the command, and the
    dashboard's processes cost seconds of its start on 2 cores and ~0.9 GiB; ``satp cluster start``
    has one)."""
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
                  resources=resources, runtime_env=job_env(fork_socket=os.environ.get(fork_server.SOCKET_VAR)))
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
