"""Distributed training, the driver side: :func:`train_job` checks a job, builds and fits the trainer.

:func:`train_job` is the reusable entry point (the CLI's ``satp train``, the
demo and Tune trials call it). In order, each step before the costly ones:

1. :func:`pipeline.train.preflight.preflight`: the job alone, its data root, the Ray
   address (connected here), the cluster's resources against the request;
2. :func:`prepare_data` (the preprocessing stage; reuses finished shards) and
   :func:`plan`: the model against the shards' features, the model built once;
3. :func:`pipeline.train.rerun.decide`: what the run name already holds. A run of
   another configuration is never resumed into; a finished run of the same
   configuration is not trained or registered again (its model is reported);
4. the MLflow run (:mod:`pipeline.registry.tracking`), then a Ray Train V2
   ``TorchTrainer`` whose workers run :func:`pipeline.train.worker.worker_loop`;
5. only when the fit succeeded: the best model logged and registered, with the
   configuration hash and commits its checkpoint recorded.

The workers (:mod:`pipeline.train.worker`) train, evaluate, checkpoint and report every
epoch; Ray Train's controller logs each epoch to MLflow once it has registered
the epoch's checkpoint (:mod:`pipeline.train.epoch_logger`). A retry after a worker or a node was lost
(``FailureConfig``) resumes from the last checkpoint, in the same MLflow run.
A failed attempt marks its own MLflow run FAILED, except a run that had
FINISHED before (a continuation with more epochs): it stays FINISHED, with the
failure in its ``satp.last_attempt`` tag, since its registered versions are
sound.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pipeline.train import checkpoint as ckpt
from pipeline.config import JobConfig
from pipeline.train.loader import open_split
from pipeline.tasks import Task, make_task, task_name_for
from pipeline.config.train import default_tracking_uri, runs_dir
from pipeline.train.worker import WorkerSetup, build_model, worker_loop
from sat.config import SATConfig

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


def resolve_job(job: JobConfig) -> JobConfig:
    """Fill the defaults that depend on where the driver runs (absolute paths), in a copy."""
    job = job.model_copy(deep=True)
    train = job.train
    train.run_name = train.run_name or job.name
    train.storage_path = str(Path(train.storage_path or runs_dir() / "ray").expanduser().resolve())
    if job.mlflow.enabled:
        job.mlflow.tracking_uri = job.mlflow.tracking_uri or default_tracking_uri()
    return job


def prepare_data(job: JobConfig, address: Optional[str] = None) -> Path:
    """Build (or validate) the job's shards through the preprocessing stage; return their directory."""
    import preprocessing
    from pipeline.console import show_progress

    for section in ("data", "transform", "shards"):
        if not hasattr(job, section):
            raise ValueError(f"job {job.name!r} has no {section!r} section (preprocessing not configured)")
    log.info("preprocessing: %s into %s", job.data.name, job.shards.root)
    return Path(preprocessing.preprocess(job.data, job.transform, job.shards, address=address,
                                         progress=show_progress()))


def precheck(job: JobConfig) -> None:
    """Checks that need no data and no Ray (raise ``ValueError`` before anything starts)."""
    from pipeline.train.preflight import check_config

    check_config(job)


def plan(job: JobConfig, shard_dir: str | Path) -> WorkerSetup:
    """Check the job against its data and build the worker setup; raises ``ValueError`` early."""
    from pipeline.train.engine import resolve_precision

    data_name = getattr(getattr(job, "data", None), "name", None)
    task_name = task_name_for(job.train.task, data_name)
    precision = job.train.precision  # "auto" resolved in the workers (the driver may have no GPU)
    if precision == "fp16" and not job.resources.use_gpu:
        resolve_precision(precision, False)  # raises
    train_ds = open_split(shard_dir, "train")
    if len(train_ds) == 0:
        raise ValueError(f"{shard_dir}: the train split is empty")
    for split in ("valid", "test"):
        if len(open_split(shard_dir, split)) == 0:
            raise ValueError(f"{shard_dir}: the {split} split is empty")
    task = make_task(task_name, vocab=train_ds.vocab)
    model_config = task.configure(job.model, train_ds[0])
    if model_config.gnn_type == "pna" and model_config.has_gnn and not model_config.pna_degree_histogram:
        model_config = dataclasses.replace(model_config, pna_degree_histogram=train_ds.in_degree_histogram())
    from pipeline.train.preflight import check_shard_features

    check_shard_features(model_config, train_ds.manifest or {}, shard_dir)
    try:
        model = build_model(model_config)
        del model
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model: {str(exc).splitlines()[0]}") from None
    return WorkerSetup(
        job=job,
        shard_dir=str(Path(shard_dir).resolve()),
        model_config=dataclasses.asdict(model_config),
        task_name=task_name,
        task_state={k: v for k, v in task.state().items() if k != "name"},
        precision=precision,
        run_id=None,
        tracking_uri=job.mlflow.tracking_uri if job.mlflow.enabled else None,
    )


def _manifest_hash(shard_dir: str | Path) -> str:
    try:
        manifest = open_split(shard_dir, "train").manifest or {}
    except Exception:
        return ""
    for key in ("config_hash", "transform_hash", "hash"):
        if manifest.get(key):
            return str(manifest[key])
    return ""


def train_job(
    job: JobConfig,
    *,
    shard_dir: Optional[str | Path] = None,
    address: Optional[str] = None,
    register: bool = True,
    callbacks: Optional[list] = None,
    fault: Optional[dict] = None,
    restart: bool = False,
) -> TrainOutcome:
    """Train ``job`` on Ray Train (+ DeepSpeed) and register the best model; return the outcome.

    Args:
        job: a validated job (:func:`pipeline.config.load_job`).
        shard_dir: the preprocessed shards; default: run the job's preprocessing
            (:func:`prepare_data`, which reuses finished shards).
        address: Ray cluster address for ``ray.init`` when Ray is not initialised
            (default: ``$RAY_ADDRESS``, else a new local cluster).
        register: log and register the best model at the end (``mlflow.registered_model``,
            default ``sat-<task>``). Never happens when the fit fails.
        callbacks: Ray Train ``UserCallback``s (e.g. Tune's ``TuneReportCallback``).
        fault: test hook, kill one worker once: ``{"rank", "epoch", "step", "marker"}``, or signal the
            driver after a checkpoint: ``{"signal", "pid", "epoch", "marker"}`` (default: the JSON in
            ``$SATP_TEST_FAULT``, for tests that run the ``satp`` command).
        restart: start the run name over when it holds a checkpoint of another configuration
            (or of this one): its checkpoints are deleted, its MLflow run is detached from it.

    A rerun with the same ``train.run_name`` and ``train.storage_path`` resumes from the
    last checkpoint and logs into the same MLflow run, if the configuration is the same
    (:mod:`pipeline.train.rerun`); raises :class:`pipeline.train.rerun.RerunConflict` otherwise.
    """
    from pipeline import pyg_templates
    from pipeline.train import rerun
    from pipeline.train.preflight import preflight
    from pipeline.registry.versions import git_commit

    pyg_templates.install()
    job = resolve_job(job)
    train = job.train
    check_stopping(job)
    run_key = f"{train.storage_path}/{train.run_name}"
    early = preflight([job], address=address, restart=restart)
    if early is not None and early.action == "finished" and shard_dir is None:  # no Ray was started
        setup = plan(job, rerun.job_shard_dir(job))
        setup.provenance = early.provenance
        return _already_finished(job, setup, early.previous, run_key, register)
    shard_dir = Path(shard_dir) if shard_dir is not None else prepare_data(job, address)
    setup = plan(job, shard_dir)
    setup.fault = fault if fault is not None else _fault_from_environment()
    manifest = open_split(setup.shard_dir, "train").manifest or {}
    decision = rerun.decide(job, rerun.weights_config(job, manifest), git_commit(), restart=restart)
    setup.provenance = decision.provenance
    if decision.action == "finished":
        return _already_finished(job, setup, decision.previous, run_key, register)
    if decision.action == "restart":
        log.info("restarting run %s: deleting its checkpoints in %s", train.run_name, decision.previous.run_dir)
        shutil.rmtree(decision.previous.run_dir)
    elif decision.action == "resume":
        log.info("resuming run %s after epoch %d (%s)", train.run_name, decision.previous.epoch,
                 decision.previous.checkpoint)
        # the newest complete checkpoint, which Ray may not have registered (an interrupted run)
        setup.resume_from = str(decision.previous.checkpoint)
        rerun.prune_unregistered(decision.previous.run_dir, keep=decision.previous.checkpoint)

    previous_status = None
    if job.mlflow.enabled:
        previous_status = _mlflow_run(job, setup, run_key, decision.action)
    try:
        result = _fit(job, setup, callbacks)
        with result.checkpoint.as_directory() as directory:
            state = ckpt.load_state(directory)
            best_weights = ckpt.load_best_weights(directory)
            checkpoint_path = str(result.checkpoint.path)
        rerun.prune_unregistered(Path(train.storage_path) / train.run_name, keep=Path(checkpoint_path))
        if state["epoch"] != train.epochs - 1 and not state.get("stopped"):
            raise RuntimeError(f"training stopped after epoch {state['epoch']} of {train.epochs}")
        registered = None
        task = make_task(setup.task_name, vocab=open_split(setup.shard_dir, "train").vocab, **setup.task_state)
        if job.mlflow.enabled and register and best_weights is not None:
            registered = _log_best_model(job, setup, task, state, best_weights)
    except BaseException as exc:
        if job.mlflow.enabled and setup.run_id:
            _close_failed(job, setup.run_id, previous_status, exc)
        raise
    if job.mlflow.enabled and setup.run_id:
        from pipeline.registry.tracking import close_run

        _tag_stopping(job, setup.run_id, state)
        close_run(job.mlflow.tracking_uri, setup.run_id, "FINISHED")
    history = state["history"]
    return TrainOutcome(
        run_name=train.run_name,
        storage_path=train.storage_path,
        checkpoint_path=checkpoint_path,
        metrics=history[-1] if history else {},
        history=history,
        best=state["best"],
        constant=state["constant"],
        metric=task.metric,
        task=task.name,
        mlflow_run_id=setup.run_id,
        tracking_uri=job.mlflow.tracking_uri,
        registered=registered,
        result=result,
        **_stopping_outcome(job, task, state),
    )


def _fault_from_environment() -> Optional[dict]:
    """The test hook ``fault`` of :func:`train_job` from ``$SATP_TEST_FAULT`` (JSON); a signal with
    no ``pid`` goes to this process."""
    fault = json.loads(os.environ.get("SATP_TEST_FAULT") or "null")
    if fault and "signal" in fault:
        fault.setdefault("pid", os.getpid())
    return fault


def check_stopping(job: JobConfig) -> None:
    """``train.target`` names a metric the job's task reports (a one-line ``ValueError``)."""
    from pipeline.train import stopping
    from pipeline.tasks import TASK_CLASSES

    task_name = task_name_for(job.train.task, getattr(getattr(job, "data", None), "name", None))
    stopping.check_target(job.train.target, TASK_CLASSES[task_name].metric)


def _stopping_outcome(job: JobConfig, task: Task, state: dict) -> dict[str, Any]:
    """The :class:`TrainOutcome` fields of the stopping rules, from a checkpoint's state."""
    from pipeline.train import stopping

    target = job.train.target
    return {"stopped": state.get("stopped"), "target": target.model_dump() if target is not None else None,
            "time_to_target": stopping.time_to_target(state.get("history") or [], target, task.mode)}


def _tag_stopping(job: JobConfig, run_id: str, state: dict) -> None:
    """The MLflow run's tags: its target and why it stopped early (``satp.stopped``), if it did."""
    from pipeline.registry import tracking

    client = tracking.client(job.mlflow.tracking_uri)
    target = job.train.target
    if target is not None:
        client.set_tag(run_id, "satp.target", f"{target.metric} {target.value:g}")
    if state.get("stopped"):
        client.set_tag(run_id, "satp.stopped", str(state["stopped"])[:500])


def _mlflow_run(job: JobConfig, setup: WorkerSetup, run_key: str, action: str) -> Optional[str]:
    """Open the run's MLflow run (``setup.run_id``); return its status before (None: new).

    A fresh start never logs into an MLflow run that holds another training's history: a
    restarted run name, or one whose checkpoints are gone while its MLflow run has metrics,
    gets a new MLflow run (the old one is detached from the key, see
    :func:`pipeline.registry.tracking.retire_run`)."""
    import yaml

    from pipeline.registry import tracking

    uri = job.mlflow.tracking_uri
    existing = tracking.find_training_run(uri, job.mlflow.experiment, run_key)
    if existing is not None and action in ("fresh", "restart") and (
            action == "restart" or existing.data.metrics or existing.info.status == "FINISHED"):
        why = ("run started over (--restart)" if action == "restart"
               else "its checkpoints were gone: the run name started over")
        tracking.retire_run(uri, existing.info.run_id, run_key, why)
        existing = None
    config_text = yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)
    params = job.model_dump(mode="json")
    params["model"] = setup.model_config
    params["shard_dir"] = setup.shard_dir
    setup.run_id = tracking.open_run(uri, job.mlflow.experiment, run_key, job.train.run_name, params, config_text)
    tracking.client(uri).set_tag(setup.run_id, "satp.config_hash", setup.provenance["config_hash"])
    return existing.info.status if existing is not None else None


def _close_failed(job: JobConfig, run_id: str, previous_status: Optional[str], exc: BaseException) -> None:
    """A failed attempt marks its MLflow run FAILED, unless the run had FINISHED before: a failed
    continuation leaves it FINISHED (its registered versions are sound), with the failure tagged."""
    from pipeline.registry import tracking

    try:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, KeyboardInterrupt):
            first = f"interrupted ({first or 'SIGINT'})"
        if previous_status == "FINISHED":
            client = tracking.client(job.mlflow.tracking_uri)
            client.set_tag(run_id, "satp.last_attempt", f"failed {time.strftime('%Y-%m-%d %H:%M:%S')}: {first}"[:500])
            tracking.close_run(job.mlflow.tracking_uri, run_id, "FINISHED")
        else:
            tracking.close_run(job.mlflow.tracking_uri, run_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
    except Exception:  # the tracking store must not hide the training error
        pass


def _fit(job: JobConfig, setup: WorkerSetup, callbacks: Optional[list]):
    """Fit the Ray Train ``TorchTrainer``; return its result (with a checkpoint) or raise.

    The workers' process group uses ``resources.collective_backend`` (``auto``: NCCL for workers
    with whole GPUs, gloo on CPUs and for workers sharing a GPU, which NCCL refuses); DeepSpeed
    runs on that group (it creates none when torch.distributed is initialised)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    train, res = job.train, job.resources
    resources = {"CPU": res.cpus_per_worker}
    if res.use_gpu:
        resources["GPU"] = res.gpus_per_worker
    env_vars = {
        "OUTDATED_IGNORE": "1",
        "DS_ACCELERATOR": "cuda" if res.use_gpu else "cpu",
        "OMP_NUM_THREADS": str(res.torch_threads or max(1, int(res.cpus_per_worker))),
    }
    for key in ("RAY_COLOR_PREFIX", "TQDM_DISABLE"):  # what this command's console asks for
        if os.environ.get(key):
            env_vars[key] = os.environ[key]
    callbacks = list(callbacks or [])
    if job.mlflow.enabled and setup.run_id:
        from pipeline.train.epoch_logger import RegisteredEpochLogger
        from pipeline.tasks import TASK_CLASSES

        target = train.target.model_dump() if train.target is not None else None
        callbacks.append(RegisteredEpochLogger(job.mlflow.tracking_uri, setup.run_id, TASK_CLASSES[setup.task_name].metric,
                                               target))
    trainer = _interruptible_trainer()(
        worker_main,
        train_loop_config={"setup": setup},
        torch_config=TorchConfig(backend=res.torch_backend),
        scaling_config=ScalingConfig(num_workers=res.num_workers, use_gpu=res.use_gpu, resources_per_worker=resources,
                                     placement_strategy=res.placement_strategy),
        run_config=RunConfig(
            name=train.run_name,
            storage_path=train.storage_path,
            failure_config=FailureConfig(max_failures=train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=train.checkpoints_to_keep),
            callbacks=callbacks,
            worker_runtime_env={"env_vars": env_vars},
        ),
    )
    log.info("starting %d Ray Train worker(s) (%s each; collectives: %s)", res.num_workers,
             ", ".join(f"{v:g} {k}" for k, v in resources.items()), res.torch_backend)
    result = trainer.fit()
    if getattr(result, "error", None) is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError("training finished without a checkpoint")
    return result


def _interruptible_trainer():
    """``TorchTrainer`` whose ``fit`` answers SIGINT as it does SIGTERM: with
    :class:`runtime.interrupts.Interrupted`, which unwinds the driver so that it says what was
    kept (Ray Train's own SIGINT handler aborts the run, logs the controller's tracebacks, and
    exits with status 0). The controller and its workers are actors of this driver: they end
    with it, when the CLI shuts Ray down; a checkpoint cut short then is never resumed from
    (:func:`pipeline.train.checkpoint.is_complete`)."""
    from ray.train.torch import TorchTrainer

    from runtime import interrupts

    class InterruptibleTrainer(TorchTrainer):
        def _register_sigint_handler(self, controller) -> None:
            interrupts.install(keep=controller)  # the controller lives until the CLI shuts Ray down

    return InterruptibleTrainer


def worker_main(config: dict) -> None:
    """The Ray Train workers' entry: process set-up, then :func:`pipeline.train.worker.worker_loop`.

    * PyG's generated modules stay in memory (:mod:`pipeline.pyg_templates`).
    * DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op
      (``deepspeed_shm_comm``, 30-60 s with a C++ compiler, cached in ``~/.cache/torch_extensions``)
      when it sets up communication. The op serves only ``inference_all_reduce`` (DeepSpeed
      inference); training all-reduces go through ``torch.distributed`` (gloo), the installed
      implementation. So it is marked unavailable and nothing is compiled.
    * Ray Train logs every report with its metrics ("Reporting training result ...") and
      rank 0 prints the same epoch's metrics: Ray's line is dropped (warnings stay).
    """
    from pipeline import pyg_templates

    pyg_templates.install()
    skip_deepspeed_jit_ops()
    try:
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
    worker_loop(config)


def skip_deepspeed_jit_ops() -> None:
    """Mark DeepSpeed's CPU shared-memory communication op unavailable (see :func:`worker_main`)."""
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError, TypeError):
        pass


def _already_finished(job: JobConfig, setup: WorkerSetup, previous, run_key: str, register: bool) -> TrainOutcome:
    """A rerun of a finished run of the same configuration: nothing trains; its registered model
    is found (registered now from its last checkpoint if an earlier attempt stopped before)."""
    from pipeline.registry import tracking

    from pipeline.train import rerun

    train, state = job.train, previous.state
    rerun.prune_unregistered(previous.run_dir, keep=previous.checkpoint)
    task = make_task(setup.task_name, vocab=open_split(setup.shard_dir, "train").vocab, **setup.task_state)
    registered = None
    if job.mlflow.enabled:
        uri = job.mlflow.tracking_uri
        found = tracking.find_training_run(uri, job.mlflow.experiment, run_key)
        client = tracking.client(uri)
        digest = setup.provenance.get("config_hash")
        if found is not None:
            setup.run_id = found.info.run_id
            versions = [v for v in client.search_model_versions(f"run_id='{setup.run_id}'")
                        if (v.tags or {}).get("satp.config_hash") == digest]
            if versions:
                v = max(versions, key=lambda v: int(v.version))
                registered = {"registered_model": v.name, "version": int(v.version),
                              "registered_uri": f"models:/{v.name}/{v.version}", "model_uri": v.source,
                              "champion": None, "reason": "registered when the run finished"}
        if registered is None and register:
            if setup.run_id is None:
                _mlflow_run(job, setup, run_key, "resume")
            best_weights = ckpt.load_best_weights(previous.checkpoint)
            if best_weights is not None:
                log.info("run %s finished before its model was registered: registering it now", train.run_name)
                registered = _log_best_model(job, setup, task, state, best_weights)
        if setup.run_id is not None and (found is None or found.info.status != "FINISHED"):
            tracking.close_run(uri, setup.run_id, "FINISHED")
    history = state.get("history") or []
    log.info("run %s finished already (epoch %d, same configuration): nothing to train", train.run_name,
             previous.epoch)
    return TrainOutcome(
        run_name=train.run_name, storage_path=train.storage_path, checkpoint_path=str(previous.checkpoint),
        metrics=history[-1] if history else {}, history=history, best=state["best"], constant=state.get("constant"),
        metric=task.metric, task=task.name, mlflow_run_id=setup.run_id, tracking_uri=job.mlflow.tracking_uri,
        registered=registered, trained=False, **_stopping_outcome(job, task, state),
    )


def _log_best_model(job: JobConfig, setup: WorkerSetup, task: Task, state: dict, best_weights: dict) -> dict:
    from pipeline.registry import tracking
    from pipeline.registry.versions import CHAMPION, log_and_register, promote

    config = SATConfig.from_dict(setup.model_config)
    model = build_model(config)
    model.load_state_dict(best_weights)
    model.eval()
    metric = task.metric
    best = state["best"]
    metrics = {f"best_val_{metric}": best["val"], f"best_test_{metric}": best["test"], "best_epoch": best["epoch"]}
    if state.get("constant") is not None:
        metrics[f"constant_{metric}"] = state["constant"]
    name = job.mlflow.registered_model or f"sat-{task.name}"
    log.info("logging the best model (epoch %s) to MLflow and registering it as %s", best["epoch"], name)
    _log_attention_plot(job, setup, model, task)
    registered = log_and_register(
        model,
        task=task,
        model_config=config,
        vocab=getattr(task, "vocab", None),
        run_id=setup.run_id,
        tracking_uri=job.mlflow.tracking_uri,
        registered_model=name,
        data_manifest_hash=_manifest_hash(setup.shard_dir),
        metrics={k: v for k, v in metrics.items() if v is not None},
        extra={"run_name": job.train.run_name, "job": job.model_dump(mode="json"), **_input_spec(setup.shard_dir)},
        provenance=state.get("provenance") or setup.provenance,  # the configuration and code that trained them
    )
    # the same rule as sweeps: the alias moves only to a version with a better validation metric
    if registered.get("reason"):  # these weights of this run were registered before
        log.info("%s: %s", name, registered["reason"])
    registered.update(promote(tracking.client(job.mlflow.tracking_uri), name, registered["version"],
                              best["val"], f"best_val_{metric}", task.mode, CHAMPION, f"run {job.train.run_name}"))
    return registered


def _input_spec(shard_dir: str) -> dict:
    """What prediction needs to featurise new inputs (transform, code2 node tables): pipeline.registry.predict."""
    from pipeline.registry.predict import input_spec

    return input_spec(shard_dir)


def _log_attention_plot(job: JobConfig, setup: WorkerSetup, model: torch.nn.Module, task: Task) -> None:
    """[CLS] attention over one test graph's nodes, when the model offers it (best effort)."""
    if not hasattr(model, "cls_attention"):
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from mlflow.tracking import MlflowClient

        test = open_split(setup.shard_dir, "test")
        sizes = np.asarray(test.num_nodes)
        index = int(np.argsort(sizes)[len(sizes) // 2])  # a median-size graph
        from torch_geometric.data import Batch

        batch = Batch.from_data_list([test[index]])
        with torch.no_grad():
            attn = model.cls_attention(batch)
        if isinstance(attn, (list, tuple)):
            attn = attn[-1]
        weights = attn.detach().float().reshape(-1, attn.shape[-1]).mean(0).cpu().numpy() if attn.dim() > 1 else attn.numpy()
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.bar(np.arange(len(weights)), weights)
        ax.set_xlabel("node (DFS order)")
        ax.set_ylabel("[CLS] attention")
        ax.set_title(f"test graph {index} ({len(weights)} nodes)")
        fig.tight_layout()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "cls_attention.png"
            fig.savefig(path, dpi=100)
            MlflowClient(job.mlflow.tracking_uri).log_artifact(setup.run_id, str(path), artifact_path="plots")
        plt.close(fig)
    except Exception as exc:  # interpretability plot: never fail a run over it
        log.info("no [CLS] attention plot: %s", exc)
