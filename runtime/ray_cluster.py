"""Connecting to Ray: the satp cluster, a named cluster (fast failure when it does not answer), or a
new local one.

:func:`connect` is how every satp command reaches Ray (training, sweeps, preprocessing):

* With an address (``--address``, or ``$RAY_ADDRESS``, which Ray sets inside a Ray job), the
  address is first probed (:func:`runtime.ray_address.probe`, a few seconds): a dead address, or one
  where something else answers, is a one-line error, not ``ray.init``'s minute of retries.
* Without one, the satp cluster of this machine when one runs (``satp cluster start``:
  :mod:`runtime.local_cluster`, whose worker processes are kept warm), else :func:`init_local_ray`
  starts a new local cluster (``address="local"``): plain ``ray.init()`` attaches to a cluster it
  finds on the machine (``/tmp/ray/ray_current_cluster`` or a running GCS), possibly someone else's.
  :func:`connect_in_background` does the same from a thread, while the command imports.

The Ray Train workers' processes of a run are started ahead (:mod:`runtime.worker_pool`): every
runtime environment the job's tasks and actors get must match a prestarted process's exactly, so
the job itself gets none on satp's clusters, and the workers only what the cluster's processes lack
(:func:`missing_worker_env`).

About the local cluster (see :func:`runtime.local_cluster.cluster_env` for its environment):

* Ray Train V2's placement-group cleaner (of Ray Train runs other than satp's, which start none:
  :func:`pipeline.train.driver._trainer_class`) queries the State API of "the" cluster, resolved the
  same way: with several clusters on one machine it may ask another cluster whether our
  controller is alive, get "no", and remove our placement group (killing our training).
  ``RAY_API_SERVER_ADDRESS`` in the cluster's environment pins it to our own dashboard (or, without
  a dashboard, to nothing: :mod:`runtime.ray_logs` keeps its every-second warning off the console).
* Token authentication stays as Ray 2.60 sets it for a new local cluster (on, unless
  ``RAY_AUTH_MODE`` says otherwise), without the warning Ray prints about it on every start.
* Train's preemption watcher is off (:data:`runtime.worker_pool.LOCAL_TRAIN_ENV`, set in the
  driver, which Ray Train passes on to every actor of a run): it watches nodes being drained (spot
  instances); a local cluster is never drained. Its controller polls the workers every 0.5 s (Ray's
  default: 2 s), so that a run's end is seen sooner (the tests' and a sweep's many short runs).
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

from runtime.ports import free_ports
from runtime.ray_address import probe, resolve_address

log = logging.getLogger(__name__)

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
            warm_workers: int = 0, keep_warm: bool = False, **local) -> bool:
    """Connect this process to Ray unless it is connected; return True when a local cluster was started.

    Without an address (and without ``$RAY_ADDRESS``) the satp cluster of this machine is used when
    one runs (:func:`runtime.local_cluster.for_command`), else a new local one starts here
    (:func:`init_local_ray`) with ``warm_workers`` Train workers' processes started ahead (see
    there; ``keep_warm``: kept topped up while this process runs, for sweeps' later trials).

    ``env_vars``: environment the job's processes need: of the connection's runtime env (a named
    cluster; what a satp cluster's workers have already is left out, so that they stay warm) or
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
        return _connect(address, env_vars, log_to_driver, warm_workers, keep_warm, **local)
    finally:
        interrupts.install()  # ray.init's own SIGTERM handling prints a stack dump: see there


def _connect(address: Optional[str], env_vars: Optional[dict], log_to_driver: bool, warm_workers: int,
             keep_warm: bool, **local) -> bool:
    from runtime import local_cluster

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
            os.environ.update(record.connect_env())
            _local_train_env()
        _worker_env = dict(record.worker_env) if record is not None else None
        missing = missing_worker_env(env_vars or {})
        runtime_env = {"env_vars": missing} if missing else {}
        if keep_warm:
            runtime_env.update(sweep_job_env(runtime_env.get("env_vars")))
        elif record is None:  # its workers did not import runtime.ray_logs ahead: the job's hook does
            runtime_env["worker_process_setup_hook"] = "runtime.ray_logs.quiet_ray_train_noise"
        kwargs = {"runtime_env": runtime_env} if runtime_env else {}
        try:
            _ray_init(address=target, log_to_driver=log_to_driver, **kwargs)
        except ConnectionError as exc:
            _worker_env = None
            raise ValueError(f"cannot connect to the Ray cluster at {target}: {str(exc).splitlines()[0]}") from None
        return False
    log.info("starting a local Ray cluster")
    init_local_ray(env_vars=env_vars, log_to_driver=log_to_driver, warm_workers=warm_workers, keep_warm=keep_warm,
                   **local)
    return True


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
    from ray._private import ray_constants

    from runtime.interrupts import Interrupted

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True  # read when the core worker starts
    if not faulthandler.is_enabled():
        faulthandler.enable()
    try:
        ray.init(**kwargs)
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM) from None


def sweep_job_env(extra: Optional[dict[str, str]] = None) -> dict:
    """The runtime environment of a sweep's job (``extra`` variables added): every process of it (its
    Tune trials too, which run a training driver each; Ray gives a job's environment to all its tasks
    and actors) imports the training modules when it starts, so that trials after the first find
    such processes warm; on a satp cluster with a worker fork server every process of it is forked
    (:mod:`runtime.forked_workers`): a trial's actor and Train controller too, not only its workers,
    which the pool of a machine kept busy by one trial after another would not have warm."""
    from runtime.worker_pool import training_env

    return forked(training_env(extra))


def _local_train_env() -> None:
    """What a driver of a local cluster's runs sets for Ray Train to pass on to every actor of a run
    (:data:`runtime.worker_pool.LOCAL_TRAIN_ENV`); a value the user set stays."""
    from runtime.worker_pool import LOCAL_TRAIN_ENV

    for key, value in LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)


def _recorded_cluster_at(target: str):
    """The satp cluster's record when ``target`` is its address (its clients need its settings)."""
    from runtime import local_cluster

    try:
        record = local_cluster.ClusterRecord.load()
    except ValueError:
        return None
    if record is not None and target.split("://")[-1] in (record.address, record.address.replace("127.0.0.1", "localhost")):
        return record
    return None


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


def forked(env: dict, gpu: bool = False) -> dict:
    """The runtime environment ``env``, its processes forked by the connected cluster's worker fork
    server (:mod:`runtime.forked_workers`) when it has one, and ``gpu`` is not asked for (a process
    that initialised CUDA cannot fork one that uses it). The server is named in the environment of
    the cluster's processes (:data:`runtime.forked_workers.SOCKET_VAR`), which a driver of a satp
    cluster read from its record and a Ray worker (a sweep's trial) has itself; a driver of a cluster
    satp did not start takes its own environment's (the nodes run fork servers at that path, and a
    job's driver that ``ray job submit`` started has the node's environment: docs/scale.md)."""
    from runtime import forked_workers

    known = _known_worker_env()
    fork_socket = None if gpu else (os.environ if known is None else known).get(forked_workers.SOCKET_VAR)
    return {**env, "py_executable": forked_workers.executable(fork_socket)} if fork_socket else env


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

    from runtime import local_cluster

    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{ORPHAN_PREFIX}*"):
        owner = folder.name[len(ORPHAN_PREFIX):].split("-", 1)[0]
        if owner.isdigit():
            if psutil.pid_exists(int(owner)):
                continue
            local_cluster.stop_processes(str(folder))
        elif local_cluster.processes_of(str(folder)):  # named before folders carried their owner: in use
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def init_local_ray(num_cpus: Optional[int] = None, dashboard: bool = False, log_to_driver: bool = True,
                   env_vars: Optional[dict] = None, resources: Optional[dict] = None, warm_workers: int = 0,
                   keep_warm: bool = False) -> None:
    """Start a new local Ray instance; see the module docstring. ``dashboard``: Ray's dashboard on
    127.0.0.1 (off by default: a command's own cluster lives as long as the command, and the
    dashboard's processes cost seconds of its start on 2 cores and ~0.9 GiB; ``satp cluster start``
    has one).

    Worker processes: every one imports Ray Train when it starts, and ``warm_workers`` Train
    workers (with their controller's actors) are started ahead, importing torch, PyG and DeepSpeed
    while this process prepares the run (:mod:`runtime.worker_pool`). ``keep_warm`` (a sweep):
    every process of the job imports those (:func:`sweep_job_env`), and the pool is kept topped up
    from a thread of this process."""
    from runtime import local_cluster, worker_pool

    global _worker_env
    for folder in sweep_orphans():
        log.info("removed %s, left by a satp command that was killed", folder)
    port = free_ports(1)[0]
    use_gpu = (env_vars or {}).get("DS_ACCELERATOR") == "cuda"
    env = {**local_cluster.cluster_env(use_gpu=use_gpu, api_server=f"http://127.0.0.1:{port if dashboard else 9}"),
           **(env_vars or {})}
    kwargs = dict(address="local", num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=log_to_driver,
                  resources=resources, runtime_env=sweep_job_env() if keep_warm else None)
    if dashboard:
        kwargs.update(dashboard_host="127.0.0.1", dashboard_port=port)
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    from ray._common.utils import get_default_system_temp_dir

    # the cluster's processes inherit this process's environment: set while ray.init starts them
    # (a job-level runtime env would put every task and actor in an environment of its own, where
    # no prestarted process fits)
    saved = {key: os.environ.get(key) for key in ("TMPDIR", "RAY_TMPDIR", *env, *worker_pool.RUNTIME_ENV_VARS)}
    for key in worker_pool.RUNTIME_ENV_VARS:
        os.environ.pop(key, None)
    os.environ.update(env)
    os.environ["RAY_TMPDIR"] = get_default_system_temp_dir()  # Ray's own files stay where they always are
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
    if warm_workers:
        _warm_up(worker_pool.default_targets(warm_workers), keep_warm)


def _warm_up(targets: dict, keep: bool) -> None:
    """Prestart ``targets`` on this process's own raylet, from a thread (the raylet starts a few
    processes at a time); ``keep``: keep them topped up for as long as the cluster runs."""
    import threading

    import psutil
    import ray

    from runtime import pool_keeper, worker_pool

    node = next(n for n in ray.nodes() if n.get("Alive"))
    raylet = next((p.pid for p in psutil.Process().children(recursive=True) if p.name() == "raylet"), None)
    if raylet is None:
        return
    pool = worker_pool.WorkerPool(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", raylet,
                                  ray.get_runtime_context().gcs_address)
    threading.Thread(target=pool_keeper.keep_warm, args=(pool, targets), kwargs={"once": not keep},
                     name="satp-worker-pool", daemon=True).start()
