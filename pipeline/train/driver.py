"""Distributed training, the driver side: :func:`train_plan` checks a job, builds and fits the trainer.

Each step runs before the costly ones: the run's lease, the plan's decision and the tracking store,
Ray and its resources, the data, the MLflow run, then Ray Train's ``TorchTrainer``
(:func:`worker_main`); only when the fit succeeded, the best model registered. A retry resumes
from the newest checkpoint in the same MLflow run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.config import JobConfig
from pipeline.train import checkpoint as ckpt
from pipeline.train import mlflow_run, rerun, startup
from pipeline.train.plan import JobPlan, store_env
from pipeline.train.worker_setup import WorkerSetup
from runtime.command import command_pid, warn

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- driver
@dataclasses.dataclass
class TrainOutcome:
    """What :func:`train_job` returns."""

    run_name: str
    storage_path: str
    checkpoint_path: Optional[str]
    metrics: dict[str, Any]  # the last epoch's reported metrics (rank 0)
    history: list[dict[str, Any]]
    best: dict[str, Any]  # {"epoch", "val", "test"} by validation
    constant: Optional[float]  # best constant predictor's test metric
    metric: str
    task: str
    mlflow_run_id: Optional[str]
    tracking_uri: Optional[str]
    registered: Optional[dict[str, Any]]  # see pipeline.registry.versions.log_and_register
    result: Any = None  # the ray.train.Result
    trained: bool = True  # False: the run had finished with this configuration already (nothing ran)
    stopped: Optional[str] = None  # why it stopped before train.epochs (pipeline.train.stopping), if it did
    time_to_target: Optional[dict[str, Any]] = None  # pipeline.train.stopping.time_to_target, if reached
    target: Optional[dict[str, Any]] = None  # the job's train.target, if any


def prepare_data(job: JobConfig, address: Optional[str] = None) -> Path | str:
    """Build (or validate) the job's shards through the preprocessing stage; return their directory
    (a URI when ``shards.root`` is one)."""
    import preprocessing
    from pipeline.console import show_progress

    log.info("preprocessing: %s into %s", job.data.name, job.shards.root)
    return preprocessing.preprocess(job.data, job.transform, job.shards, address=address, progress=show_progress(),
                                    storage=job.storage.settings())


def train_job(job: JobConfig, *, shard_dir: Optional[str | Path] = None, address: Optional[str] = None,
              register: bool = True, callbacks: Optional[list] = None, fault: Optional[dict] = None,
              restart: bool = False, started_at: Optional[float] = None) -> TrainOutcome:
    """Train ``job`` on Ray Train (+ DeepSpeed) and register the best model; return the outcome.

    ``shard_dir``: the preprocessed shards (default: the job's preprocessing, :func:`prepare_data`);
    ``address``: the Ray cluster (default ``$RAY_ADDRESS``, else a new local one); ``register``: the best
    model, only when the fit succeeded; ``callbacks``: Ray Train ``UserCallback``s; ``fault``: a test hook
    (:mod:`pipeline.train.faults`); ``restart``: start the run name over; ``started_at``: when the run's
    start-up began (default: when this process started). A rerun of the same run name resumes, or
    raises :class:`pipeline.train.rerun.RerunConflict` for another configuration.
    """
    from pipeline.train.lease import WAIT_S
    from pipeline.train.preflight import early_checks

    early_checks([job], address=address)
    return train_plan(JobPlan.resolve(job, address=address, restart=restart), shard_dir=shard_dir, register=register,
                      callbacks=callbacks, fault=fault, lease_wait_s=WAIT_S, started_at=started_at)


def train_plan(plan: JobPlan, *, shard_dir: Optional[str | Path] = None, register: bool = True,
               callbacks: Optional[list] = None, fault: Optional[dict] = None, lease_wait_s: float = 0.0,
               started_at: Optional[float] = None, lease=None) -> TrainOutcome:
    """:func:`train_job` of a job resolved into ``plan`` whose :func:`~pipeline.train.preflight.early_checks`
    passed (``satp train`` runs them at the edge), under the run's lease (:mod:`pipeline.train.lease`): ``lease``, the one the caller holds, else taken
    here; another command holding it is an error (a one-line :class:`~pipeline.train.lease.LeaseHeld`)
    unless it expires within ``lease_wait_s``."""
    from pipeline.train.lease import RunLease
    from runtime.interrupts import deferred

    taken = None if lease is not None else RunLease(plan.checkpoints.named, plan.job.train.run_name,
                                                    storage=plan.job.storage.settings()).acquire(lease_wait_s)
    try:
        return _train_under_lease(plan, shard_dir=shard_dir, register=register, callbacks=callbacks, fault=fault,
                                  started_at=started_at)
    finally:
        if taken is not None:
            with deferred():
                taken.release()


def _train_under_lease(plan: JobPlan, *, shard_dir: Optional[str | Path], register: bool, callbacks: Optional[list],
                       fault: Optional[dict], started_at: Optional[float]) -> TrainOutcome:
    from pipeline import pyg_templates
    from pipeline.train.preflight import connect_and_check

    pyg_templates.install()
    # start-up events (pipeline.train.startup)
    marks = {"command": started_at or startup.process_started(command_pid()), "plan": time.time()}
    job, train = plan.job, plan.job.train
    plan = plan.examine()  # what the run name holds, found once (the lease keeps other commands from changing it)
    early = plan.decision()
    if job.mlflow.enabled and not plan.restart:
        mlflow_run.check_tracking_store(plan)
    if early is not None and early.action == "finished" and shard_dir is None:  # no Ray started
        return _already_finished(plan.with_shards(rerun.job_shard_dir(job)), early, register)
    connect_and_check([job], address=plan.address, ray_env=store_env(job))
    marks["ray"] = time.time()
    plan = plan.with_shards(shard_dir if shard_dir is not None else prepare_data(job, plan.address))
    _say_padding_cost(plan)
    marks["shards"] = time.time()
    decision = plan.decision()
    if decision.action == "finished":
        return _already_finished(plan, decision, register)
    checkpoints = plan.checkpoints
    resume_from = None
    if decision.action == "restart":
        log.info("restarting run %s: deleting its checkpoints in %s", train.run_name, checkpoints.named)
        from pipeline.train.lease import LEASE_FILE

        checkpoints.clear(keep=LEASE_FILE)
    elif decision.action == "resume":
        previous = decision.previous
        log.info("resuming run %s after epoch %d, at global step %d (%s)", train.run_name, previous.epoch,
                 previous.steps, previous.checkpoint)
        resume_from = previous.name
        checkpoints.prune(keep=previous.name)
    plan = plan.with_setup(damaged=checkpoints.damaged,  # said once here: the workers do not say it again
                           startup=marks, fault=fault if fault is not None else _fault_from_environment(),
                           provenance=decision.provenance, resume_from=resume_from)

    previous_status = None
    if job.mlflow.enabled:
        plan, previous_status = mlflow_run.open_run(plan, decision.action)
    try:
        result = _fit(job, plan.setup, callbacks)
        if (result.return_value or {}).get("storage_full"):
            raise _storage_full(checkpoints, result.return_value["storage_full"])
        name = Path(result.checkpoint.path).name
        state, best_weights = checkpoints.load(name)
        checkpoint_path = checkpoints.path(name)
        checkpoints.prune(keep=name)
        registered = None
        if job.mlflow.enabled and register and best_weights is not None:
            registered = mlflow_run.log_best_model(plan, state, best_weights)
    except BaseException as exc:
        if job.mlflow.enabled and plan.setup.run_id:
            from runtime.interrupts import deferred

            with deferred():  # a second Ctrl-C does not leave the MLflow run RUNNING
                mlflow_run.close_failed(plan, previous_status, exc)
        raise
    if job.mlflow.enabled and plan.setup.run_id:
        mlflow_run.close_finished(plan, state)
    return _outcome(plan, state, checkpoint_path, registered, result=result)


def _say_padding_cost(plan: JobPlan) -> None:
    """One warning line when ``train.step`` pads batches for CPU workers at a cost (:mod:`pipeline.train.step_cost`)."""
    from pipeline.train.loader import open_split
    from pipeline.train.step_cost import padding_cost
    from sat.config import SATConfig

    line = padding_cost(plan.job, SATConfig.from_dict(plan.setup.model_config),
                        open_split(plan.setup.shard_dir, "train", plan.job.storage.settings()))
    if line:
        warn(line)


def _outcome(plan: JobPlan, state: dict, checkpoint_path: str, registered: Optional[dict], **extra) -> TrainOutcome:
    """The :class:`TrainOutcome` of a checkpoint's ``state`` (the run's history, best epoch, stops)."""
    from pipeline.train import stopping

    train, target = plan.job.train, plan.job.train.target
    history = state.get("history") or []
    return TrainOutcome(
        run_name=train.run_name, storage_path=train.storage_path, checkpoint_path=checkpoint_path,
        metrics=history[-1] if history else {}, history=history, best=state["best"], constant=state.get("constant"),
        metric=plan.task.metric, task=plan.task.name, mlflow_run_id=plan.setup.run_id,
        tracking_uri=plan.job.mlflow.tracking_uri, registered=registered,
        stopped=state.get("stopped"), target=target.model_dump() if target is not None else None,
        time_to_target=stopping.time_to_target(history, target, plan.task.mode), **extra,
    )


def _fault_from_environment() -> Optional[dict]:
    """The test hook ``fault`` of :func:`train_job` from ``$SATP_TEST_FAULT`` (JSON); a signal with
    no ``pid`` goes to this process."""
    fault = json.loads(os.environ.get("SATP_TEST_FAULT") or "null")
    if fault and "signal" in fault:
        fault.setdefault("pid", os.getpid())
    return fault


def _already_finished(plan: JobPlan, decision, register: bool) -> TrainOutcome:
    """A rerun of a finished run of the same configuration: nothing trains; its registered model
    is found (registered now from its last checkpoint if an earlier attempt stopped before)."""
    from pipeline.registry import tracking

    job, previous = plan.job, decision.previous
    plan = plan.with_setup(provenance=decision.provenance)
    state = previous.state
    plan.checkpoints.prune(keep=previous.name)
    registered = None
    if job.mlflow.enabled:
        uri = job.mlflow.tracking_uri
        found = tracking.find_training_run(uri, job.mlflow.experiment, plan.run_key)
        client = tracking.client(uri)
        digest = decision.provenance.get("config_hash")
        if found is not None:
            plan = plan.with_setup(run_id=found.info.run_id)
            versions = [v for v in client.search_model_versions(f"run_id='{plan.setup.run_id}'")
                        if (v.tags or {}).get("satp.config_hash") == digest]
            if versions:
                v = max(versions, key=lambda v: int(v.version))
                registered = {"registered_model": v.name, "version": int(v.version),
                              "registered_uri": f"models:/{v.name}/{v.version}", "model_uri": v.source,
                              "champion": None, "reason": "registered when the run finished"}
                if "satp.champion_decision" not in (v.tags or {}):  # stopped between registering and promoting
                    log.info("run %s: version %s was registered, its champion decision not made: making it now",
                             job.train.run_name, v.version)
                    registered.update(mlflow_run.promote_version(plan, state, v.name, int(v.version)))
        if registered is None and register:
            if plan.setup.run_id is None:
                plan, _ = mlflow_run.open_run(plan, "resume")
            _, best_weights = plan.checkpoints.load(previous.name)
            if best_weights is not None:
                log.info("run %s finished before its model was registered: registering it now", job.train.run_name)
                registered = mlflow_run.log_best_model(plan, state, best_weights)
        if plan.setup.run_id is not None and (found is None or found.info.status != "FINISHED"):
            client.set_terminated(plan.setup.run_id, status="FINISHED")
    log.info("run %s finished already (epoch %d, same configuration): nothing to train", job.train.run_name,
             previous.epoch)
    return _outcome(plan, state, previous.checkpoint, registered, trained=False)


def _fit(job: JobConfig, setup: WorkerSetup, callbacks: Optional[list]):
    """Fit the Ray Train ``TorchTrainer``; return its result or raise. The workers' process group
    (DeepSpeed's too) uses the resolved ``resources.collective_backend``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from runtime.storage import ray_storage

    from pipeline.train.preflight import worker_resources

    train, res = job.train, job.resources
    resources = worker_resources(res)
    process_env = {"OMP_NUM_THREADS": str(res.torch_threads or max(1, int(res.cpus_per_worker)))}
    for key in ("RAY_COLOR_PREFIX", "TQDM_DISABLE"):  # what this command's console asks for
        if os.environ.get(key):
            process_env[key] = os.environ[key]
    callbacks = list(callbacks or [])
    if job.mlflow.enabled and setup.run_id:
        from pipeline.train.epoch_logger import RegisteredEpochLogger
        from pipeline.tasks import TASK_CLASSES

        target = train.target.model_dump() if train.target is not None else None
        callbacks.append(RegisteredEpochLogger(job.mlflow.tracking_uri, setup.run_id, TASK_CLASSES[setup.task_name].metric,
                                               target))
    setup = dataclasses.replace(setup, process_env=process_env, startup=dict(setup.startup or {}, fit=time.time()))
    trainer = _trainer_class()(
        worker_main,
        train_loop_config={"setup": setup},
        torch_config=TorchConfig(backend=res.torch_backend),
        scaling_config=ScalingConfig(num_workers=res.num_workers, use_gpu=res.use_gpu, resources_per_worker=resources,
                                     placement_strategy=res.placement_strategy,
                                     elastic_resize_monitor_interval_s=res.resize_check_s),
        run_config=RunConfig(
            name=train.run_name,
            **ray_storage(train.storage_path, job.storage.settings()),  # a URI: Ray's storage_filesystem
            failure_config=FailureConfig(max_failures=train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=train.checkpoints_to_keep),
            callbacks=callbacks,
            worker_runtime_env=worker_runtime_env(job),
        ),
    )
    count = f"{res.min_workers} to {res.max_workers}" if res.elastic else str(res.num_workers)
    log.info("starting %s Ray Train worker(s) (%s each; collectives: %s)", count,
             ", ".join(f"{v:g} {k}" for k, v in resources.items()), res.torch_backend)
    with _group_start_timeout(res.elastic):
        result = trainer.fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None and not (result.return_value or {}).get("storage_full"):
        raise RuntimeError("training finished without a checkpoint")
    return result


#: Ray Train's setting (read by its controller, passed on from the driver's environment): how long a
#: new worker group waits for its placement group before the controller tries again
GROUP_START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
#: its value in elastic runs (Train's default: 60 s): the group that replaces a lost node's first asks
#: for the old size (Ray still counts the dead node's CPUs) and waits this out before it takes what is left
ELASTIC_GROUP_START_TIMEOUT_S = 15.0


@contextlib.contextmanager
def _group_start_timeout(elastic: bool):
    """While an elastic run's ``fit`` starts its controller: :data:`GROUP_START_TIMEOUT_VAR` at
    :data:`ELASTIC_GROUP_START_TIMEOUT_S` in this process's environment, which Ray Train passes on to
    the controller. A value the user set stays."""
    if not elastic or GROUP_START_TIMEOUT_VAR in os.environ:
        yield
        return
    os.environ[GROUP_START_TIMEOUT_VAR] = f"{ELASTIC_GROUP_START_TIMEOUT_S:g}"
    try:
        yield
    finally:
        os.environ.pop(GROUP_START_TIMEOUT_VAR, None)


def worker_runtime_env(job: JobConfig) -> dict:
    """The Train workers' runtime environment: the variables the cluster's workers lack that must be
    set before a process imports the training modules (DeepSpeed reads ``DS_ACCELERATOR`` on import),
    and the store's (:func:`pipeline.train.plan.store_env`); the rest is :attr:`WorkerSetup.process_env`."""
    from runtime.ray_cluster import missing_worker_env

    needed = {"OUTDATED_IGNORE": "1", "DS_ACCELERATOR": "cuda" if job.resources.use_gpu else "cpu", **store_env(job)}
    missing = missing_worker_env(needed)
    return {"env_vars": missing} if missing else {}


def _storage_full(checkpoints: ckpt.CheckpointManager, full: dict) -> OSError:
    """The one-line error of a checkpoint that did not fit on its disk (see :func:`worker_main`)."""
    import errno

    kept = checkpoints.newest_intact()
    what = (f"the checkpoint of epoch {checkpoints.state(kept)['epoch']} ({checkpoints.path(kept)}) is kept: free space "
            f"there and run the same command to resume after it" if kept is not None else
            "no checkpoint is kept: free space there and run the same command to start the run")
    error = OSError(f"{full['path']}: the disk is full (No space left on device) while writing the checkpoint of "
                    f"epoch {full['epoch']}; the partial checkpoint was removed and the run ended (not retried); {what}")
    error.errno = errno.ENOSPC
    return error


def _trainer_class():
    """Ray Train's ``TorchTrainer`` whose ``fit`` answers SIGINT as it does SIGTERM, with
    :class:`runtime.interrupts.Interrupted`, so that the driver unwinds and says what was kept."""
    from runtime import interrupts, ray_private

    return ray_private.trainer_class(on_sigint=lambda controller: interrupts.install(keep=controller))


def worker_main(config: dict) -> Optional[dict]:
    """The Ray Train workers' entry (``train_loop_per_worker``, ``config = {"setup": WorkerSetup}``):
    process set-up, then a :class:`~pipeline.train.trainer.Trainer` in a
    :class:`~pipeline.train.context.RayContext`; returns ``{"storage_full": ...}`` when a checkpoint
    did not fit on its disk, else None."""
    from pipeline import pyg_templates

    setup = config["setup"]
    os.environ.update(setup.process_env or {})
    pyg_templates.install()
    import ray.train

    # Ray Train's context logs every report's metrics, which rank 0 prints already
    logging.getLogger(os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution",
                                   "context.py")).setLevel(logging.WARNING)
    from pipeline.train.context import RayContext
    from pipeline.train.trainer import Trainer

    try:
        Trainer(setup, RayContext(setup.job)).fit()
    except ckpt.StorageFull as full:
        # every rank stops here together (CheckpointManager.write); returning instead of
        # raising ends the fit as done (a raise would be a worker failure, retried max_failures
        # times on the same full disk): rank 0's value reaches the driver (Result.return_value)
        return {"storage_full": full.details}
    return None
