"""ASHA hyperparameter sweeps of a job (``satp tune JOB.yaml``), logged to MLflow.

:func:`run_sweep` runs the job's ``tune:`` section on the driver of :mod:`pipeline.sweep.runner`;
at the end the best trial is registered from its checkpoint, and the ``champion`` alias moves to it
only if it beats the current champion's validation metric.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Optional

from pipeline.config import JobConfig
from pipeline.config.names import check_names
from pipeline.console import plural
from pipeline.registry import tracking
from pipeline.registry.versions import better, default_model_name
from pipeline.sweep.mlflow_logging import catch_up_metrics
from pipeline.sweep.registration import REGISTERED_TAG, register_best
from pipeline.sweep.runner import run_trials
from pipeline.sweep.space import (apply_config, base_job_dict, data_variants, resolve_paths, space_jobs, task_metric,
                                  validate_raw, variant_key)
from pipeline.sweep.summary import SweepOutcome, plot_sweep
from pipeline.sweep.trials import TIME_ATTR

log = logging.getLogger(__name__)


def run_sweep(job: JobConfig, *, address: Optional[str] = None, verbose: int = 1, restart: bool = False) -> SweepOutcome:
    """Run (or resume) the ASHA sweep of ``job.tune``; see the module docstring. ``restart``: start
    over a sweep that ran another job (:mod:`pipeline.sweep.record`)."""
    from ray.tune.schedulers import ASHAScheduler

    from pipeline.train.plan import resolve_job

    start = time.time()
    if job.tune is None:
        raise ValueError(f"job {job.name!r} has no tune: section")
    check_names(job)  # tune.name is a folder: before anything is written under it
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
    name = tune_cfg.name or f"{job.name}-sweep"
    base = resolve_paths(base_job_dict(job))
    base["mlflow"]["enabled"] = False
    variants = data_variants(job)
    data_keys = sorted(variants[0])
    shard_jobs = {variant_key(v, data_keys): validate_raw(apply_config(base, v), f"tune.space {v}") for v in variants}
    scheduler = ASHAScheduler(time_attr=TIME_ATTR, max_t=max_epochs, grace_period=tune_cfg.asha.grace_period,
                              reduction_factor=tune_cfg.asha.reduction_factor, brackets=tune_cfg.asha.brackets)
    with run_trials(job, "tune", name, base, space, shard_jobs, data_keys,
                    param_space={key: dist.to_tune() for key, dist in tune_cfg.space.items()}, metric=metric,
                    mode=mode, val_metric=val_metric, max_epochs=max_epochs, address=address, restart=restart,
                    verbose=verbose, seed=tune_cfg.seed, scheduler=scheduler,
                    num_samples=tune_cfg.num_samples) as run:
        client, parent_id, settings, trials = run.client, run.parent_id, job.storage.settings(), run.trials
        outcome = SweepOutcome(name=name, path=run.path, metric=metric, mode=mode, trials=trials, best=None,
                               parent_run_id=parent_id, tracking_uri=run.tracking_uri, registered=None,
                               resumed=run.resumed, seconds=0.0)
        for t in trials:
            if t.run_id and t.checkpoint_path:
                catch_up_metrics(client, t.run_id, t.checkpoint_path, settings)
        if run.interrupted:
            return dataclasses.replace(outcome, seconds=time.time() - start, interrupted=True)
        best = None
        for t in trials:
            if t.status != "error" and t.best is not None and (best is None or better(t.best, best.best, mode)):
                best = t

        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "sweep_val_curves.png"
            plot_sweep(trials, val_metric, png, title=f"{name}: {val_metric} per trial ({plural(len(trials), 'trial')})")
            client.log_artifact(parent_id, str(png), artifact_path="plots")
            table = [{k: v for k, v in dataclasses.asdict(t).items() if k != "curves"} for t in trials]
            client.log_text(parent_id, json.dumps(table, indent=1, default=str), "trials.json")

        summary = {"trials": len(trials), "trials_early_stopped": sum(t.status == "early_stopped" for t in trials),
                   "trials_failed": sum(t.status == "error" for t in trials)}
        if best is not None:
            summary.update({f"best_{metric}": best.best, f"best_val_{m}": best.best_val, f"best_test_{m}": best.best_test})
        tracking.log_metrics(client, parent_id, summary, step=0)

        registered = None
        if best is None:
            client.set_terminated(parent_id, status="FAILED")
            errors = [str(r.error).strip().splitlines() for r in run.results if r.error is not None]
            first = next((e[-1] for e in errors if e), "")
            raise ValueError(f"sweep {name}: no trial reported {metric}" + (f" (last line of the first error: {first})" if first else ""))
        client.set_tag(parent_id, "satp.best_trial", best.trial_id)
        if best.run_id:
            client.set_tag(parent_id, "satp.best_run_id", best.run_id)
        if tune_cfg.register_best:
            done = client.get_run(parent_id).data.tags.get(REGISTERED_TAG)
            name_reg = default_model_name(job, task_name)
            if done and done.split("/")[0] == best.trial_id:  # a rerun of a finished sweep: registered already
                version = int(done.split("/")[1])
                registered = {"registered_model": name_reg, "version": version,
                              "registered_uri": f"models:/{name_reg}/{version}", "champion": None,
                              "reason": "registered by an earlier run of this sweep"}
            else:
                registered = register_best(job, best, run.ctx, task_metric_name=m, mode=task_mode,
                                           tracking_uri=run.tracking_uri, parent_run_id=parent_id)
                client.set_tag(parent_id, REGISTERED_TAG, f"{best.trial_id}/{registered['version']}")
                client.set_tag(parent_id, "satp.registered_uri", registered["registered_uri"])
        client.set_terminated(parent_id, status="FINISHED")
        return dataclasses.replace(outcome, best=best, registered=registered, seconds=time.time() - start)


def format_outcome(outcome: SweepOutcome) -> str:
    lines = [f"sweep {outcome.name}{' (resumed)' if outcome.resumed else ''}: {plural(len(outcome.trials), 'trial')}, "
             f"{len(outcome.early_stopped)} stopped early by ASHA, {outcome.seconds:.0f} s"]
    for t in sorted(outcome.trials, key=lambda t: t.trial_id):
        shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in t.config.items()}
        best = "-" if t.best is None else f"{t.best:.4f}"
        lines.append(f"  {t.trial_id:<14} {t.status:<14} epochs {t.epochs:<3} best {outcome.metric} {best}  {shown}")
    if outcome.best is not None:
        lines.append(f"best trial {outcome.best.trial_id}: {outcome.metric} {outcome.best.best:.4f}")
    reg = outcome.registered
    if reg:
        verdict = {True: "now the champion; ", False: "champion unchanged; ", None: ""}[reg.get("champion")]
        lines.append(f"registered {reg['registered_uri']} ({verdict}{reg.get('reason')})")
    lines.append(f"MLflow parent run {outcome.parent_run_id} ({outcome.tracking_uri})")
    return "\n".join(lines)
