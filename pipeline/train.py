"""Distributed training: the worker loop and :func:`train_job`, which builds and fits the trainer.

:func:`train_job` is the reusable entry point (the CLI's ``satp train``, the
demo and Tune trials call it): it validates everything it can in the driver
(task, precision, model config, shards: a bad job fails before any worker
starts), opens the MLflow run, fits a Ray Train V2 ``TorchTrainer`` whose
workers run :func:`worker_loop`, and, only when the fit succeeded, logs and
registers the best model.

Each worker: reads its share of the shards through the preprocessing reader,
builds :class:`sat.SAT` from the job's model config (completed by the task) and
a DeepSpeed engine (:mod:`pipeline.engine`), then per epoch trains on its
node-budget batches (:mod:`pipeline.batching`), evaluates its share of the
validation and test batches, gathers the predictions, and reports metrics and a
checkpoint (:mod:`pipeline.checkpoint`) with ``ray.train.report`` (every rank,
once per epoch). Rank 0 logs to MLflow (:mod:`pipeline.tracking`). A rerun with
the same run name and storage path resumes from the last checkpoint, and so
does a retry after a worker died (``FailureConfig``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pipeline import checkpoint as ckpt
from pipeline.batching import NodeBudgetSampler, subset_indices
from pipeline.config import JobConfig
from pipeline.tasks import Task, make_task, task_name_for
from pipeline.train_config import default_tracking_uri, runs_dir
from sat.config import SATConfig

log = logging.getLogger(__name__)

TRAIN_SAMPLE_FOR_BASELINE = 20000


# ----------------------------------------------------------------------------- helpers
def collate(items: list) -> Any:
    from torch_geometric.data import Batch

    return Batch.from_data_list(items)


def open_split(shard_dir: str | Path, split: str):
    from preprocessing.reader import ShardDataset

    return ShardDataset(shard_dir, split)


def build_model(config: SATConfig) -> torch.nn.Module:
    import sat

    return sat.SAT(config)


def _gather(obj: Any) -> list:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _sum_across(values: list[float], device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _to(batch: Any, device: torch.device) -> Any:
    return batch.to(device) if device.type != "cpu" else batch


def _unzip(parts: list[tuple[list, list]]) -> tuple[list, list]:
    preds, targets = [], []
    for p, t in parts:
        preds.extend(p)
        targets.extend(t)
    return preds, targets


@dataclasses.dataclass
class WorkerSetup:
    """Everything a worker needs, resolved in the driver (plain, picklable)."""

    job: JobConfig
    shard_dir: str
    model_config: dict
    task_name: str
    task_state: dict
    precision: str
    run_id: Optional[str]
    tracking_uri: Optional[str]
    fault: Optional[dict] = None


# ----------------------------------------------------------------------------- worker
def evaluate(engine, task: Task, dataset, sampler: NodeBudgetSampler, device) -> tuple[list, list]:
    """This rank's (predictions, targets) over its share of the split's batches."""
    engine.eval()
    preds: list = []
    targets: list = []
    with torch.no_grad():
        for idx in sampler:
            batch = _to(collate([dataset[i] for i in idx]), device)
            out = engine(batch)
            preds.extend(task.predict(out))
            targets.extend(task.targets(batch))
    return preds, targets


def worker_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (``config = {"setup": WorkerSetup}``)."""
    import ray.train

    setup: WorkerSetup = config["setup"]
    job, train = setup.job, setup.job.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    use_gpu = job.resources.use_gpu
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")
    torch.set_num_threads(job.resources.torch_threads or max(1, int(job.resources.cpus_per_worker)))
    if use_gpu:
        import ray.train.torch as rtt

        device = rtt.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    train_ds = open_split(setup.shard_dir, "train")
    task = make_task(setup.task_name, vocab=train_ds.vocab, **setup.task_state)
    val_ds, test_ds = open_split(setup.shard_dir, "valid"), open_split(setup.shard_dir, "test")

    def sampler(ds, shuffle: bool, subset: Optional[int]) -> NodeBudgetSampler:
        return NodeBudgetSampler(
            np.asarray(ds.num_nodes),
            train.node_budget if shuffle else (train.eval_node_budget or 2 * train.node_budget),
            rank=rank,
            world_size=world,
            shuffle=shuffle,
            seed=train.seed,
            bucket_size=train.bucket_size,
            max_graphs=train.max_graphs_per_batch,
            indices=subset_indices(len(ds), subset, train.seed),
        )

    train_sampler = sampler(train_ds, True, train.train_subset)
    val_sampler = sampler(val_ds, False, train.eval_subset)
    test_sampler = sampler(test_ds, False, train.eval_subset)

    torch.manual_seed(train.seed)
    model = build_model(SATConfig.from_dict(setup.model_config))
    from pipeline.engine import build_engine, current_lr

    from pipeline.engine import resolve_precision

    precision = resolve_precision(setup.precision, use_gpu)  # "auto" is resolved where the GPU is
    engine = build_engine(model, train, precision, len(train_sampler), world)

    state: dict[str, Any] = {
        "epoch": -1,
        "sampler": train_sampler.state_dict(),
        "best": {"epoch": -1, "val": None, "test": None},
        "history": [],
        "constant": None,
        "mlflow_run_id": setup.run_id,
        "task": setup.task_state | {"name": setup.task_name},
        "model_config": setup.model_config,
    }
    best_weights: Optional[dict] = None
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as directory:
            state = ckpt.restore(directory, engine)
            if rank == 0:
                best_weights = ckpt.load_best_weights(directory)
        train_sampler.load_state_dict(state["sampler"])
        log.info("rank %d resumed after epoch %d", rank, state["epoch"])

    logger = None
    if rank == 0 and setup.run_id and setup.tracking_uri:
        from pipeline.tracking import EpochLogger

        logger = EpochLogger(setup.tracking_uri, setup.run_id, job.mlflow.log_system_metrics)
        logger.catch_up(state["history"])
        logger.client.set_tag(setup.run_id, "satp.precision", precision)
        logger.client.set_tag(setup.run_id, "satp.world_size", str(world))

    from torch.utils.data import DataLoader

    loader = DataLoader(
        train_ds,
        batch_sampler=train_sampler,
        collate_fn=collate,
        num_workers=train.loader_workers,
        persistent_workers=train.loader_workers > 0,
    )
    metric = task.metric
    baseline_targets: list = []
    try:
        for epoch in range(state["epoch"] + 1, train.epochs):
            train_sampler.set_epoch(epoch)
            engine.train()
            t0 = time.perf_counter()
            wait = step_time = 0.0
            loss_sum, n_graphs, n_steps = 0.0, 0, 0
            train_preds: list = []
            train_targets: list = []
            it = iter(loader)
            step = 0
            while True:
                t_fetch = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                batch = _to(batch, device)
                t_step = time.perf_counter()
                wait += t_step - t_fetch
                if setup.fault and _should_fail(setup.fault, rank, epoch, step, time.perf_counter() - t0):
                    os.kill(os.getpid(), signal.SIGKILL)
                out = engine(batch)
                loss = task.loss(out, batch)
                engine.backward(loss)
                engine.step()
                loss_sum += loss.item() * batch.num_graphs
                n_graphs += batch.num_graphs
                n_steps += 1
                train_preds.extend(task.predict(out.detach()))
                train_targets.extend(task.targets(batch))
                step_time += time.perf_counter() - t_step
                step += 1
                if rank == 0 and step % train.log_every_steps == 0:
                    log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_sampler), loss.item())
            train_seconds = time.perf_counter() - t0
            if not baseline_targets and state["constant"] is None:
                baseline_targets = train_targets[:TRAIN_SAMPLE_FOR_BASELINE]
            loss_total, graphs_total, wait_total, step_total = _sum_across(
                [loss_sum, n_graphs, wait, step_time], device
            )
            gathered = _gather((train_preds, train_targets))
            metrics: dict[str, Any] = {
                "epoch": epoch,
                "train_loss": loss_total / max(graphs_total, 1),
                "lr": current_lr(engine),
                "graphs_per_s": graphs_total / max(train_seconds, 1e-9),
                "data_wait_frac": wait_total / max(wait_total + step_total, 1e-9),
                "epoch_seconds": train_seconds,
                f"train_{metric}": task.score(*_unzip(gathered)) if rank == 0 else None,
            }
            if (epoch + 1) % train.eval_every == 0 or epoch == train.epochs - 1:
                t_eval = time.perf_counter()
                val = _gather(evaluate(engine, task, val_ds, val_sampler, device))
                test = _gather(evaluate(engine, task, test_ds, test_sampler, device))
                metrics["eval_seconds"] = time.perf_counter() - t_eval
                if rank == 0:
                    val_score = task.score(*_unzip(val))
                    test_preds, test_targets = _unzip(test)
                    metrics[f"val_{metric}"] = val_score
                    metrics[f"test_{metric}"] = task.score(test_preds, test_targets)
                    if state["constant"] is None:
                        state["constant"] = task.constant_baseline(baseline_targets, test_targets)
                    best = state["best"]
                    better = best["val"] is None or (
                        val_score > best["val"] if task.mode == "max" else val_score < best["val"]
                    )
                    if better:
                        state["best"] = {"epoch": epoch, "val": val_score, "test": metrics[f"test_{metric}"]}
                        best_weights = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
            if rank == 0:
                metrics[f"constant_{metric}"] = state["constant"]
                metrics[f"best_val_{metric}"] = state["best"]["val"]
                metrics[f"best_test_{metric}"] = state["best"]["test"]
                metrics["best_epoch"] = state["best"]["epoch"]
            metrics = {k: v for k, v in metrics.items() if v is not None}
            state["epoch"] = epoch
            state["sampler"] = train_sampler.state_dict()
            if rank == 0:
                state["history"].append(metrics)
            with tempfile.TemporaryDirectory(prefix="satp-ckpt-") as directory:
                ckpt.save(directory, engine, state, best_weights, rank)
                has_files = any(p.is_file() for p in Path(directory).rglob("*"))
                checkpoint = ray.train.Checkpoint.from_directory(directory) if has_files else None
                ray.train.report(metrics, checkpoint=checkpoint)
            if logger is not None:
                logger.log_metrics(metrics, step=epoch)
                logger.log_curves(state["history"], metric)
            if rank == 0:
                log.info("epoch %d: %s", epoch, {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
    finally:
        if logger is not None:
            logger.close()


def _should_fail(fault: dict, rank: int, epoch: int, step: int, seconds: float) -> bool:
    """Test hook: kill this worker once, at step ``step`` of epoch ``epoch``, no sooner than
    ``seconds`` into the epoch (``fault = {rank, epoch, step, seconds, marker}``).

    Ray Train registers a reported checkpoint when its controller next polls the workers
    (every 2 s); a worker group that dies sooner after a report resumes from the checkpoint
    before. Waiting out ``seconds`` makes the kill land after the registration, however fast
    the epoch runs."""
    if rank != fault.get("rank", 0) or epoch != fault.get("epoch", 0) or step < fault.get("step", 0):
        return False
    marker = Path(fault["marker"])
    if marker.exists():
        return False
    time.sleep(max(0.0, fault.get("seconds", 0.0) - seconds))
    marker.write_text(str(os.getpid()))
    return True


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
        batch = collate([test[index]])
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
