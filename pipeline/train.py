"""Distributed training, the driver side: :func:`train_job` checks a job, builds and fits the trainer.

:func:`train_job` is the reusable entry point (the CLI's ``satp train``, the
demo and Tune trials call it): it validates everything it can in the driver
(task, precision, model config, shards: a bad job fails before any worker
starts), opens the MLflow run, fits a Ray Train V2 ``TorchTrainer`` whose
workers run :func:`worker_loop`, and, only when the fit succeeded, logs and
registers the best model.

The workers (:mod:`pipeline.worker`) train, evaluate, checkpoint and report every
epoch; rank 0 logs to MLflow (:mod:`pipeline.tracking`). A rerun with the same run
name and storage path resumes from the last checkpoint, and so does a retry after a
worker died (``FailureConfig``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pipeline import checkpoint as ckpt
from pipeline.config import JobConfig
from pipeline.loader import open_split
from pipeline.tasks import Task, make_task, task_name_for
from pipeline.train_config import default_tracking_uri, runs_dir
from pipeline.worker import WorkerSetup, build_model, worker_loop
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
    registered: Optional[dict[str, Any]]  # see pipeline.registry.log_and_register
    result: Any = None  # the ray.train.Result


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

    for section in ("data", "transform", "shards"):
        if not hasattr(job, section):
            raise ValueError(f"job {job.name!r} has no {section!r} section (preprocessing not configured)")
    return Path(preprocessing.preprocess(job.data, job.transform, job.shards, address=address))


def precheck(job: JobConfig) -> None:
    """Checks that need no data and no Ray (raise ``ValueError`` before anything starts)."""
    from pipeline.engine import resolve_precision

    data_name = getattr(getattr(job, "data", None), "name", None)
    task_name_for(job.train.task, data_name)
    resolve_precision(job.train.precision, job.resources.use_gpu)
    if job.train.warmup_epochs > job.train.epochs:
        raise ValueError(f"train.warmup_epochs ({job.train.warmup_epochs}) exceeds train.epochs ({job.train.epochs})")


def plan(job: JobConfig, shard_dir: str | Path) -> WorkerSetup:
    """Check the job against its data and build the worker setup; raises ``ValueError`` early."""
    from pipeline.engine import resolve_precision

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
) -> TrainOutcome:
    """Train ``job`` on Ray Train (+ DeepSpeed) and register the best model; return the outcome.

    Args:
        job: a validated job (:func:`pipeline.config.load_job`).
        shard_dir: the preprocessed shards; default: run the job's preprocessing
            (:func:`prepare_data`, which reuses finished shards).
        address: Ray cluster address for ``ray.init`` when Ray is not initialised
            (default: a local cluster).
        register: log and register the best model at the end (``mlflow.registered_model``,
            default ``sat-<task>``). Never happens when the fit fails.
        callbacks: Ray Train ``UserCallback``s (e.g. Tune's ``TuneReportCallback``).
        fault: test hook, kill one worker once: ``{"rank", "epoch", "step", "marker"}``.

    A rerun with the same ``train.run_name`` and ``train.storage_path`` resumes
    from the last checkpoint and logs into the same MLflow run.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    job = resolve_job(job)
    precheck(job)
    if not ray.is_initialized():
        if address or os.environ.get("RAY_ADDRESS"):  # a cluster (inside a Ray job: RAY_ADDRESS is set)
            ray.init(address=address)
        else:
            from pipeline.cluster import init_local_ray

            init_local_ray()
    shard_dir = Path(shard_dir) if shard_dir is not None else prepare_data(job, address)
    setup = plan(job, shard_dir)
    setup.fault = fault
    train, res = job.train, job.resources

    run_key = f"{train.storage_path}/{train.run_name}"
    if job.mlflow.enabled:
        from pipeline.tracking import open_run
        import yaml

        config_text = yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)
        params = job.model_dump(mode="json")
        params["model"] = setup.model_config
        params["shard_dir"] = setup.shard_dir
        setup.run_id = open_run(job.mlflow.tracking_uri, job.mlflow.experiment, run_key, train.run_name, params, config_text)

    resources = {"CPU": res.cpus_per_worker}
    if res.use_gpu:
        resources["GPU"] = res.gpus_per_worker
    env_vars = {
        "OUTDATED_IGNORE": "1",
        "DS_ACCELERATOR": "cuda" if res.use_gpu else "cpu",
        "OMP_NUM_THREADS": str(res.torch_threads or max(1, int(res.cpus_per_worker))),
    }
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={"setup": setup},
        scaling_config=ScalingConfig(num_workers=res.num_workers, use_gpu=res.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=train.run_name,
            storage_path=train.storage_path,
            failure_config=FailureConfig(max_failures=train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=train.checkpoints_to_keep),
            callbacks=callbacks,
            worker_runtime_env={"env_vars": env_vars},
        ),
    )
    try:
        result = trainer.fit()
        if getattr(result, "error", None) is not None:
            raise result.error
        if result.checkpoint is None:
            raise RuntimeError("training finished without a checkpoint")
        with result.checkpoint.as_directory() as directory:
            state = ckpt.load_state(directory)
            best_weights = ckpt.load_best_weights(directory)
            checkpoint_path = str(result.checkpoint.path)
        if state["epoch"] != train.epochs - 1:
            raise RuntimeError(f"training stopped after epoch {state['epoch']} of {train.epochs}")
        registered = None
        task = make_task(setup.task_name, vocab=open_split(setup.shard_dir, "train").vocab, **setup.task_state)
        if job.mlflow.enabled and register and best_weights is not None:
            registered = _log_best_model(job, setup, task, state, best_weights)
    except BaseException:
        if job.mlflow.enabled and setup.run_id:
            try:
                from pipeline.tracking import close_run

                close_run(job.mlflow.tracking_uri, setup.run_id, "FAILED")
            except Exception:
                pass
        raise
    if job.mlflow.enabled and setup.run_id:
        from pipeline.tracking import close_run

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
    )


def _log_best_model(job: JobConfig, setup: WorkerSetup, task: Task, state: dict, best_weights: dict) -> dict:
    from pipeline import tracking
    from pipeline.registry import CHAMPION, log_and_register, promote

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
    )
    # the same rule as sweeps: the alias moves only to a version with a better validation metric
    registered.update(promote(tracking.client(job.mlflow.tracking_uri), name, registered["version"],
                              best["val"], f"best_val_{metric}", task.mode, CHAMPION, f"run {job.train.run_name}"))
    return registered


def _input_spec(shard_dir: str) -> dict:
    """What prediction needs to featurise new inputs (transform, code2 node tables): pipeline.predict."""
    from pipeline.predict import input_spec

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
