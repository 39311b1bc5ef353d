"""The Ray Train worker: ``train_loop_per_worker`` of the TorchTrainer that :func:`pipeline.train.driver.train_job` fits.

Each worker (one DeepSpeed rank) builds its parts once (:class:`WorkerRun`): data loaders over its
share of the node-budget batches (:mod:`pipeline.train.loader`, :mod:`pipeline.train.batching`), padded
to fixed capacities when ``train.step`` asks for them (:mod:`pipeline.train.capacity`), the model and
DeepSpeed engine (:mod:`pipeline.train.engine`; compiled for ``compiled`` and ``captured`` steps, its
caches under the storage path), the step (:mod:`pipeline.train.step`), the loop state restored from
Ray Train's last checkpoint, and on rank 0 the MLflow system metrics (:mod:`pipeline.registry.tracking`).
Its first step ends the run's start-up, which rank 0 logs phase by phase (:mod:`pipeline.train.startup`)
and reports with the first epoch. Then, per epoch:

* :meth:`WorkerRun.train_epoch`: the steps (:class:`pipeline.train.step.TrainStep`), the loss
  accumulated on the device (:class:`pipeline.train.metrics.EpochMeter`), a sample of the batches'
  predictions kept for the train metric (decoded at the end of the epoch, never per step);
* :meth:`WorkerRun.evaluate_epoch`: validation and test predictions, gathered to rank 0, OGB's
  metric, the best epoch by validation;
* :meth:`WorkerRun.report`: the run's wall-clock and steps so far, whether it stops here (a
  quality target reached or a plateau, :mod:`pipeline.train.stopping`, decided on rank 0 for all),
  a checkpoint (:mod:`pipeline.train.checkpoint`) and the metrics through ``ray.train.report`` (every
  rank, once per epoch); Ray Train's controller logs the epoch to MLflow once it has registered
  the checkpoint (:mod:`pipeline.train.epoch_logger`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from pipeline.train import checkpoint as ckpt
from pipeline.train import startup, stopping
from pipeline.train.batching import EpochStream, NodeBudgetSampler, subset_indices
from pipeline.config import JobConfig
from pipeline.train.capacity import describe, run_capacities
from pipeline.train.engine import build_engine, clips_outside_deepspeed, current_lr, resolve_precision
from pipeline.train.loader import BatchCollator, make_loader, open_split
from pipeline.train.metrics import EpochMeter, broadcast_from_rank_zero, concat_gathered, gather_objects
from pipeline.train.precise_bn import StatisticsBatches, batchnorm_layers, recompute_batchnorm_stats
from pipeline.tasks import make_task
from pipeline.train.step import TrainStep, compiles_model, evaluate
from sat.config import SATConfig
from sat.padding import padding_of

log = logging.getLogger(__name__)

TRAIN_SAMPLE_FOR_BASELINE = 20000  # train targets kept for the best constant predictor
TRAIN_METRIC_BATCHES = 32  # about this many batches per epoch feed the train metric
PRECISE_BN_SEED_OFFSET = 104729  # the statistics batches' seed: train.seed + this


def build_model(config: SATConfig) -> torch.nn.Module:
    import sat

    from pipeline import pyg_templates

    pyg_templates.install()  # generated PyG modules stay in memory in every process that builds a model

    return sat.SAT(config)


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
    provenance: Optional[dict] = None  # config hash + git commits, recorded in every checkpoint (pipeline.train.rerun)
    resume_from: Optional[str] = None  # a complete checkpoint newer than Ray's record (pipeline.train.rerun)
    startup: Optional[dict] = None  # the driver's start-up events, wall-clock (pipeline.train.startup)
    process_env: Optional[dict] = None  # environment variables the worker sets when it starts (threads, console)
    damaged: Optional[dict] = None  # checkpoints the driver named damaged (pipeline.train.rerun.named_damage)


def worker_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (``config = {"setup": WorkerSetup}``)."""
    run = WorkerRun(config["setup"])
    train = run.job.train
    try:
        for epoch in range(run.state["epoch"] + 1, train.epochs):
            started = time.perf_counter()
            metrics = run.train_epoch(epoch)
            if (epoch + 1) % train.eval_every == 0 or epoch == train.epochs - 1:
                metrics.update(run.evaluate_epoch(epoch))
            stop = run.report(epoch, metrics, time.perf_counter() - started)
            if run.setup.fault and "signal" in run.setup.fault:
                _maybe_signal(run.setup.fault, run.rank, epoch)
            if stop:
                break
    finally:
        run.close()


def split_sampler(job: JobConfig, dataset, shuffle: bool, rank: int = 0, world: int = 1,
                  seed: Optional[int] = None) -> NodeBudgetSampler:
    """The node-budget batches of one rank over a split: shuffled per epoch for training (by
    ``train.seed``, or ``seed``), sorted by size for evaluation (``train.eval_node_budget``, default
    twice the training budget)."""
    train = job.train
    return NodeBudgetSampler(
        np.asarray(dataset.num_nodes),
        train.node_budget if shuffle else (train.eval_node_budget or 2 * train.node_budget),
        rank=rank,
        world_size=world,
        shuffle=shuffle,
        seed=train.seed if seed is None else seed,
        bucket_size=train.bucket_size,
        max_graphs=train.max_graphs_per_batch,
        # evaluation subsets do not depend on train.seed: runs of several seeds score the same graphs
        indices=(subset_indices(len(dataset), train.train_subset, train.seed) if shuffle
                 else subset_indices(len(dataset), train.eval_subset, job.data.seed)),
    )


def statistics_batches(job: JobConfig, dataset, rank: int = 0, world: int = 1) -> StatisticsBatches:
    """The training batches over which BatchNorm's statistics are recomputed before an evaluation
    (``train.precise_bn_batches`` of them, shuffled with a seed apart from the training order's)."""
    sampler = split_sampler(job, dataset, shuffle=True, rank=rank, world=world,
                            seed=job.train.seed + PRECISE_BN_SEED_OFFSET)
    return StatisticsBatches(sampler, job.train.precise_bn_batches)


def train_loader(job: JobConfig, dataset, sampler: NodeBudgetSampler, collator: BatchCollator, pin: bool):
    """The training DataLoader over ``sampler``'s epochs one after the other (:class:`EpochStream`): one
    iterator serves the whole run, starting at the sampler's epoch, ``len(sampler)`` batches per epoch."""
    return make_loader(dataset, EpochStream(sampler), collator, job.train.loader_workers, pin)


class WorkerRun:
    """The parts of one worker's training run; see the module docstring."""

    def __init__(self, setup: WorkerSetup) -> None:
        import ray.train

        self.setup = setup
        self.job = job = setup.job
        train = job.train
        self.startup = dict(setup.startup or {}, worker_process=startup.process_started(), worker=startup.now())
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        use_gpu = job.resources.use_gpu
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")
        torch.set_num_threads(job.resources.torch_threads or max(1, int(job.resources.cpus_per_worker)))
        if use_gpu:
            import ray.train.torch as rtt

            self.device = rtt.get_device()
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

        train_ds = open_split(setup.shard_dir, "train")
        self.task = make_task(setup.task_name, vocab=train_ds.vocab, **setup.task_state)
        model_config = SATConfig.from_dict(setup.model_config)
        pin = self.device.type == "cuda"
        self.train_sampler = split_sampler(job, train_ds, shuffle=True, rank=self.rank, world=self.world)
        eval_splits = {s: open_split(setup.shard_dir, s) for s in ("valid", "test")}
        eval_samplers = {s: split_sampler(job, ds, shuffle=False, rank=self.rank, world=self.world)
                         for s, ds in eval_splits.items()}
        # fixed batch capacities (train.step other than eager): what every padded batch's shapes are
        self.capacities, over = run_capacities(job, model_config, (train_ds, self.train_sampler),
                                               [(eval_splits[s], eval_samplers[s]) for s in eval_splits])
        if self.rank == 0 and self.capacities["train"] is not None:
            log.info("batch capacity (train.step %s): training %s (%.1f%% of the first epoch's batches over it run "
                     "eagerly); evaluation %s", train.step, describe(self.capacities["train"]), 100 * over,
                     describe(self.capacities["eval"]))
        collator, eval_collator = (BatchCollator(model_config, capacity=self.capacities[kind],
                                                 node_targets=self.task.node_level) for kind in ("train", "eval"))
        self.train_loader = train_loader(job, train_ds, self.train_sampler, collator, pin)
        self._train_batches: Optional[Iterator] = None  # made by the first epoch trained, kept for the run
        self.eval_loaders = {split: make_loader(eval_splits[split], eval_samplers[split], eval_collator,
                                                train.loader_workers, pin) for split in eval_splits}

        torch.manual_seed(train.seed)
        model = build_model(model_config)
        self.statistics_batches: Optional[StatisticsBatches] = None  # train.precise_bn_batches
        if train.precise_bn_batches and batchnorm_layers(model):
            self.statistics_batches = statistics_batches(job, train_ds, self.rank, self.world)
            self.statistics_loader = make_loader(train_ds, self.statistics_batches, collator, train.loader_workers, pin)
        self.startup["loaders"] = startup.now()
        self.precision = resolve_precision(setup.precision, use_gpu)  # "auto" is resolved where the GPU is
        if compiles_model(train.step):
            keep_compile_caches(train.storage_path)
        self.engine = build_engine(model, train, self.precision, len(self.train_sampler), self.world,
                                   compile_model=compiles_model(train.step))
        self.step = TrainStep(self.engine, self.task, train.grad_clip, clips_outside_deepspeed(train, self.precision),
                              mode=train.step, device=self.device)

        self.state: dict[str, Any] = {
            "epoch": -1,
            "steps": 0,  # optimizer steps so far
            "elapsed_s": 0.0,  # wall seconds of training and evaluation so far (pipeline.train.stopping)
            "stopped": None,  # why the run stopped before train.epochs (pipeline.train.stopping)
            "sampler": self.train_sampler.state_dict(),
            "best": {"epoch": -1, "val": None, "test": None},
            "history": [],
            "constant": None,
            "mlflow_run_id": setup.run_id,
            "task": setup.task_state | {"name": setup.task_name},
            "model_config": setup.model_config,
            "provenance": setup.provenance,
        }
        self.best_weights: Optional[dict] = None
        self.baseline_targets: list = []
        self._restore()

        self.logger, self.segment = None, 0
        if self.rank == 0 and setup.run_id and setup.tracking_uri:
            from pipeline.registry.tracking import RankZeroLogger
            from pipeline.train.rerun import named_damage

            self.logger = RankZeroLogger(setup.tracking_uri, setup.run_id, job.mlflow.log_system_metrics)
            damage = "; ".join(f"{where}: {problem}" for problem, where in named_damage().items())
            self.segment = self.logger.resume(self.state["history"], self.state["epoch"],
                                              damage or "the checkpoints after it are missing")
            self.logger.client.set_tag(setup.run_id, "satp.precision", self.precision)
            self.logger.client.set_tag(setup.run_id, "satp.world_size", str(self.world))
            self.logger.client.set_tag(setup.run_id, "satp.step", train.step)
            for kind, capacity in self.capacities.items():
                if capacity is not None:
                    self.logger.client.set_tag(setup.run_id, f"satp.capacity.{kind}", json.dumps(capacity.to_dict()))
        self.startup["engine"] = startup.now()

    def _restore(self) -> None:
        """Restore the newest of Ray Train's checkpoint (the last one it registered, in this fit or
        the run before) and the driver's ``resume_from`` (a complete checkpoint on storage that an
        interrupted run wrote but Ray never registered: :mod:`pipeline.train.rerun`), verified first:
        a damaged one (cut short, changed since it was written) is named in one warning line and the
        run's newest intact checkpoint is restored instead (:func:`pipeline.train.rerun.resume_point`);
        with none intact, the run starts from its first epoch. Rank 0 verifies and decides for all."""
        import ray.train

        from pipeline.train import rerun

        restored = ray.train.get_checkpoint()  # in the run's storage (satp's storage paths are file systems)
        candidates = [Path(p) for p in (restored.path if restored is not None else None, self.setup.resume_from) if p]
        if not candidates:
            return
        run_dir = Path(ray.train.get_context().get_storage().experiment_fs_path)
        chosen = rerun.resume_point(candidates, run_dir, self.setup.damaged) if self.rank == 0 else None
        directory = broadcast_from_rank_zero(str(chosen) if chosen is not None else None)
        if directory is None:
            return
        self.state = ckpt.restore(directory, self.engine)
        if self.rank == 0:
            self.best_weights = ckpt.load_best_weights(directory)
        self.train_sampler.load_state_dict(self.state["sampler"])
        log.info("rank %d resumed after epoch %d (%s)", self.rank, self.state["epoch"], directory)

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Train one epoch; returns its metrics (train metric on rank 0 only)."""
        train, task, device = self.job.train, self.task, self.device
        self.train_sampler.set_epoch(epoch)
        self.engine.train()
        steps = len(self.train_sampler)
        sample_every = max(1, math.ceil(steps / TRAIN_METRIC_BATCHES))
        meter = EpochMeter(device)
        sampled_predictions: list[torch.Tensor] = []
        sampled_targets: list = []
        first_epoch = self._train_batches is None
        if first_epoch:
            self._train_batches = iter(self.train_loader)  # starts at this epoch (set above)
        batches = self._train_batches
        self.step.overflow = 0
        for step in range(steps):
            waited = time.perf_counter()
            cpu_batch = next(batches)
            meter.data_wait += time.perf_counter() - waited
            if first_epoch and step == 0:
                self.startup["first_batch"] = startup.now()
            if self.setup.fault and "signal" not in self.setup.fault:
                _maybe_fail(self.setup.fault, self.rank, epoch, step, meter.seconds)
            size, sampled = task.batch_size(cpu_batch), step % sample_every == 0
            if sampled:
                sampled_targets.extend(task.targets(cpu_batch))
            out, loss = self.step(cpu_batch)
            padding = padding_of(cpu_batch)
            meter.add(loss, size, padding.graphs if padding is not None else int(cpu_batch.num_graphs))
            if sampled:
                sampled_predictions.append(task.real_rows(task.predictions(out), cpu_batch))
            if first_epoch and step == 0:
                self._first_step_done()
            if self.rank == 0 and (step + 1) % train.log_every_steps == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step + 1, steps, float(loss))
        self.state["steps"] = self.state.get("steps", 0) + steps
        metrics: dict[str, Any] = {"epoch": epoch, **meter.reduce(device), "lr": current_lr(self.engine),
                                   "steps": self.state["steps"], "overflow_batches": self.step.overflow}
        if first_epoch and self.rank == 0:
            metrics.update(startup.metrics(self.startup))
        predictions = task.decode(torch.cat(sampled_predictions).cpu())
        if not self.baseline_targets and self.state["constant"] is None:
            self.baseline_targets = sampled_targets[:TRAIN_SAMPLE_FOR_BASELINE]
        gathered = gather_objects((predictions, sampled_targets))
        if self.rank == 0:
            metrics[f"train_{task.metric}"] = task.score(*concat_gathered(gathered))
        return metrics

    def _first_step_done(self) -> None:
        """Stamp the first step's end (its kernels finished) and log the start-up (rank 0)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup["first_step"] = startup.now()
        if self.rank == 0:
            log.info("%s", startup.describe(self.startup))

    def evaluate_epoch(self, epoch: int) -> dict[str, Any]:
        """Validation and test metrics (rank 0), and the best epoch by validation.

        With ``train.precise_bn_batches``, the validation metric under BatchNorm's moving averages
        is kept as ``val_<metric>_running_bn`` before the statistics are recomputed
        (:mod:`pipeline.train.precise_bn`), with how far the moving averages were from the new
        statistics (``bn_var_ratio``, ``bn_worst_layer_var_ratio``, ``bn_mean_shift``); the metrics,
        the best epoch and the weights kept use the recomputed ones."""
        task, metric, forward = self.task, self.task.metric, self.step.forward
        started = time.perf_counter()
        self.step.overflow = 0
        running_bn = None
        if self.statistics_batches is not None:
            running_bn = gather_objects(evaluate(self.engine, task, self.eval_loaders["valid"], self.device, forward))
            self.statistics_batches.set_epoch(epoch)
            recomputed = recompute_batchnorm_stats(self.engine.module, self.statistics_loader, forward)
        results = {split: gather_objects(evaluate(self.engine, task, loader, self.device, forward))
                   for split, loader in self.eval_loaders.items()}
        metrics: dict[str, Any] = {"eval_seconds": time.perf_counter() - started,
                                   "eval_overflow_batches": self.step.overflow}
        if self.rank != 0:
            return metrics
        if running_bn is not None:
            metrics[f"val_{metric}_running_bn"] = task.score(*concat_gathered(running_bn))
            if recomputed.shift is not None:
                metrics.update(recomputed.shift.metrics())
        val_score = task.score(*concat_gathered(results["valid"]))
        test_preds, test_targets = concat_gathered(results["test"])
        metrics[f"val_{metric}"] = val_score
        metrics[f"test_{metric}"] = task.score(test_preds, test_targets)
        if self.state["constant"] is None:
            self.state["constant"] = task.constant_baseline(self.baseline_targets, test_targets)
        best = self.state["best"]
        if best["val"] is None or (val_score > best["val"] if task.mode == "max" else val_score < best["val"]):
            self.state["best"] = {"epoch": epoch, "val": val_score, "test": metrics[f"test_{metric}"]}
            self.best_weights = {k: v.detach().float().cpu().clone() for k, v in self.engine.module.state_dict().items()}
        return metrics

    def report(self, epoch: int, metrics: dict[str, Any], seconds: float) -> bool:
        """Checkpoint and report the epoch (every rank); return whether the run stops here.
        MLflow gets the epoch from Ray Train's controller once the checkpoint is registered
        (:mod:`pipeline.train.epoch_logger`)."""
        import ray.train

        metric, state, task = self.task.metric, self.state, self.task
        state["elapsed_s"] = state.get("elapsed_s", 0.0) + seconds
        metrics["elapsed_s"] = state["elapsed_s"]
        stopped = None
        if self.logger is not None:  # which trajectory the epoch's values belong to (tracking.RankZeroLogger.resume)
            metrics["segment"] = self.segment
        if self.rank == 0:
            metrics[f"constant_{metric}"] = state["constant"]
            metrics[f"best_val_{metric}"] = state["best"]["val"]
            metrics[f"best_test_{metric}"] = state["best"]["test"]
            metrics["best_epoch"] = state["best"]["epoch"]
        metrics = {k: v for k, v in metrics.items() if v is not None}
        if self.rank == 0:
            state["history"].append(metrics)
            reached = stopping.time_to_target(state["history"], self.job.train.target, task.mode)
            if reached is not None and reached["epoch"] == epoch:
                metrics.update({k: v for k, v in reached.items() if k != "epoch" and v is not None})
            stopped = stopping.stop_reason(state["history"], self.job.train, metric, task.mode)
        # every rank leaves the loop together: rank 0 alone holds the validation metrics
        state["stopped"] = broadcast_from_rank_zero(stopped)
        state["epoch"] = epoch
        state["world_size"] = self.world
        state["provenance"] = self.setup.provenance  # a resumed run may add a git commit
        state["sampler"] = self.train_sampler.state_dict()
        # written locally, then into the run's storage by satp (a full disk ends the run: ckpt.persist),
        # then reported to Ray Train where it lies
        storage = ray.train.get_context().get_storage()
        with tempfile.TemporaryDirectory(prefix="satp-ckpt-") as directory:
            ckpt.save(directory, self.engine, state, self.best_weights, self.rank)
            name = ckpt.persist(directory, storage.experiment_fs_path, self.rank, epoch)
        checkpoint = ray.train.Checkpoint(path=str(Path(storage.experiment_fs_path) / name),
                                          filesystem=storage.storage_filesystem)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
        if self.rank == 0:
            log.info("epoch %d: %s", epoch, {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
            if state["stopped"]:
                log.info("stopping after epoch %d of %d: %s", epoch, self.job.train.epochs, state["stopped"])
        return state["stopped"] is not None

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def _maybe_fail(fault: dict, rank: int, epoch: int, step: int, seconds: float) -> None:
    """Test hook: kill this worker once, at step ``step`` of epoch ``epoch``, no sooner than
    ``seconds`` into the epoch (``fault = {rank, epoch, step, seconds, marker}``).

    Ray Train registers a reported checkpoint when its controller next polls the workers
    (every 2 s); a worker group that dies sooner after a report resumes from the checkpoint
    before. Waiting out ``seconds`` makes the kill land after the registration, however fast
    the epoch runs."""
    if rank != fault.get("rank", 0) or epoch != fault.get("epoch", 0) or step < fault.get("step", 0):
        return
    marker = Path(fault["marker"])
    if marker.exists():
        return
    time.sleep(max(0.0, fault.get("seconds", 0.0) - seconds))
    marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _maybe_signal(fault: dict, rank: int, epoch: int) -> None:
    """Test hook: once the checkpoint of epoch ``epoch`` is on storage (``ray.train.report`` has
    returned), send ``signal`` to the driver process ``pid``, once (``marker``), then wait for the
    abort: the interrupt lands after the upload, and before or while Ray registers it
    (``fault = {signal, pid, epoch, marker}``)."""
    if rank != 0 or epoch != fault.get("epoch", 0):
        return
    marker = Path(fault["marker"])
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os.kill(int(fault["pid"]), getattr(signal, fault["signal"]))
    time.sleep(120)


def keep_compile_caches(storage_path: str) -> None:
    """Point Inductor's and Triton's caches at ``<storage_path>/.satp-compile-cache``, so that a
    rerun or a resumed run (any run stored there: the caches are keyed by what they compiled) loads
    the compiled kernels instead of compiling again. Storage behind a URI (``s3://...``) keeps
    PyTorch's default caches (local to the node)."""
    if "://" in storage_path:
        return
    root = Path(storage_path) / ".satp-compile-cache"
    for variable, name in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[variable] = str(root / name)
