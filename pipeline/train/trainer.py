"""One job's training on one rank: :class:`Trainer`, built and stepped with or without Ray.

``Trainer(setup, context)`` builds its loaders, DeepSpeed engine and step once, restores the newest
intact checkpoint; :meth:`Trainer.fit` then runs, per epoch, :meth:`Trainer.train_epoch`,
:meth:`Trainer.evaluate_epoch` and :meth:`Trainer.report` (stopping rules, checkpoint, metrics).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Callable, Iterator, Optional

import torch

from pipeline.train import checkpoint as ckpt
from pipeline.train import elastic, faults, startup, stopping
from pipeline.train.batching import split_sampler
from pipeline.train.capacity import describe, run_capacities
from pipeline.train.context import TrainContext
from pipeline.train.engine import build_engine, build_model, clips_outside_deepspeed, keep_compile_caches, resolve_precision
from pipeline.train.global_batch import GlobalBatches, Position, RankStream
from pipeline.train.loader import BatchCollator, make_loader, open_split
from pipeline.train.metrics import EpochMeter, broadcast_from_rank_zero, concat_gathered, gather_objects
from pipeline.train.precise_bn import StatisticsBatches, batchnorm_layers, recompute_batchnorm_stats, statistics_batches
from pipeline.train.reporting import Reports
from pipeline.tasks import make_task
from pipeline.train.step import TrainStep, compiles_model, evaluate
from pipeline.train.worker_setup import WorkerSetup
from runtime import fork_server
from sat.config import SATConfig
from sat.padding import padding_of

log = logging.getLogger(__name__)

TRAIN_SAMPLE_FOR_BASELINE = 20000  # train targets kept for the best constant predictor
TRAIN_METRIC_BATCHES = 32  # about this many batches per epoch feed the train metric


class Trainer:
    """One rank's training run of a job; see the module docstring. ``on_step(trainer, global_step)``:
    called after every optimizer step (benchmarks time steps with it, tests stop at one)."""

    def __init__(self, setup: WorkerSetup, context: TrainContext,
                 on_step: Optional[Callable[["Trainer", int], None]] = None) -> None:
        self.setup, self.context, self.on_step = setup, context, on_step
        self.job = job = setup.job
        train = job.train
        self.startup = dict(setup.startup or {}, worker_process=startup.process_started(), worker=time.time())
        if fork_server.forked_from() is not None:
            self.startup[startup.FORKED_FROM] = fork_server.forked_from()
        self.rank, self.world, self.device = context.rank, context.world, context.device
        use_gpu = job.resources.use_gpu
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")
        torch.set_num_threads(job.resources.torch_threads or max(1, int(job.resources.cpus_per_worker)))
        storage = job.storage.settings()
        self.checkpoints = ckpt.CheckpointManager(context.run_dir, setup.damaged, storage)

        train_ds = open_split(setup.shard_dir, "train", storage)
        self.task = make_task(setup.task_name, vocab=train_ds.vocab, **setup.task_state)
        model_config = SATConfig.from_dict(setup.model_config)
        pin = self.device.type == "cuda"
        self.batches = GlobalBatches(split_sampler(job, train_ds, shuffle=True), train.micro_batches_per_step,
                                     per_node=self.task.node_level)
        self.stream = RankStream(self.batches, self.rank, self.world)
        eval_splits = {s: open_split(setup.shard_dir, s, storage) for s in ("valid", "test")}
        eval_samplers = {s: split_sampler(job, ds, shuffle=False, rank=self.rank, world=self.world)
                         for s, ds in eval_splits.items()}
        # fixed batch capacities (train.step other than eager): what every padded batch's shapes are
        self.capacities, over = run_capacities(job, model_config, (train_ds, self.batches.sampler),
                                               [(eval_splits[s], eval_samplers[s]) for s in eval_splits])
        if self.rank == 0 and self.capacities["train"] is not None:
            log.info("batch capacity (train.step %s): training %s (%.1f%% of the first epoch's batches over it run "
                     "eagerly); evaluation %s", train.step, describe(self.capacities["train"]), 100 * over,
                     describe(self.capacities["eval"]))
        collator, eval_collator = (BatchCollator(model_config, capacity=self.capacities[kind],
                                                 node_targets=self.task.node_level) for kind in ("train", "eval"))
        self.train_loader = make_loader(train_ds, self.stream, collator, train.loader_workers, pin)
        self._train_batches: Optional[Iterator] = None  # made by the first epoch trained, kept for the run
        self.eval_loaders = {split: make_loader(eval_splits[split], eval_samplers[split], eval_collator,
                                                train.loader_workers, pin) for split in eval_splits}

        torch.manual_seed(train.seed)
        model = build_model(model_config)
        self.statistics_batches: Optional[StatisticsBatches] = None  # train.precise_bn_batches
        if train.precise_bn_batches and batchnorm_layers(model):
            self.statistics_batches = statistics_batches(job, train_ds, self.rank, self.world)
            self.statistics_loader = make_loader(train_ds, self.statistics_batches, collator, train.loader_workers, pin)
        self.startup["loaders"] = time.time()
        self.precision = resolve_precision(train.precision, use_gpu)  # "auto" is resolved where the GPU is
        if compiles_model(train.step):
            keep_compile_caches(train.storage_path)
        self.engine = build_engine(model, train, self.precision, self.batches.steps_per_epoch, self.world,
                                   compile_model=compiles_model(train.step))
        self.step = TrainStep(self.engine, self.task, train.grad_clip, clips_outside_deepspeed(train, self.precision),
                              mode=train.step, device=self.device)

        self.state: dict[str, Any] = {
            "epoch": -1,
            "steps": 0,  # optimizer steps so far: the global step
            "position": Position(0).to_dict(),  # the next step to train (pipeline.train.global_batch)
            "epoch_partial": None,  # the loss of the steps done of an unfinished epoch (EpochMeter.partial)
            "events": [],  # what happened between worker groups (pipeline.train.elastic.resize_event)
            "elapsed_s": 0.0,  # wall seconds of training and evaluation so far (pipeline.train.stopping)
            "stopped": None,  # why the run stopped before train.epochs (pipeline.train.stopping)
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
        self.position = Position(**self.state["position"])  # where this group starts
        self.resumed_step = self.state["steps"]
        self.stream.start = self.position
        self.reports = Reports(self.engine, context, self.checkpoints, setup.fault)
        self.preemption = elastic.PreemptionCheck(train.preemption_check_steps, context.preemption_notice)
        self._mark: Optional[float] = None  # wall-clock counted into elapsed_s up to here
        # rank 0: the previous worker group's progress note (read before this group writes its own)
        run_dir = self.checkpoints.location
        command = (setup.startup or {}).get("command")
        self.previous_note = elastic.read_note(run_dir) if self.rank == 0 else None
        self.note = elastic.ProgressNote(run_dir, command, self.world) if self.rank == 0 else None

        self.logger, self.segment = None, 0
        if self.rank == 0 and setup.run_id:
            from pipeline.registry.tracking import RankZeroLogger

            self.logger = RankZeroLogger(job.mlflow.tracking_uri, setup.run_id, job.mlflow.log_system_metrics)
            damage = "; ".join(f"{where}: {problem}" for problem, where in self.checkpoints.damaged.items())
            self.segment = self.logger.resume(self.state["history"], self.state["epoch"],
                                              damage or "the checkpoints after it are missing")
            self.logger.client.set_tag(setup.run_id, "satp.precision", self.precision)
            self.logger.client.set_tag(setup.run_id, "satp.world_size", str(self.world))
            self.logger.client.set_tag(setup.run_id, "satp.step", train.step)
            for kind, capacity in self.capacities.items():
                if capacity is not None:
                    self.logger.client.set_tag(setup.run_id, f"satp.capacity.{kind}", json.dumps(capacity.to_dict()))
        self.startup["engine"] = time.time()

    def fit(self) -> None:
        """Train from the restored position to ``train.epochs`` (or a stop by the job's rules)."""
        train = self.job.train
        try:
            for epoch in range(self.position.epoch, train.epochs):
                metrics = self.train_epoch(epoch)
                if (epoch + 1) % train.eval_every == 0 or epoch == train.epochs - 1:
                    metrics.update(self.evaluate_epoch(epoch))
                stop = self.report(epoch, metrics)
                if self.setup.fault and "signal" in self.setup.fault:
                    faults.maybe_signal(self.setup.fault, self.rank, epoch)
                if stop:
                    break
        finally:
            self.close()

    def _restore(self) -> None:
        """Restore the newer of the context's checkpoint (Ray Train's registered one: newer after a
        retry within the fit) and the plan's ``resume_from``, verified, else the newest intact one
        (:meth:`pipeline.train.checkpoint.CheckpointManager.newest_intact`). Rank 0 decides for all."""
        candidates = [n for n in (self.context.restored_checkpoint(), self.setup.resume_from) if n]
        if not candidates:
            return
        name = broadcast_from_rank_zero(self.checkpoints.newest_intact(candidates) if self.rank == 0 else None)
        if name is None:
            return
        with self.checkpoints.local(name) as directory:
            self.state = ckpt.restore(directory, self.engine)
            if self.rank == 0:
                self.best_weights = ckpt.load_best_weights(directory)
        log.info("rank %d of %d resumed at global step %d (epoch %d, step %d of %d) from %s", self.rank, self.world,
                 self.state["steps"], self.state["position"]["epoch"], self.state["position"]["step"],
                 self.batches.steps_per_epoch, self.checkpoints.path(name))

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Train one epoch (from the step the run is at); returns its metrics (train metric on rank 0
        only). A checkpoint when one is due (:meth:`checkpoint_here`)."""
        train, task, device, fault = self.job.train, self.task, self.device, self.setup.fault
        self.engine.train()
        steps = self.batches.steps_per_epoch
        start = self.position.step if self.position.epoch == epoch else 0
        count = len(self.stream.mine)
        sample_every = max(1, math.ceil(steps / TRAIN_METRIC_BATCHES))
        meter = EpochMeter(device)
        if start and self.rank == 0 and self.state.get("epoch_partial"):
            meter.carry(self.state["epoch_partial"])  # the loss of the steps before the checkpoint
        sampled_predictions: list[torch.Tensor] = []
        sampled_targets: list = []
        first_epoch = self._mark is None  # this worker group's first
        if first_epoch:
            self._mark = time.perf_counter()
            self._train_batches = iter(self.train_loader) if count else None  # from the position (restored)
        batches = self._train_batches
        self.step.overflow = 0
        for step in range(start, steps):
            scales = self.batches.scales(epoch, step, self.rank, self.world)
            part = torch.zeros((), device=device)  # this rank's part of the step's loss
            for index, scale in enumerate(scales):
                waited = time.perf_counter()
                cpu_batch = next(batches)
                meter.data_wait += time.perf_counter() - waited
                if first_epoch and step == start and index == 0:
                    self.startup["first_batch"] = time.time()
                if fault and not set(faults.TIMED) & fault.keys():
                    faults.maybe_fail(fault, self.rank, epoch, step, meter.seconds)
                size, sampled = task.batch_size(cpu_batch), step % sample_every == 0 and index == 0
                if sampled:
                    sampled_targets.extend(task.targets(cpu_batch))
                out, loss = self.step.accumulate(cpu_batch, scale, index, count)
                padding = padding_of(cpu_batch)
                meter.add(loss, size, padding.graphs if padding is not None else int(cpu_batch.num_graphs))
                part += loss.float() * (scale / self.world)
                if sampled:
                    sampled_predictions.append(task.real_rows(task.predictions(out), cpu_batch))
            self.step.finish()
            self.position = Position(epoch, step + 1)
            self.state["steps"] = global_step = epoch * steps + step + 1
            self.reports.losses.add(global_step, part)
            if self.note is not None:
                self.note.write(global_step)
            if first_epoch and step == start:
                self._first_step_done()
            if self.on_step is not None:
                self.on_step(self, global_step)
            if self.rank == 0 and (step + 1) % train.log_every_steps == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step + 1, steps, float(loss))  # rank 0's last
            reason = self._checkpoint_due(global_step)
            if reason and step + 1 < steps:  # the epoch's end writes one anyway
                self.checkpoint_here(epoch, meter, reason)
            if fault and "hold" in fault:
                faults.maybe_hold(fault, self.world, global_step,
                                  lambda: self.note is not None and self.note.write(global_step, force=True))
        metrics: dict[str, Any] = {"epoch": epoch, **meter.reduce(device),
                                   "lr": float(self.engine.optimizer.param_groups[0]["lr"]),
                                   "steps": self.state["steps"], "overflow_batches": self.step.overflow}
        if first_epoch and self.rank == 0:
            metrics.update(startup.metrics(self.startup))
        predictions = task.decode(torch.cat(sampled_predictions).cpu()) if sampled_predictions else []
        if not self.baseline_targets and self.state["constant"] is None:
            self.baseline_targets = sampled_targets[:TRAIN_SAMPLE_FOR_BASELINE]
        gathered = gather_objects((predictions, sampled_targets))
        if self.rank == 0:
            metrics[f"train_{task.metric}"] = task.score(*concat_gathered(gathered))
        return metrics

    def _checkpoint_due(self, global_step: int) -> Optional[str]:
        """Why a checkpoint is due after ``global_step`` (the same answer on every rank), or None."""
        notice = self.preemption.notice(global_step)  # a collective at its steps, asked whatever else is due
        if notice is not None:
            if self.rank == 0:
                log.warning("preemption notice: node(s) %s (ranks %s) drained, deadline %s: checkpoint at step %d",
                            ", ".join(notice.preempted_node_ids), notice.preempted_ranks,
                            time.strftime("%H:%M:%S", time.localtime(notice.deadline_ms / 1000))
                            if notice.deadline_ms else "none", global_step)
            return "preemption notice"
        every = self.job.train.checkpoint_every_steps
        return "train.checkpoint_every_steps" if every and global_step % every == 0 else None

    def checkpoint_here(self, epoch: int, meter: EpochMeter, reason: str) -> None:
        """A checkpoint within ``epoch`` at the run's position (every rank), reported to Ray Train."""
        partial = meter.partial(self.device)  # a collective
        self._count_elapsed()
        self._save(epoch, partial, {"elapsed_s": self.state["elapsed_s"]})
        if self.rank == 0:
            log.info("checkpoint at global step %d (epoch %d, step %d of %d; %s)", self.state["steps"], epoch,
                     self.position.step, self.batches.steps_per_epoch, reason)

    def _save(self, epoch: int, partial: Optional[dict], metrics: dict[str, Any]) -> None:
        """Checkpoint the state at the run's position and report ``metrics`` with it (every rank)."""
        self.state.update(position=self.position.to_dict(), epoch_partial=partial, world_size=self.world,
                          provenance=self.setup.provenance)  # a resumed run may add a git commit
        if self.note is not None:  # exact before a checkpoint: a group lost while writing it lost these steps
            self.note.write(self.state["steps"], force=True)
        self.reports.write(self.state, self.best_weights, metrics, epoch)

    def _count_elapsed(self) -> None:
        now = time.perf_counter()
        self.state["elapsed_s"] = self.state.get("elapsed_s", 0.0) + now - self._mark
        self._mark = now

    def _first_step_done(self) -> None:
        """Stamp this worker group's first step's end (its kernels finished); on rank 0, log the
        start-up and what happened since the previous group (:func:`pipeline.train.elastic.resize_event`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup["first_step"] = time.time()
        if self.rank != 0:
            return
        log.info("%s", startup.describe(self.startup))
        event = elastic.resize_event(self.previous_note, self.note.command, self.world, self.resumed_step,
                                     time.time())
        if event is None:
            return
        log.info("worker group: %s", elastic.describe(event))
        self.state["events"].append(event)
        if self.logger is not None:
            number = sum(1 for e in self.state["events"] if e["kind"] == event["kind"])
            try:
                self.logger.client.set_tag(self.setup.run_id, f"satp.{event['kind']}.{number}", elastic.describe(event))
            except Exception as exc:  # the tracking store must not stop training
                log.warning("MLflow: worker-group event not logged (%s)", exc)

    def evaluate_epoch(self, epoch: int) -> dict[str, Any]:
        """Validation and test metrics (rank 0), and the best epoch by validation. With
        ``train.precise_bn_batches``, ``val_<metric>_running_bn`` is the metric before BatchNorm's
        statistics are recomputed (:mod:`pipeline.train.precise_bn`); everything else uses them after."""
        task, metric, forward = self.task, self.task.metric, self.step.forward
        started = time.perf_counter()
        self.step.overflow = 0
        running_bn = None
        if self.statistics_batches is not None:
            running_bn = gather_objects(evaluate(self.engine, task, self.eval_loaders["valid"], forward))
            self.statistics_batches.set_epoch(epoch)
            shift = recompute_batchnorm_stats(self.engine.module, self.statistics_loader, forward)
        results = {split: gather_objects(evaluate(self.engine, task, loader, forward))
                   for split, loader in self.eval_loaders.items()}
        metrics: dict[str, Any] = {"eval_seconds": time.perf_counter() - started,
                                   "eval_overflow_batches": self.step.overflow}
        if self.rank != 0:
            return metrics
        if running_bn is not None:
            metrics[f"val_{metric}_running_bn"] = task.score(*concat_gathered(running_bn))
            if shift is not None:
                metrics.update(shift.metrics())
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

    def report(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """Checkpoint and report the epoch's end (every rank); return whether the run stops here."""
        metric, state, task = self.task.metric, self.state, self.task
        self._count_elapsed()
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
        self.position = Position(epoch + 1)
        self._save(epoch, None, metrics)
        if self.rank == 0:
            log.info("epoch %d: %s", epoch, {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
            if state["stopped"]:
                log.info("stopping after epoch %d of %d: %s", epoch, self.job.train.epochs, state["stopped"])
        return state["stopped"] is not None

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()

