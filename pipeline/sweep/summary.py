"""What a sweep found: one :class:`TrialSummary` per trial (status, epochs, best metric, validation
curve, checkpoint) read from Tune's results and saved state, the :class:`SweepOutcome`, and the
plot of every trial's validation curve with ASHA's early stops marked."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from pipeline.registry import tracking
from pipeline.registry.versions import better, finite_float

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrialSummary:
    trial_id: str
    config: dict[str, Any]
    status: str  # finished | early_stopped | error | interrupted (not finished when the sweep stopped)
    epochs: int
    best: Optional[float]  # the sweep metric at its best epoch
    best_val: Optional[float]  # best_val_<task metric> (the registered model's)
    best_test: Optional[float]
    curves: dict[str, list[tuple[int, float]]]  # "val", "test" (the task metric), "train_loss": (epoch, value)
    checkpoint_path: Optional[str]
    run_id: Optional[str] = None
    seconds: Optional[float] = None  # the trial's wall time (Tune's time_total_s)

    @property
    def curve(self) -> list[tuple[int, float]]:
        return self.curves.get("val", [])

    @property
    def variant(self) -> str:  # of a comparison's trial
        return str(self.config.get("variant"))

    @property
    def seed(self) -> int:
        return int(self.config.get("train.seed", 0))


@dataclasses.dataclass(kw_only=True)
class TrialsOutcome:
    """What ``satp tune`` and ``satp compare`` return: the trials, and where they ran and were logged."""

    name: str
    path: str  # the Tune experiment directory
    metric: str
    trials: list[TrialSummary]
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    resumed: bool
    seconds: float
    interrupted: bool = False


@dataclasses.dataclass(kw_only=True)
class SweepOutcome(TrialsOutcome):
    mode: str
    best: Optional[TrialSummary]
    registered: Optional[dict[str, Any]]  # registered_uri, version, champion (bool), reason

    @property
    def early_stopped(self) -> list[TrialSummary]:
        return [t for t in self.trials if t.status == "early_stopped"]


def saved_states(path: str | Path, storage=None) -> dict[str, str]:
    """Trial states in the sweep's saved experiment state: after Ctrl-C Tune marks the stopped trials
    TERMINATED in memory, but saves them as PENDING/RUNNING so that ``Tuner.restore`` resumes them."""
    try:
        from ray.tune import ExperimentAnalysis

        from runtime.storage import ray_storage

        where = ray_storage(str(path), storage, "tune.storage_path")
        analysis = ExperimentAnalysis(where["storage_path"], storage_filesystem=where.get("storage_filesystem"))
        return {t.trial_id: t.status for t in analysis.trials}
    except Exception as exc:  # unreadable state: trust the in-memory results
        log.debug("no saved experiment state at %s: %s", path, exc)
        return {}


def summarize(results, metric: str, mode: str, val_metric: str, max_epochs: int,
              states: Optional[dict[str, str]] = None, storage=None) -> list[TrialSummary]:
    """The trials of Tune's ``results`` (``states``: :func:`saved_states`)."""
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
        best_val = best_test = None
        checkpoint_path = seconds = None
        by_epoch: dict[int, dict] = {}
        for row in (df.to_dict("records") if df is not None and len(df) else []):
            epoch = row.get("epoch")
            if epoch is None or (isinstance(epoch, float) and math.isnan(epoch)):
                continue
            by_epoch[int(epoch)] = row
            seconds = float(row["time_total_s"]) if _finite(row.get("time_total_s")) else seconds
            if row.get("checkpoint_path") and isinstance(row.get("checkpoint_path"), str):
                checkpoint_path = row["checkpoint_path"]
                best_val = row.get(f"best_{val_metric}", best_val)
                best_test = row.get(f"best_{val_metric.replace('val_', 'test_', 1)}", best_test)
        for row in checkpoint_history(checkpoint_path, storage):  # checkpointed epochs whose report never reached Tune
            by_epoch.setdefault(int(row["epoch"]), row)
        epochs = max(by_epoch, default=-1) + 1
        keys = {"val": val_metric, "test": val_metric.replace("val_", "test_", 1), "train_loss": "train_loss"}
        curves = {name: [(e, float(r[k])) for e, r in sorted(by_epoch.items()) if _finite(r.get(k))]
                  for name, k in keys.items()}
        best = None
        for _, row in sorted(by_epoch.items()):
            if _finite(row.get(metric)) and (best is None or better(row[metric], best, mode)):
                best = float(row[metric])
        if result.error is not None or states.get(tid) == "ERROR":
            status = "error"
        elif states.get(tid, "TERMINATED") != "TERMINATED":
            status = "interrupted"
        elif epochs < max_epochs:
            status = "early_stopped"
        else:
            status = "finished"
        config = dict(result.config or (trial.config if trial is not None else {}) or {})
        out.append(TrialSummary(tid, config, status, epochs, best, finite_float(best_val), finite_float(best_test),
                                curves, checkpoint_path, seconds=seconds))
    return out


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def checkpoint_history(checkpoint_path: Optional[str], storage=None) -> list[dict]:
    """Every epoch of a trial's Train run, as its last checkpoint records them (``state.json``):
    Tune's results miss the epochs reported just before an interruption, never reported again."""
    if not checkpoint_path:
        return []
    from pipeline.train import checkpoint as ckpt

    try:
        manager, name = ckpt.checkpoint_at(checkpoint_path, storage)
        history = manager.state(name).get("history") or []
    except (ValueError, OSError):
        return []
    return [row for row in history if isinstance(row, dict) and isinstance(row.get("epoch"), int)]


def plot_sweep(trials: list[TrialSummary], val_metric: str, path: str | os.PathLike, title: str = "") -> None:
    """Every trial's validation curve; an early stop is marked with a red cross at its last epoch."""
    fig, ax = tracking.subplots(figsize=(8, 5))
    for t in trials:
        if not t.curve:
            continue
        xs, ys = zip(*t.curve)
        style = "--" if t.status != "finished" else "-"
        ax.plot(xs, ys, style, marker="o", markersize=3, label=f"{t.trial_id} ({t.status})")
        if t.status == "early_stopped":
            ax.plot(xs[-1], ys[-1], "x", color="red", markersize=10, markeredgewidth=2)
    ax.plot([], [], "x", color="red", markersize=10, markeredgewidth=2, label="stopped early (ASHA)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(val_metric)
    ax.set_title(title or f"{val_metric} per trial")
    ax.legend(fontsize=7, loc="best")
    tracking.save_figure(fig, path)
