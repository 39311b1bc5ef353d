"""Variants of a job compared at equal budget over seeds (``satp compare JOB.yaml``), on Ray Tune + MLflow.

:func:`run_compare` runs a Tune grid over variant x seed, each trial a full Ray Train run to the last
epoch. A trial's result is its test metric at its best validation epoch; per variant, the mean and the
sample standard deviation over seeds go to the parent run, with ``compare.md``, ``plots/compare.png``
and ``trials.json``. The default name ends in a hash of job, variants and seeds: a rerun resumes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.config import JobConfig
from pipeline.config.names import check_names
from pipeline.console import plural
from pipeline.registry import tracking
from pipeline.sweep.runner import run_trials
from pipeline.sweep.summary import TrialsOutcome, TrialSummary
from pipeline.sweep.space import apply_config, base_job_dict, resolve_paths, task_metric, validate_raw, variant_key
from pipeline.sweep.trials import VARIANT

log = logging.getLogger(__name__)

SEED = "train.seed"


def variant_jobs(job: JobConfig, raw: Optional[dict] = None) -> dict[str, JobConfig]:
    """Every variant's job (with the first seed), built on ``raw`` (default: the job as a dict,
    :func:`pipeline.sweep.space.base_job_dict`); a one-line error names a variant that gives an invalid job."""
    if job.compare is None:
        raise ValueError(f"job {job.name!r} has no compare: section")
    check_names(job)  # compare.name is a folder: before anything is written under it
    raw = base_job_dict(job) if raw is None else raw
    seed = job.compare.seeds[0]
    return {name: validate_raw(apply_config(raw, {**overrides, SEED: seed}), f"compare.variants.{name}")
            for name, overrides in job.compare.variants.items()}


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass
class VariantSummary:
    name: str
    overrides: dict[str, Any]
    seeds: list[int]  # of the trials that finished
    test: list[float]
    val: list[float]
    parameters: Optional[int]
    seconds: Optional[float]  # mean trial wall time

    @staticmethod
    def _mean_std(values: list[float]) -> tuple[float, float]:
        """Mean and sample standard deviation (ddof 1); NaN where undefined."""
        mean = statistics.fmean(values) if values else float("nan")
        return mean, statistics.stdev(values) if len(values) > 1 else float("nan")

    @property
    def test_mean_std(self) -> tuple[float, float]:
        return self._mean_std(self.test)

    @property
    def val_mean_std(self) -> tuple[float, float]:
        return self._mean_std(self.val)


@dataclasses.dataclass(kw_only=True)
class CompareOutcome(TrialsOutcome):  # metric: the task metric (acc, f1)
    epochs: int
    variants: list[VariantSummary]


def summarize_variants(job: JobConfig, trials: list[TrialSummary], parameters: dict[str, Optional[int]]) -> list[VariantSummary]:
    out = []
    for name, overrides in job.compare.variants.items():
        done = sorted((t for t in trials if t.variant == name and t.status == "finished" and t.best_test is not None),
                      key=lambda t: t.seed)
        times = [t.seconds for t in done if t.seconds is not None]
        out.append(VariantSummary(name, overrides, [t.seed for t in done], [t.best_test for t in done],
                                  [t.best_val for t in done if t.best_val is not None], parameters.get(name),
                                  sum(times) / len(times) if times else None))
    return out


def _pm(mean: float, std: float, scale: float = 1.0) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean * scale:.4f}" + ("" if math.isnan(std) else f" ± {std * scale:.4f}")


def format_table(outcome: CompareOutcome) -> str:
    """The comparison as a markdown table (one row per variant)."""
    m = outcome.metric
    lines = [f"| variant | settings | params | test {m} (mean ± std) | val {m} (mean ± std) | test {m} per seed "
             f"| trial time |",
             "|---|---|---|---|---|---|---|"]
    for v in outcome.variants:
        settings = ", ".join(f"{k}={json.dumps(val)}" for k, val in v.overrides.items()) or "(the job)"
        per_seed = ", ".join(f"{s}: {t:.4f}" for s, t in zip(v.seeds, v.test)) or "-"
        params = f"{v.parameters:,}" if v.parameters else "-"
        seconds = f"{v.seconds:.0f} s" if v.seconds else "-"
        lines.append(f"| {v.name} | {settings} | {params} | {_pm(*v.test_mean_std)} | {_pm(*v.val_mean_std)} "
                     f"| {per_seed} | {seconds} |")
    failed = [t for t in outcome.trials if t.status != "finished"]
    note = f"{plural(len(outcome.trials), 'trial')}, {plural(outcome.epochs, 'epoch')} each"
    if failed:
        note += "; not finished: " + ", ".join(f"{t.variant}-seed{t.seed} ({t.status})" for t in failed)
    return "\n".join(lines + ["", note + ". Test metric at each trial's best validation epoch; std over seeds (ddof 1)."])


def plot_compare(outcome: CompareOutcome, path: str | Path) -> None:
    """Bars (test metric mean ± std, each seed a dot), validation curves and training losses."""
    m = outcome.metric
    fig, axes = tracking.subplots(1, 3, figsize=(15, 4.5))
    colors = {v.name: f"C{i}" for i, v in enumerate(outcome.variants)}
    names = [v.name for v in outcome.variants]
    means = [v.test_mean_std[0] for v in outcome.variants]
    stds = [0.0 if math.isnan(v.test_mean_std[1]) else v.test_mean_std[1] for v in outcome.variants]
    ax = axes[0]
    ax.bar(range(len(names)), [0.0 if math.isnan(x) else x for x in means], yerr=stds, capsize=6,
           color=[colors[n] for n in names], alpha=0.7)
    for i, v in enumerate(outcome.variants):
        ax.plot([i] * len(v.test), v.test, "o", color="black", markersize=4)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel(f"test {m} at best val epoch")
    ax.set_title(f"{outcome.name}: mean ± std over seeds")
    finite = [x for x in means if not math.isnan(x)]
    if finite:
        lo = min(min(v.test) for v in outcome.variants if v.test)
        ax.set_ylim(max(0.0, lo - 0.1 * (max(finite) - lo + 1e-3) - 0.02), None)
    for ax, key, label in ((axes[1], "val", f"val {m}"), (axes[2], "train_loss", "train loss")):
        for t in outcome.trials:
            if t.curves.get(key):
                xs, ys = zip(*t.curves[key])
                ax.plot(xs, ys, "-", color=colors.get(t.variant, "grey"), alpha=0.8, linewidth=1)
        for n in names:
            ax.plot([], [], "-", color=colors[n], label=n)
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.set_title(f"{label} per trial")
        ax.legend(fontsize=8)
    tracking.save_figure(fig, path)


def count_parameters(job: JobConfig, shard_dir: str) -> Optional[int]:
    """Parameters of the variant's model, as :func:`pipeline.train.plan.worker_setup` configures it (built in the
    driver by :func:`pipeline.train.engine.build_model`, which keeps PyG's generated modules in memory)."""
    from pipeline.train.plan import worker_setup
    from pipeline.train.engine import build_model
    from sat.config import SATConfig

    try:
        model = build_model(SATConfig.from_dict(worker_setup(job, shard_dir).model_config))
    except ValueError:
        return None
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- the comparison
def comparison_digest(base: dict, cmp) -> str:
    """Hash of what decides a comparison's results: the job (paths resolved) and the variants and seeds."""
    import hashlib

    keyed = {"job": base, "variants": cmp.variants, "seeds": cmp.seeds}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()


def run_compare(job: JobConfig, *, address: Optional[str] = None, verbose: int = 1,
                restart: bool = False) -> CompareOutcome:
    """Run (or resume) the comparison of ``job.compare``; see the module docstring. ``restart``:
    start over a comparison that ran another job (:mod:`pipeline.sweep.record`)."""
    from ray import tune

    from pipeline.train.plan import resolve_job

    start = time.time()
    jobs = variant_jobs(job)  # a job without a compare: section stops here
    cmp = job.compare
    _, m, mode = task_metric(job)
    job = resolve_job(job)
    base = resolve_paths(base_job_dict(job))
    base["mlflow"]["enabled"] = False
    digest = comparison_digest(base, cmp)
    name = cmp.name or f"{job.name}-compare-{digest[:8]}"
    shard_jobs = {variant_key({VARIANT: vname}, [VARIANT]): v for vname, v in variant_jobs(job, base).items()}
    # no scheduler: every trial asks for the same resources and runs to its end, so a trial's process
    # (its imports done) goes on to the next trial; ASHA's stopped trials would not leave theirs
    grid = {VARIANT: tune.grid_search(list(cmp.variants)), SEED: tune.grid_search(list(cmp.seeds))}
    with run_trials(job, "compare", name, base, {f"compare.variants.{v}": vjob for v, vjob in jobs.items()},
                    shard_jobs, [VARIANT], param_space=grid, metric=f"val_{m}", mode=mode, val_metric=f"val_{m}",
                    max_epochs=job.train.epochs, address=address, restart=restart, verbose=verbose,
                    trial_variants=cmp.variants, num_samples=1, reuse_actors=True) as run:
        client, parent_id = run.client, run.parent_id
        shard_dirs = run.ctx.shard_dirs
        parameters = {v: count_parameters(vjob, shard_dirs[variant_key({VARIANT: v}, [VARIANT])])
                      for v, vjob in jobs.items()}
        trials = run.trials
        for t in trials:
            if t.run_id is not None:
                client.set_tag(t.run_id, "mlflow.runName", f"{t.variant}-seed{t.seed}")
                client.set_tag(t.run_id, "satp.variant", t.variant)
        outcome = CompareOutcome(name=name, path=run.path, metric=m, epochs=job.train.epochs,
                                 variants=summarize_variants(job, trials, parameters), trials=trials,
                                 parent_run_id=parent_id, tracking_uri=run.tracking_uri, resumed=run.resumed,
                                 seconds=time.time() - start, interrupted=run.interrupted)

        values: dict[str, float] = {}
        for v in outcome.variants:
            for split, (mean, std) in (("test", v.test_mean_std), ("val", v.val_mean_std)):
                values[f"{v.name}.{split}_{m}_mean"] = mean
                values[f"{v.name}.{split}_{m}_std"] = std
        tracking.log_metrics(client, parent_id, values, step=0)
        table = format_table(outcome)
        with tempfile.TemporaryDirectory() as tmp:
            client.log_text(parent_id, f"# {name}\n\n{table}\n", "compare.md")
            png = Path(tmp) / "compare.png"
            plot_compare(outcome, png)
            client.log_artifact(parent_id, str(png), artifact_path="plots")
            rows = [dataclasses.asdict(t) for t in trials]
            client.log_text(parent_id, json.dumps(rows, indent=1, default=str), "trials.json")
        if not outcome.interrupted:
            failed = all(t.status != "finished" for t in trials)
            client.set_terminated(parent_id, status="FAILED" if failed else "FINISHED")
        return outcome


def format_outcome(outcome: CompareOutcome) -> str:
    lines = [f"comparison {outcome.name}{' (resumed)' if outcome.resumed else ''}: "
             f"{plural(len(outcome.variants), 'variant')}, {plural(len(outcome.trials), 'trial')}, "
             f"{outcome.seconds:.0f} s", "", format_table(outcome), ""]
    lines.append(f"MLflow parent run {outcome.parent_run_id} ({outcome.tracking_uri}): compare.md, plots/compare.png")
    return "\n".join(lines)
