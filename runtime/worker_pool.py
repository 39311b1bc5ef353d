"""Warm Ray worker processes: started before a run asks for them, their imports already done.

A Ray Train run asks Ray for several processes at once: Train's controller with its clean-up and
synchronization actors, and one worker per rank; a sweep adds a Tune trial actor per trial. Each new
Python process then imports what it runs: torch, PyG, DeepSpeed and Ray Train take ~10 s of CPU on 2
cores, before the process does anything. Ray can start worker processes ahead of a request (the raylet's
``PrestartWorkers`` call), and can import modules in every worker it starts
(``RAY_preload_python_modules``, a setting of the raylet) or in the workers of one runtime environment
(its setup hook, an environment variable of that environment).

Ray hands an idle process only to a task or actor of the same runtime environment: its text is what Ray
compares, and a child actor inherits (merges) its parent's. So the processes of one run come in a few
*kinds* (:class:`Kind`), each an environment: Train's controller and its helper actors carry Ray's
``RAY_WARN_BLOCKING_GET_INSIDE_ASYNC``, satp's Train workers add the training setup hook
(:func:`training_env`), a Tune trial's carry Tune's ``PL_DISABLE_FORK`` too (and a sweep gives its whole
job the hook, since its trials run a training driver each). Every worker of satp's clusters imports
:data:`PRELOAD_MODULES` (Ray Train) when it starts; a prestarted one of a Train run's kinds then imports
torch and MLflow's store, and of the kinds that train PyG and DeepSpeed too (:mod:`runtime.run_imports`);
one Ray starts for a job's actor imports what that actor opens. A process's kind is read from ``/proc``
(the environment variables it has beyond its raylet's), so a pool serves the local node (the machine of
``satp cluster``); how Ray wrote each kind's environment is read from the cluster's actor table
(:func:`serialized`).

:class:`WorkerPool` counts the raylet's idle processes of each kind (started, not yet handed to a job)
and prestarts what is missing; :mod:`runtime.pool_keeper` decides how many of each kind, and when.
Prestarted processes are kept alive (``keep_alive_duration_secs``) for :data:`KEEP_ALIVE_S`, so that
Ray's idle-worker killer leaves them until a run takes them, and not for long after: a process a task
takes stays bound to that task's job, idle and unusable to any other, until its keep-alive ends (a sweep
or a test session is one long job). No process is prestarted while less than :data:`MIN_FREE_MEMORY` is
free. It ends the placement-group cleaners that interrupted runs left.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Iterable, Optional

from runtime import forked_workers

log = logging.getLogger(__name__)

#: Ray's environment variable for a worker's setup hook ("module.function", run before the worker
#: takes work); ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
SETUP_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
#: what Ray Train sets on its controller (and so on every actor the controller starts)
CONTROLLER_VAR = ("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
#: what every worker process of satp's clusters imports when it starts (the raylet's
#: ``RAY_preload_python_modules``): what a Train controller and its helper actors run; :mod:`runtime.run_imports`
#: (a prestarted process of a Train run's kinds imports what the run opens on its path); :mod:`runtime.ray_logs`
PRELOAD_MODULES = ("ray.train", "runtime.run_imports", "runtime.ray_logs")
MIN_FREE_MEMORY = 2 << 30
KEEP_ALIVE_S = 600
IDLE_TITLE = "ray::IDLE"  # ray._private.ray_constants.WORKER_PROCESS_TYPE_IDLE_WORKER
#: the actors a Train run's controller starts beside its workers (the cluster's autoscaling coordinator once per
#: cluster; satp's runs start no cleaner and no dataset manager, :func:`pipeline.train.driver._trainer_class`,
#: other Ray Train runs on the cluster do). They share the controller's kind (in a sweep the training kind), so a
#: prestarted process of it, which imports what the controller or a worker opens, costs one 7-10 s of CPU; started
#: on demand (~2.5 s: Ray Train only) they are ready before the controller waits on them. Their processes are not
#: counted as their kind's use: the pool keeps none for them
TRAIN_HELPERS = frozenset({"PlacementGroupCleaner", "SynchronizationActor", "DatasetManager",
                           "_AutoscalingCoordinatorActor"})
#: variables the raylet sets in every worker process it starts (seen in /proc): not part of a kind
_PER_PROCESS_VARS = frozenset({"RAY_RAYLET_PID", "RAY_JOB_ID", "SPT_NOENV"})


def training_env(extra: Optional[dict[str, str]] = None) -> dict:
    """The runtime environment of satp's Train workers: :data:`runtime.run_imports.TRAINING_MODULES`
    imported ahead (a prestarted process has them before a run needs them), plus ``extra`` variables."""
    return {"env_vars": {SETUP_HOOK_VAR: "runtime.run_imports.import_training_modules", **(extra or {})}}


def preload_setting(modules: Iterable[str]) -> dict[str, str]:
    """The raylet's environment that makes every worker it starts import ``modules``."""
    return {"RAY_preload_python_modules": ",".join(modules)}


@dataclasses.dataclass(frozen=True, order=True)
class Kind:
    """The environment variables a worker process has beyond its raylet's (its runtime environment)."""

    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, env_vars: dict[str, str]) -> "Kind":
        return cls(tuple(sorted(env_vars.items())))

    def describe(self) -> str:
        names = {SETUP_HOOK_VAR: "training", CONTROLLER_VAR[0]: "train-controller", "PL_DISABLE_FORK": "tune-trial"}
        return "+".join(names.get(k, f"{k}={v}") for k, v in self.env if LOCAL_TRAIN_ENV.get(k) != v) or "plain"


#: what a driver on a local cluster sets in its environment, and Ray Train so passes on to every
#: actor of a run: Train's preemption watcher (one more actor per run) watches nodes being drained,
#: which a local cluster's never are; the controller polls its workers every 0.5 s, not 2 s (a run's
#: end and a worker's failure are seen 0.75 s sooner on average, each a cheap call on one machine)
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


#: what runtime environments set (Train's, Tune's, satp's): never in a raylet's own environment, which its
#: workers inherit (a driver under another satp driver, a test session, has them): a process's kind is
#: what its environment adds to the raylet's, and the kinds of a run would not be told apart
RUNTIME_ENV_VARS = frozenset({SETUP_HOOK_VAR, CONTROLLER_VAR[0], "PL_DISABLE_FORK", *LOCAL_TRAIN_ENV})


def serialized(kind: Kind, merged: bool) -> str:
    """``kind``'s runtime environment as Ray writes it, which is what Ray compares (the text, not its
    meaning): Ray's Python side for an actor a driver creates (``json.dumps`` with sorted keys),
    Ray's C++ side, compact, for one whose creator has an environment of its own, merged into it
    (a Train worker under its controller)."""
    import json

    text = {"env_vars": dict(kind.env)}
    return json.dumps(text, sort_keys=True, separators=(",", ":") if merged else None)


def train_run_kinds(extra: Optional[dict[str, str]] = None) -> tuple[Kind, Kind]:
    """(controller kind, worker kind) of a ``satp train`` run on a local cluster whose workers get
    :func:`training_env`."""
    controller = {**LOCAL_TRAIN_ENV, **dict([CONTROLLER_VAR])}
    return Kind.of(controller), Kind.of({**controller, **training_env(extra)["env_vars"]})


def default_targets(workers: int, forked: bool = False) -> dict[Kind, int]:
    """What one ``satp train`` run with ``workers`` workers takes from the pool: its controller and the workers (its
    helper actors, :data:`TRAIN_HELPERS`, start on demand); ``forked``: the cluster's fork server starts the workers."""
    controller, worker = train_run_kinds()
    return {controller: 1} if forked else {controller: 1, worker: workers}


def default_serializations() -> dict[Kind, str]:
    """How a ``satp train`` run's kinds are written (:func:`serialized`): the controller (and the
    actors it starts without an environment of their own, which inherit its text) by the driver's
    Ray, the workers merged under the controller."""
    controller, worker = train_run_kinds()
    return {controller: serialized(controller, merged=False), worker: serialized(worker, merged=True)}


def process_environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def process_title(pid: int) -> str:
    """Process ``pid``'s title (Ray names a worker ``ray::<its actor or task>``, :data:`IDLE_TITLE` while
    it has no work); ``""`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def actor_class(title: str) -> str:
    """The class (or task) a worker process titled ``title`` runs: ``ray::<class>[.<method>]``."""
    return title.removeprefix("ray::").split(".", 1)[0]


class WorkerPool:
    """The worker processes of one raylet on this machine: counted by kind, prestarted on request.

    ``raylet_address``: its ``host:node_manager_port``; ``raylet_pid``: its process (the workers are
    its children)."""

    def __init__(self, raylet_address: str, raylet_pid: int, gcs_address: str) -> None:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2_grpc

        self.raylet_pid, self.gcs_address = raylet_pid, gcs_address
        self._base = process_environ(raylet_pid)
        self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(raylet_address))
        self._actors = None  # Ray's global state accessor, made on first use
        #: each kind's runtime environment as Ray wrote it for the processes in use (learned, since
        #: Ray compares the text: see serialized), starting from a satp train run's
        self.serializations: dict[Kind, str] = default_serializations()
        self.starting = 0  # processes started and not yet registered, at the last census
        #: how many processes the raylet starts at once (its maximum_startup_concurrency, = its CPUs):
        #: a prestart request beyond that is dropped, not queued
        self.starts_at_once = max(1, int(float(process_environ(raylet_pid).get("RAY_worker_maximum_startup_concurrency", 0))
                                         or _raylet_cpus(raylet_pid)))

    def alive(self) -> bool:
        import psutil

        try:
            return psutil.Process(self.raylet_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def kind_of(self, pid: int) -> Kind:
        extra = {k: v for k, v in process_environ(pid).items()
                 if self._base.get(k) != v and k not in _PER_PROCESS_VARS}
        return Kind.of(extra)

    def census(self) -> tuple[collections.Counter, collections.Counter]:
        """``(available, busy)`` per kind: idle processes not bound to any job, or starting (not yet
        registered; also counted in :attr:`starting`), and processes running a task or actor (but not
        Train's helpers, :data:`TRAIN_HELPERS`)."""
        import psutil
        from ray.core.generated import node_manager_pb2

        reply = self._stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(include_memory_info=False), timeout=10)
        unassigned = {w.pid for w in reply.core_workers_stats
                      if w.worker_type == 0 and set(w.job_id) <= {0xFF} and set(w.actor_id) <= {0xFF}}
        registered = {w.pid for w in reply.core_workers_stats}
        available, busy = collections.Counter(), collections.Counter()
        try:
            children = psutil.Process(self.raylet_pid).children()
        except psutil.NoSuchProcess:
            return available, busy
        busy_pids = {}
        self.starting = 0
        for child in children:
            title = process_title(child.pid)
            if title.startswith("ray::") and title.endswith("Agent"):
                continue  # the dashboard's and the runtime environments' agents
            if forked_workers.CLIENT in process_cmdline(child):
                continue  # a forked worker's client: the worker is the fork server's, never idle here
            if child.pid in unassigned:
                available[self.kind_of(child.pid)] += 1
            elif child.pid not in registered and "default_worker.py" in " ".join(process_cmdline(child)):
                available[self.kind_of(child.pid)] += 1
                self.starting += 1
            elif title.startswith("ray::") and title != IDLE_TITLE and actor_class(title) not in TRAIN_HELPERS:
                kind = busy_pids[child.pid] = self.kind_of(child.pid)
                busy[kind] += 1
        if any(kind not in self.serializations for kind in busy_pids.values()):
            self._learn_serializations(busy_pids)
        return available, busy

    def _state(self):
        """Ray's accessor of the cluster's tables (GCS), made on first use."""
        if self._actors is None:
            from ray._private.state import GlobalState
            from ray._raylet import GcsClientOptions

            state = GlobalState()
            state._initialize_global_state(GcsClientOptions.create(self.gcs_address, None, allow_cluster_id_nil=True,
                                                                   fetch_cluster_id_if_nil=False))
            self._actors = state._connect_and_get_accessor()
        return self._actors

    def _alive_actors(self) -> list:
        from ray.core.generated import gcs_pb2

        actors = (gcs_pb2.ActorTableData.FromString(raw) for raw in self._state().get_actor_table(None, None))
        return [a for a in actors if a.state == gcs_pb2.ActorTableData.ALIVE]

    def _learn_serializations(self, busy_pids: dict[int, Kind]) -> None:
        """Read how Ray wrote the runtime environments of the actors in use (GCS's actor table)."""
        for actor in self._alive_actors():
            kind = busy_pids.get(actor.pid)
            if kind is not None and kind not in self.serializations:
                self.serializations[kind] = actor.serialized_runtime_env

    def end_orphaned_cleaners(self) -> int:
        """End Ray Train's placement-group cleaners whose run's driver has gone; return how many
        (Ray Train runs other than satp's, which start none).

        Each Train run starts a detached ``PlacementGroupCleaner`` that asks the State API (the
        dashboard) whether the run's controller lives, and exits once it does not. A run that ends
        normally stops it; one whose driver was interrupted or killed leaves it asking, and
        without a dashboard it never learns the answer: a process (~200 MB, polling) per such run,
        for as long as the cluster lives. Its job's placement groups went with the job."""
        import signal

        from ray.core.generated import gcs_pb2

        dead_jobs = {gcs_pb2.JobTableData.FromString(raw).job_id
                     for raw in self._state().get_job_table(skip_submission_job_info_field=True,
                                                            skip_is_running_tasks_field=True)
                     if gcs_pb2.JobTableData.FromString(raw).is_dead}
        ended = 0
        for actor in self._alive_actors():
            if actor.class_name == "PlacementGroupCleaner" and actor.job_id in dead_jobs and \
                    _is_child(actor.pid, self.raylet_pid):
                try:
                    os.kill(actor.pid, signal.SIGTERM)
                    ended += 1
                except OSError:
                    pass
        return ended

    def prestart(self, kind: Kind, count: int, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        from ray.core.generated import common_pb2, node_manager_pb2

        request = node_manager_pb2.PrestartWorkersRequest(language=common_pb2.Language.PYTHON, num_workers=count,
                                                          keep_alive_duration_secs=keep_alive_s)
        if kind.env:
            request.runtime_env_info.serialized_runtime_env = self.serializations.get(kind) or serialized(kind, False)
        self._stub.PrestartWorkers(request, timeout=10)

    def top_up(self, targets: dict[Kind, int], available: Optional[collections.Counter] = None,
               most: Optional[int] = None) -> dict[Kind, int]:
        """Prestart what ``targets`` lacks beyond the available processes, as many as the raylet starts
        at once and at most ``most`` (call again for the rest); return what was asked for."""
        import psutil

        if available is None:
            available = self.census()[0]
        started, room = {}, self.starts_at_once - self.starting
        if most is not None:
            room = min(room, most)
        # the training kinds first: their processes take longest to be ready
        for kind, target in sorted(targets.items(), key=lambda item: (SETUP_HOOK_VAR not in dict(item[0].env), item[0])):
            missing = min(target - available.get(kind, 0), room)
            if missing <= 0:
                continue
            room -= missing
            if psutil.virtual_memory().available < MIN_FREE_MEMORY:
                log.warning("worker pool: less than %d GiB free: no %s process prestarted", MIN_FREE_MEMORY >> 30,
                            kind.describe())
                break
            self.prestart(kind, missing)
            started[kind] = missing
        return started


def _is_child(pid: int, parent: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() == parent
    except psutil.NoSuchProcess:
        return False


def _raylet_cpus(raylet_pid: int) -> int:
    """The CPUs a raylet was started with (its ``--num_prestart_python_workers``, which Ray sets to them)."""
    try:
        with open(f"/proc/{raylet_pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return 1
    for arg in args:
        if arg.startswith("--num_prestart_python_workers="):
            return int(arg.split("=", 1)[1] or 1)
    return 1


def process_cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except Exception:  # gone, or not ours to read
        return []
