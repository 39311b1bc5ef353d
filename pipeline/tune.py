"""ASHA hyperparameter sweeps of a job (``satp tune JOB.yaml``), logged to MLflow.

:func:`run_sweep` reads the job's ``tune:`` section (:mod:`pipeline.tune_config`)
and runs a Ray Tune ``Tuner`` whose trials are full Ray Train runs (the Train V2
pattern: a Tune function, :func:`_trial`, builds and fits the ``TorchTrainer``
through :func:`pipeline.train.train_job`, with Tune's ``TuneReportCallback`` in
the Train run's callbacks, so every epoch's metrics reach Tune and ASHA).

* Before any trial starts, the driver validates every sampled value against the
  job's schema, and builds the shards of every preprocessing variant of the
  space (keys under ``data``/``transform``/``shards``; shard directories are
  keyed by the config hash), so trials only read shards.
* Concurrency is capped by the cluster's resources (each trial needs
  ``num_workers x cpus_per_worker`` CPUs, and GPUs when ``use_gpu``).
* MLflow (one writer: the driver): a parent run for the sweep and a child run
  per trial (tag ``mlflow.parentRunId``) with the trial's params and per-epoch
  metrics, logged by a Tune callback (:class:`SweepLogger`) in the driver; the
  trials themselves run with MLflow off. At the end: a plot of every trial's
  validation curve with early stops marked, logged to the parent run.
* The best trial (by the sweep's metric, best epoch) is logged and registered
  from its last Train checkpoint (the best-epoch weights it holds), into its
  child run; the ``champion`` alias moves to the new version only if it beats
  the current champion's validation metric (the replaced version keeps tags
  saying why). A worse sweep leaves the alias where it is.
* Rerunning an interrupted sweep (same ``tune.name`` and storage path) resumes
  it with ``Tuner.restore``; unfinished trials resume their Train runs from
  their last checkpoints, and MLflow runs are found again by their tags.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from pipeline import registry, tracking
from pipeline.console import plural
from pipeline.config import JobConfig, format_validation_error, set_dotted
from pipeline.tune_config import DATA_SECTIONS, TuneConfig, split_key

log = logging.getLogger(__name__)

SWEEP_KEY_TAG = "satp.sweep_key"
TRIAL_TAG = "satp.trial_id"
PARENT_TAG = "mlflow.parentRunId"
REGISTERED_TAG = "satp.registered_version"

#: Tune's own bookkeeping in a result: not logged to MLflow as metrics.
_TUNE_KEYS = {
    "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "pid", "iterations_since_restore",
    "time_since_restore", "done", "timesteps_total", "episodes_total", "timesteps_since_restore",
    "checkpoint_dir_name", "should_checkpoint", "node_ip", "hostname", "date", "experiment_tag", "trial_id",
    "epochs_done",
}


# ----------------------------------------------------------------------------- dotted keys
def apply_config(raw: dict, config: dict[str, Any]) -> dict:
    """A copy of the job dict ``raw`` with a trial's sampled ``config`` set at its dotted keys."""
    out = copy.deepcopy(raw)
    for key, value in config.items():
        for part in split_key(key):
            set_dotted(out, part, value)
    return out


def base_job_dict(job: JobConfig) -> dict:
    raw = job.model_dump(mode="json", exclude={"tune"})
    raw.pop("tune", None)
    return raw


def _validate(raw: dict, where: str) -> JobConfig:
    from pydantic import ValidationError

    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(format_validation_error(where, exc)) from None


def space_jobs(job: JobConfig) -> list[JobConfig]:
    """The job with every value the space can sample (each key varied from the first values of
    the others); raises a one-line error naming the key when a value gives an invalid job."""
    raw = base_job_dict(job)
    first = {key: dist.candidates()[0] for key, dist in job.tune.space.items()}  # settings that go together
    jobs = []  # the first values of every key come first
    for key, dist in job.tune.space.items():
        for value in dist.candidates():
            jobs.append(_validate(apply_config(raw, {**first, key: value}), f"tune.space.{key} = {value!r}"))
    return jobs or [_validate(raw, "job")]


def check_space(job: JobConfig) -> None:
    """Every value the space can sample must give a valid job (one-line error naming the key)."""
    space_jobs(job)


def data_variants(job: JobConfig) -> list[dict[str, Any]]:
    """Every combination of the preprocessing-changing keys of the space (``[{}]`` when none)."""
    keys = [k for k in job.tune.space if any(p.split(".")[0] in DATA_SECTIONS for p in split_key(k))]
    values = [job.tune.space[k].candidates() for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def variant_key(config: dict[str, Any], keys: list[str]) -> str:
    return json.dumps({k: config[k] for k in sorted(keys)}, sort_keys=True, default=str)


def _absolute(path: Optional[str], base: Path) -> Optional[str]:
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _resolve_paths(raw: dict, cwd: Path) -> dict:
    """Relative data/shard roots and source dirs resolved against the driver's cwd (trials run elsewhere)."""
    raw = copy.deepcopy(raw)
    data = raw.get("data") or {}
    if data.get("root"):
        data["root"] = _absolute(data["root"], cwd)
    if data.get("source_dirs"):
        data["source_dirs"] = [_absolute(d, cwd) for d in data["source_dirs"]]
    shards = raw.get("shards") or {}
    if shards.get("root"):
        shards["root"] = _absolute(shards["root"], cwd)
    return raw


# ----------------------------------------------------------------------------- task facts
def task_metric(job: JobConfig) -> tuple[str, str, str]:
    """``(task name, task metric, task mode)`` of the job (without reading any data)."""
    from pipeline.tasks import TASK_CLASSES, task_name_for

    name = task_name_for(job.train.task, getattr(job.data, "name", None))
    classes = TASK_CLASSES
    if name not in classes:
        raise ValueError(f"unknown task {name!r}")
    return name, classes[name].metric, classes[name].mode


# ----------------------------------------------------------------------------- the trial
@dataclasses.dataclass
class SweepContext:
    """What every trial needs (plain and picklable; shipped with ``tune.with_parameters``)."""

    name: str
    base: dict  # the job (paths absolute, MLflow off), without the tune section
    shard_dirs: dict[str, str]  # variant_key -> shard directory
    data_keys: list[str]
    train_storage: str  # the trials' Train runs live here
    max_epochs: int


def trial_job(ctx: SweepContext, config: dict[str, Any], trial_id: str) -> JobConfig:
    raw = apply_config(ctx.base, config)
    raw["train"]["run_name"] = f"{ctx.name}-{trial_id}"
    raw["train"]["storage_path"] = ctx.train_storage
    raw["train"]["epochs"] = ctx.max_epochs
    raw["mlflow"]["enabled"] = False  # the driver's SweepLogger is the only MLflow writer
    return _validate(raw, f"trial {trial_id}")


#: ASHA's time unit: epochs completed, reported with every epoch's metrics. Not Tune's
#: ``training_iteration``: a resumed trial's Train run restarts from its last checkpoint, so its
#: iterations no longer count epochs.
TIME_ATTR = "epochs_done"


def _report_callback():
    """Tune's ``TuneReportCallback`` (Train -> Tune metrics), adding :data:`TIME_ATTR`."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            metrics = [dict(m, **{TIME_ATTR: int(m["epoch"]) + 1}) if "epoch" in m else m for m in metrics]
            super().after_report(run_context, metrics, checkpoint)

    return EpochReportCallback()


def _trial(config: dict[str, Any], ctx: SweepContext) -> None:
    """A Tune trial: one full Ray Train run of the job with ``config`` applied."""
    import ray.tune

    from pipeline.train import train_job

    trial_id = ray.tune.get_context().get_trial_id()
    job = trial_job(ctx, config, trial_id)
    shard_dir = ctx.shard_dirs[variant_key(config, ctx.data_keys)]
    train_job(job, shard_dir=shard_dir, register=False, callbacks=[_report_callback()])


# ----------------------------------------------------------------------------- MLflow
def catch_up_metrics(client, run_id: str, checkpoint_path: str) -> int:
    """Log the epochs of a trial's Train history (its last checkpoint's ``state.json``) that its
    MLflow run lacks: an epoch reported just before an interruption never reached the driver's
    callback. Returns the number of epochs logged."""
    from mlflow.entities import Metric

    from pipeline import checkpoint as ckpt

    try:
        history = ckpt.load_state(checkpoint_path).get("history") or []
    except (ValueError, OSError):
        return 0
    logged = {int(m.step) for m in client.get_metric_history(run_id, "epoch")}
    now = int(time.time() * 1000)
    count = 0
    for entry in history:
        epoch = int(entry.get("epoch", -1))
        if epoch < 0 or epoch in logged:
            continue
        items = [Metric(k, v, now, epoch) for k, v in _numeric(entry).items()]
        if items:
            client.log_batch(run_id, metrics=items)
            count += 1
    return count


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        if k in _TUNE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


def release_orphaned_placement_groups(with_pending: bool = False):
    """Remove the placement groups of this job whose creating actor died; return how many.

    When ASHA stops a trial, Tune ends the trial's actor, which kills its Train controller
    (an owned actor) and the Train workers, but not the workers' placement group: Ray keeps a
    placement group until its job ends. Train V2's ``PlacementGroupCleaner`` would remove it,
    but it polls the controller through the State API, which needs the dashboard (absent in
    ``ray.init(include_dashboard=False)`` clusters such as the tests'), so the CPUs stay reserved
    and the next trials wait forever. Only this job's non-detached groups are touched.
    """
    import ray
    from ray._private.state import state as global_state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if not ray.is_initialized():
        return (0, 0) if with_pending else 0
    try:
        job_id = bytes.fromhex(ray.get_runtime_context().get_job_id())
        table = global_state._connect_and_get_accessor().get_placement_group_table()
    except Exception as exc:  # best effort: never fail a sweep over housekeeping
        log.debug("placement group table unavailable: %s", exc)
        return (0, 0) if with_pending else 0
    removed = pending = 0
    for raw in table:
        info = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if info.state == gcs_pb2.PlacementGroupTableData.REMOVED or info.is_detached:
            continue
        if info.creator_job_id != job_id or not info.creator_actor_id or set(info.creator_actor_id) == {0xFF}:
            continue  # another job's, or created by the driver (Tune's own trial groups)
        if not info.creator_actor_dead:
            pending += 1
            continue
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(info.placement_group_id)))
            removed += 1
        except Exception as exc:
            log.debug("could not remove placement group: %s", exc)
    if removed:
        log.info("released %d placement group(s) of stopped trials", removed)
    return (removed, pending) if with_pending else removed


def release_after_sweep(timeout_s: float = 20.0) -> None:
    """After ``Tuner.fit``: wait (briefly) for the last trials' Train controllers to die and
    release their placement groups, so that the cluster's resources are free again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, pending = release_orphaned_placement_groups(with_pending=True)
        if not pending:
            return
        time.sleep(0.5)


def _import_tune_callback():
    from ray.tune import Callback

    return Callback


class SweepLogger(_import_tune_callback()):
    """Tune callback in the driver: one MLflow child run per trial (params, per-epoch metrics)."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, sweep_key: str, ctx: SweepContext,
                 max_epochs: int) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.sweep_key = sweep_key
        self.ctx = ctx
        self.max_epochs = max_epochs
        self._runs: dict[str, str] = {}
        self._client = None

    def __getstate__(self):  # Tune pickles its callbacks with the experiment state
        state = self.__dict__.copy()
        state["_client"] = None
        state["_runs"] = {}
        return state

    @property
    def client(self):
        if self._client is None:
            self._client = tracking.client(self.tracking_uri)
        return self._client

    def run_id(self, trial) -> str:
        tid = trial.trial_id
        if tid in self._runs:
            return self._runs[tid]
        client = self.client
        found = tracking.find_run(client, self.experiment_id, {SWEEP_KEY_TAG: self.sweep_key, TRIAL_TAG: tid})
        if found is not None:
            run_id = found.info.run_id
            if found.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
        else:
            tags = {PARENT_TAG: self.parent_run_id, SWEEP_KEY_TAG: self.sweep_key, TRIAL_TAG: tid,
                    "satp.trial_config": json.dumps(trial.config, default=str)[:5000]}
            run = client.create_run(self.experiment_id, run_name=f"{self.ctx.name}-{tid}", tags=tags)
            run_id = run.info.run_id
            params = apply_config(self.ctx.base, trial.config)
            params["train"]["epochs"] = self.max_epochs
            tracking.log_params(client, run_id, params)
        self._runs[tid] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self.run_id(trial)

    def on_step_begin(self, iteration, trials, **info):
        now = time.monotonic()
        if now - getattr(self, "_last_release", 0.0) > 2.0:
            self._last_release = now
            release_orphaned_placement_groups()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mlflow.entities import Metric

        metrics = _numeric(result)
        step = int(result.get("epoch", result.get("training_iteration", 1) - 1))
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        if items:
            self.client.log_batch(self.run_id(trial), metrics=items)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        epochs = int(last.get("epoch", -1)) + 1
        run_id = self.run_id(trial)
        early = epochs < self.max_epochs
        self.client.set_tag(run_id, "satp.early_stopped", str(early).lower())
        self.client.set_tag(run_id, "satp.epochs_run", str(epochs))
        self.client.set_terminated(run_id, status="KILLED" if early else "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info):
        run_id = self.run_id(trial)
        self.client.set_tag(run_id, "satp.error", str(getattr(trial, "error_msg", "") or "")[:500])
        self.client.set_terminated(run_id, status="FAILED")


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass
class TrialSummary:
    trial_id: str
    config: dict[str, Any]
    status: str  # finished | early_stopped | error | interrupted (not finished when the sweep stopped)
    epochs: int
    best: Optional[float]  # the sweep metric at its best epoch
    best_val: Optional[float]  # best_val_<task metric> (the registered model's)
    best_test: Optional[float]
    curve: list[tuple[int, float]]  # (epoch, val metric)
    checkpoint_path: Optional[str]
    run_id: Optional[str] = None


@dataclasses.dataclass
class SweepOutcome:
    name: str
    path: str  # the Tune experiment directory
    metric: str
    mode: str
    trials: list[TrialSummary]
    best: Optional[TrialSummary]
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    registered: Optional[dict[str, Any]]  # registered_uri, version, champion (bool), reason
    resumed: bool
    seconds: float
    interrupted: bool = False

    @property
    def early_stopped(self) -> list[TrialSummary]:
        return [t for t in self.trials if t.status == "early_stopped"]


def saved_states(path: str | Path) -> dict[str, str]:
    """Trial states in the sweep's saved experiment state. After an interruption (Ctrl-C) Tune
    stops the running trials and marks them TERMINATED in memory, but it saves them first as
    PENDING/RUNNING so that ``Tuner.restore`` resumes them: the saved state tells."""
    try:
        from ray.tune import ExperimentAnalysis

        return {t.trial_id: t.status for t in ExperimentAnalysis(str(path)).trials}
    except Exception as exc:  # unreadable state: trust the in-memory results
        log.debug("no saved experiment state at %s: %s", path, exc)
        return {}


def summarize(results, metric: str, mode: str, val_metric: str, max_epochs: int,
              states: Optional[dict[str, str]] = None) -> list[TrialSummary]:
    try:  # Tune's trials, in the order of the results
        tune_trials = list(results._experiment_analysis.trials)
    except AttributeError:
        tune_trials = []
    if len(tune_trials) != len(results):
        tune_trials = [None] * len(results)
    states = dict(states or {})
    out = []
    for trial, result in zip(tune_trials, results):
        df = result.metrics_dataframe
        last = result.metrics or {}
        tid = trial.trial_id if trial is not None else last.get("trial_id") or Path(result.path).name
        if trial is not None and tid not in states:
            states[tid] = trial.status
        curve: list[tuple[int, float]] = []
        best = None
        best_val = best_test = None
        checkpoint_path = None
        epochs = 0
        if df is not None and len(df):
            rows = df.to_dict("records")
            for row in rows:
                epoch = row.get("epoch")
                if epoch is None or (isinstance(epoch, float) and math.isnan(epoch)):
                    continue
                epochs = max(epochs, int(epoch) + 1)
                v = row.get(val_metric)
                if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
                    curve.append((int(epoch), float(v)))
                m = row.get(metric)
                if isinstance(m, (int, float)) and math.isfinite(m) and (best is None or registry.better(m, best, mode)):
                    best = float(m)
                if row.get("checkpoint_path") and isinstance(row.get("checkpoint_path"), str):
                    checkpoint_path = row["checkpoint_path"]
                    best_val = row.get(f"best_{val_metric}", best_val)
                    best_test = row.get(f"best_{val_metric.replace('val_', 'test_', 1)}", best_test)
        if result.error is not None or states.get(tid) == "ERROR":
            status = "error"
        elif states.get(tid, "TERMINATED") != "TERMINATED":
            status = "interrupted"
        elif epochs < max_epochs:
            status = "early_stopped"
        else:
            status = "finished"
        config = dict(result.config or (trial.config if trial is not None else {}) or {})
        out.append(TrialSummary(tid, config, status, epochs, best,
                                registry.finite_float(best_val), registry.finite_float(best_test), curve, checkpoint_path))
    return out


def plot_sweep(trials: list[TrialSummary], val_metric: str, path: str | os.PathLike, title: str = "") -> None:
    """Every trial's validation curve; an early stop is marked with a red cross at its last epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for t in trials:
        if not t.curve:
            continue
        xs, ys = zip(*t.curve)
        style = "--" if t.status != "finished" else "-"
        (line,) = ax.plot(xs, ys, style, marker="o", markersize=3, label=f"{t.trial_id} ({t.status})")
        if t.status == "early_stopped":
            ax.plot(xs[-1], ys[-1], "x", color="red", markersize=10, markeredgewidth=2)
    ax.plot([], [], "x", color="red", markersize=10, markeredgewidth=2, label="stopped early (ASHA)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(val_metric)
    ax.set_title(title or f"{val_metric} per trial")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- registry
def register_best(job: JobConfig, best: TrialSummary, *, task_metric_name: str, mode: str, tracking_uri: str,
                  alias: str, sweep_name: str, parent_run_id: str) -> dict[str, Any]:
    """Log the best trial's best-epoch model into its child run, register it, and move ``alias``
    to it if it beats the current holder's validation metric."""
    import torch

    from pipeline import checkpoint as ckpt
    from pipeline.predict import input_spec
    from pipeline.registry import log_and_register
    from pipeline.tasks import make_task
    from pipeline.loader import open_split
    from pipeline.worker import build_model
    from sat.config import SATConfig

    if not best.checkpoint_path:
        raise RuntimeError(f"trial {best.trial_id} reported no checkpoint")
    directory = Path(best.checkpoint_path)
    state = ckpt.load_state(directory)
    weights = ckpt.load_best_weights(directory)
    if weights is None:
        raise RuntimeError(f"{directory}: no best weights in the trial's checkpoint")
    config = SATConfig.from_dict(state["model_config"])
    model = build_model(config)
    model.load_state_dict(weights)
    model.eval()
    shard_dir = best.config.get("__shard_dir__")
    task_state = dict(state["task"])
    vocab = None
    if shard_dir:
        vocab = open_split(shard_dir, "train").vocab
    task = make_task(task_state.pop("name"), vocab=vocab, **task_state)
    m = task_metric_name
    b = state["best"]
    metrics = {f"best_val_{m}": b["val"], f"best_test_{m}": b["test"], "best_epoch": b["epoch"]}
    if state.get("constant") is not None:
        metrics[f"constant_{m}"] = state["constant"]
    metrics = {k: v for k, v in metrics.items() if v is not None}
    name = job.mlflow.registered_model or f"sat-{task.name}"
    extra = {"run_name": f"{sweep_name}-{best.trial_id}", "job": best.config.get("__job__"),
             "sweep": {"name": sweep_name, "trial_id": best.trial_id, "parent_run_id": parent_run_id}}
    if shard_dir:
        extra.update(input_spec(shard_dir))
    manifest_hash = ""
    if shard_dir:
        manifest_hash = (open_split(shard_dir, "train").manifest or {}).get("config_hash", "")
    with torch.no_grad():
        reg = log_and_register(model, task=task, model_config=config, vocab=vocab, run_id=best.run_id,
                               tracking_uri=tracking_uri, registered_model=name, data_manifest_hash=manifest_hash,
                               metrics=metrics, extra=extra, provenance=state.get("provenance"))
    client = tracking.client(tracking_uri)
    client.set_model_version_tag(name, str(reg["version"]), "satp.sweep", sweep_name)
    reg.update(registry.promote(client, name, reg["version"], metrics.get(f"best_val_{m}"), f"best_val_{m}", mode, alias,
                       sweep_name))
    return reg


# ----------------------------------------------------------------------------- the sweep
def concurrency_cap(job: JobConfig, tune_cfg: TuneConfig, cluster: dict[str, float]) -> int:
    """How many trials the cluster's resources run at once."""
    res = job.resources
    workers = max_workers(job, tune_cfg)
    need = {"CPU": workers * res.cpus_per_worker + tune_cfg.trial_cpus}
    if res.use_gpu:
        need["GPU"] = workers * res.gpus_per_worker
    caps = [int(cluster.get(k, 0) // v) for k, v in need.items() if v > 0]
    return max(1, min(caps)) if caps else 1


def max_workers(job: JobConfig, tune_cfg: TuneConfig) -> int:
    """The job's worker count, or the largest one the space sweeps."""
    workers = job.resources.num_workers
    for key, dist in tune_cfg.space.items():
        if "resources.num_workers" in split_key(key):
            workers = max(int(v) for v in dist.candidates())
    return workers


def open_parent_run(client, exp_id: str, sweep_key: str, kind: str, name: str, params: dict,
                    tags: Optional[dict[str, str]] = None) -> str:
    """The parent MLflow run of a sweep or comparison (``kind``), made before any trial starts (one
    writer: the driver). A rerun finds it by its key and sets it RUNNING again."""
    parent = tracking.find_run(client, exp_id, {SWEEP_KEY_TAG: sweep_key, "satp.kind": kind})
    if parent is None:
        run_tags = {SWEEP_KEY_TAG: sweep_key, "satp.kind": kind, **(tags or {})}
        parent_id = client.create_run(exp_id, run_name=name, tags=run_tags).info.run_id
        tracking.log_params(client, parent_id, params)
        return parent_id
    if parent.info.status != "RUNNING":
        client.update_run(parent.info.run_id, status="RUNNING")
    return parent.info.run_id


def trial_trainable(trial_fn, ctx: SweepContext, trial_cpus: float):
    """The Tune trainable of ``trial_fn``. The Tune function only drives its Train run; a resource
    request cannot be empty, so with ``trial_cpus`` 0 it asks for 1 MiB of Ray's logical memory."""
    from ray import tune

    resources = {"cpu": trial_cpus} if trial_cpus > 0 else {"cpu": 0, "memory": 2**20}
    return tune.with_resources(tune.with_parameters(trial_fn, ctx=ctx), resources)


def fit_trials(sweep_dir: Path, trainable, new_tuner, client, parent_id: str):
    """Fit the trials: a new ``Tuner`` (``new_tuner()``), or the interrupted one in ``sweep_dir``
    restored. Returns ``(results, resumed)``; any failure marks the parent run FAILED."""
    from ray import tune

    resumed = tune.Tuner.can_restore(str(sweep_dir))
    try:
        if resumed:
            log.info("resuming %s", sweep_dir)
            tuner = tune.Tuner.restore(str(sweep_dir), trainable=trainable, resume_unfinished=True, resume_errored=True)
        else:
            tuner = new_tuner()
        results = tuner.fit()
        release_after_sweep()
    except BaseException:
        try:
            client.set_terminated(parent_id, status="FAILED")
        except Exception:
            pass
        raise
    return results, resumed


def run_sweep(job: JobConfig, *, address: Optional[str] = None, verbose: int = 1) -> SweepOutcome:
    """Run (or resume) the ASHA sweep of ``job.tune``; see the module docstring."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from pipeline.train import resolve_job
    from pipeline.train_config import runs_dir

    start = time.time()
    if job.tune is None:
        raise ValueError(f"job {job.name!r} has no tune: section")
    tune_cfg = job.tune
    task_name, m, task_mode = task_metric(job)
    metric = tune_cfg.metric or f"val_{m}"
    mode = tune_cfg.mode or task_mode
    val_metric = f"val_{m}"
    if job.train.eval_every != 1:
        raise ValueError("tune: ASHA compares trials every epoch; set train.eval_every: 1")
    space = space_jobs(job)
    max_epochs = tune_cfg.asha.max_epochs or job.train.epochs
    if tune_cfg.asha.grace_period > max_epochs:
        raise ValueError(f"tune.asha.grace_period: {tune_cfg.asha.grace_period} > max_epochs {max_epochs}")

    job = resolve_job(job)
    if not job.mlflow.enabled:
        raise ValueError("tune: the sweep logs to MLflow; mlflow.enabled must be true")
    name = tune_cfg.name or f"{job.name}-sweep"
    storage = Path(tune_cfg.storage_path or runs_dir() / "tune").expanduser().resolve()
    sweep_dir = storage / name
    tracking_uri = job.mlflow.tracking_uri
    from pipeline.predict import check_reachable

    check_reachable(tracking_uri)  # fail fast, before any preprocessing or trial
    cwd = Path.cwd()
    base = _resolve_paths(base_job_dict(job), cwd)
    base["mlflow"]["enabled"] = False

    # the pre-flight of satp train, for every variant of the space: config, data roots, the Ray
    # address (connected here), the cluster against one trial's request (its largest worker count)
    from pipeline.preflight import preflight

    preflight(space, address=address, num_workers=max_workers(job, tune_cfg), extra_cpus=tune_cfg.trial_cpus,
              ray_env={"OUTDATED_IGNORE": "1", "RAY_USAGE_STATS_ENABLED": "0"})

    # preprocessing variants, built once here
    import preprocessing
    from preprocessing.config import DataConfig, ShardConfig, TransformConfig

    variants = data_variants(job)
    data_keys = sorted(variants[0]) if variants else []
    shard_dirs: dict[str, str] = {}
    for variant in variants:
        raw = apply_config(base, variant)
        out = preprocessing.preprocess(DataConfig.model_validate(raw["data"]), TransformConfig.model_validate(raw["transform"]),
                                       ShardConfig.model_validate(raw["shards"]), address=address)
        shard_dirs[variant_key(variant, data_keys)] = str(Path(out).resolve())
        log.info("shards for %s: %s", variant or "the job", out)

    ctx = SweepContext(name=name, base=base, shard_dirs=shard_dirs, data_keys=data_keys,
                       train_storage=str(sweep_dir / "train"), max_epochs=max_epochs)

    # MLflow: experiment and parent run before any trial starts (one writer: this process)
    client = tracking.client(tracking_uri)
    exp_id = tracking.ensure_experiment(client, job.mlflow.experiment, tracking_uri)
    sweep_key = str(sweep_dir)
    parent_id = open_parent_run(client, exp_id, sweep_key, "sweep", name, {**base, "tune": job.tune.model_dump(mode="json")})

    cluster = ray.cluster_resources()
    cap = concurrency_cap(job, tune_cfg, cluster)
    concurrent = min(cap, tune_cfg.max_concurrent_trials or cap)
    log.info("sweep %s: %d samples, at most %d trials at once (cluster %s)", name, tune_cfg.num_samples,
             concurrent, {k: cluster.get(k) for k in ("CPU", "GPU") if k in cluster})

    trainable = trial_trainable(_trial, ctx, tune_cfg.trial_cpus)

    def new_tuner():
        param_space = {key: dist.to_tune() for key, dist in tune_cfg.space.items()}
        scheduler = ASHAScheduler(time_attr=TIME_ATTR, max_t=max_epochs, grace_period=tune_cfg.asha.grace_period,
                                  reduction_factor=tune_cfg.asha.reduction_factor, brackets=tune_cfg.asha.brackets)
        return tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(
                metric=metric, mode=mode, scheduler=scheduler, num_samples=tune_cfg.num_samples,
                # the searcher caps concurrency (Tune ignores max_concurrent_trials with a generator)
                search_alg=BasicVariantGenerator(random_state=tune_cfg.seed, max_concurrent=concurrent),
            ),
            run_config=tune.RunConfig(
                name=name, storage_path=str(storage),
                failure_config=tune.FailureConfig(max_failures=tune_cfg.max_failures),
                callbacks=[SweepLogger(tracking_uri, exp_id, parent_id, sweep_key, ctx, max_epochs)],
                verbose=verbose,
            ),
        )

    results, resumed = fit_trials(sweep_dir, trainable, new_tuner, client, parent_id)

    trials = summarize(results, metric, mode, val_metric, max_epochs, saved_states(sweep_dir))
    for t in trials:
        found = tracking.find_run(client, exp_id, {SWEEP_KEY_TAG: sweep_key, TRIAL_TAG: t.trial_id})
        t.run_id = found.info.run_id if found is not None else None
        t.config = {**t.config, "__shard_dir__": shard_dirs[variant_key(t.config, data_keys)],
                    "__job__": trial_job(ctx, {k: v for k, v in t.config.items() if not k.startswith("__")},
                                         t.trial_id).model_dump(mode="json")}
    for t in trials:
        if t.run_id and t.checkpoint_path:
            catch_up_metrics(client, t.run_id, t.checkpoint_path)
    if any(t.status == "interrupted" for t in trials):
        client.set_tag(parent_id, "satp.interrupted", "true")
        client.set_terminated(parent_id, status="KILLED")
        return SweepOutcome(name=name, path=str(sweep_dir), metric=metric, mode=mode, trials=trials, best=None,
                            parent_run_id=parent_id, tracking_uri=tracking_uri, registered=None, resumed=resumed,
                            seconds=time.time() - start, interrupted=True)
    ok = [t for t in trials if t.status != "error" and t.best is not None]
    best = None
    for t in ok:
        if best is None or registry.better(t.best, best.best, mode):
            best = t

    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "sweep_val_curves.png"
        plot_sweep(trials, val_metric, png, title=f"{name}: {val_metric} per trial ({plural(len(trials), 'trial')})")
        client.log_artifact(parent_id, str(png), artifact_path="plots")
        table = [{k: v for k, v in dataclasses.asdict(t).items() if k not in ("curve",)} | {
            "config": {k: v for k, v in t.config.items() if not k.startswith("__")}} for t in trials]
        (Path(tmp) / "trials.json").write_text(json.dumps(table, indent=1, default=str))
        client.log_artifact(parent_id, str(Path(tmp) / "trials.json"))

    summary = {"trials": len(trials), "trials_early_stopped": sum(t.status == "early_stopped" for t in trials),
               "trials_failed": sum(t.status == "error" for t in trials)}
    if best is not None:
        summary[f"best_{metric}"] = best.best
        if best.best_val is not None:
            summary[f"best_val_{m}"] = best.best_val
        if best.best_test is not None:
            summary[f"best_test_{m}"] = best.best_test
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(parent_id, metrics=[Metric(k, float(v), now, 0) for k, v in summary.items()])

    registered = None
    if best is None:
        client.set_terminated(parent_id, status="FAILED")
        errors = [str(r.error).strip().splitlines() for r in results if r.error is not None]
        first = next((e[-1] for e in errors if e), "")
        raise ValueError(f"sweep {name}: no trial reported {metric}" + (f" (last line of the first error: {first})" if first else ""))
    client.set_tag(parent_id, "satp.best_trial", best.trial_id)
    if best.run_id:
        client.set_tag(parent_id, "satp.best_run_id", best.run_id)
    if tune_cfg.register_best:
        done = client.get_run(parent_id).data.tags.get(REGISTERED_TAG)
        name_reg = job.mlflow.registered_model or f"sat-{task_name}"
        if done and done.split("/")[0] == best.trial_id:  # a rerun of a finished sweep: registered already
            version = int(done.split("/")[1])
            registered = {"registered_model": name_reg, "version": version,
                          "registered_uri": f"models:/{name_reg}/{version}", "champion": None,
                          "reason": "registered by an earlier run of this sweep"}
        else:
            registered = register_best(job, best, task_metric_name=m, mode=task_mode, tracking_uri=tracking_uri,
                                       alias=tune_cfg.champion_alias, sweep_name=name, parent_run_id=parent_id)
            client.set_tag(parent_id, REGISTERED_TAG, f"{best.trial_id}/{registered['version']}")
            client.set_tag(parent_id, "satp.registered_uri", registered["registered_uri"])
    client.set_terminated(parent_id, status="FINISHED")
    return SweepOutcome(name=name, path=str(sweep_dir), metric=metric, mode=mode, trials=trials, best=best,
                        parent_run_id=parent_id, tracking_uri=tracking_uri, registered=registered, resumed=resumed,
                        seconds=time.time() - start)


def format_outcome(outcome: SweepOutcome) -> str:
    lines = [f"sweep {outcome.name}{' (resumed)' if outcome.resumed else ''}: {plural(len(outcome.trials), 'trial')}, "
             f"{len(outcome.early_stopped)} stopped early by ASHA, {outcome.seconds:.0f} s"]
    for t in sorted(outcome.trials, key=lambda t: t.trial_id):
        shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in t.config.items() if not k.startswith("__")}
        best = "-" if t.best is None else f"{t.best:.4f}"
        lines.append(f"  {t.trial_id:<14} {t.status:<14} epochs {t.epochs:<3} best {outcome.metric} {best}  {shown}")
    if outcome.interrupted:
        lines.append(f"interrupted: rerun the same command to resume the sweep ({outcome.path})")
    if outcome.best is not None:
        lines.append(f"best trial {outcome.best.trial_id}: {outcome.metric} {outcome.best.best:.4f}")
    reg = outcome.registered
    if reg:
        verdict = {True: "now the champion; ", False: "champion unchanged; ", None: ""}[reg.get("champion")]
        lines.append(f"registered {reg['registered_uri']} ({verdict}{reg.get('reason')})")
    lines.append(f"MLflow parent run {outcome.parent_run_id} ({outcome.tracking_uri})")
    return "\n".join(lines)
