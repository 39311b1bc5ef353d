"""ASHA hyperparameter sweeps of a job (``satp tune JOB.yaml``), logged to MLflow.

:func:`run_sweep` reads the job's ``tune:`` section (:mod:`pipeline.config.tune`)
and runs a Ray Tune ``Tuner`` whose trials are full Ray Train runs (the Train V2
pattern: a Tune function, :func:`_trial`, builds and fits the ``TorchTrainer``
through :func:`pipeline.train.driver.train_job`, with Tune's ``TuneReportCallback`` in
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
  their last checkpoints, and MLflow runs are found again by their tags. The
  sweep records the job it runs in its folder: a rerun of another job is
  refused before Ray starts, and ``restart`` starts the sweep over
  (:mod:`pipeline.sweep.record`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.config import JobConfig
from pipeline.config.names import check_names
from pipeline.config.tune import TuneConfig, split_key
from pipeline.console import plural
from pipeline.registry import tracking
from pipeline.registry.versions import better, default_model_name
from pipeline.sweep import record
from pipeline.sweep.mlflow_logging import (SWEEP_KEY_TAG, TRIAL_TAG, SweepLogger, catch_up_metrics,
                                           open_parent_run, retire_sweep_runs)
from pipeline.sweep.registration import REGISTERED_TAG, register_best
from pipeline.sweep.space import apply_config, base_job_dict, data_variants, resolve_paths, space_jobs, task_metric, variant_key
from pipeline.sweep.summary import SweepOutcome, plot_sweep, saved_states, summarize
from pipeline.sweep.trials import (TIME_ATTR, SweepContext, fit_trials, hold_sweep, report_callback, sweep_storage,
                                   trial_job, trial_trainable)

log = logging.getLogger(__name__)


def _trial(config: dict[str, Any], ctx: SweepContext) -> None:
    """A Tune trial: one full Ray Train run of the job with ``config`` applied."""
    import time

    import ray.tune

    started = time.time()  # the trial's start-up counts from here (its process may have started long before)
    from pipeline.train.driver import train_job

    from pipeline.train.plan import run_dir

    trial_id = ray.tune.get_context().get_trial_id()
    job = trial_job(ctx, config, trial_id)
    shard_dir = ctx.shard_dirs[variant_key(config, ctx.data_keys)]
    train_job(job, shard_dir=shard_dir, register=False, callbacks=[report_callback(str(run_dir(job)))],
              started_at=started)


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
    workers = job.resources.max_workers
    for key, dist in tune_cfg.space.items():
        if "resources.num_workers" in split_key(key):
            workers = max(int(v) for v in dist.candidates())
    return workers


def run_sweep(job: JobConfig, *, address: Optional[str] = None, verbose: int = 1, restart: bool = False) -> SweepOutcome:
    """Run (or resume) the ASHA sweep of ``job.tune``; see the module docstring. ``restart``: start
    over a sweep that ran another job (:mod:`pipeline.sweep.record`)."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from pipeline.train.plan import resolve_job, store_env
    from runtime.storage import absolute, ray_storage

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
    if not job.mlflow.enabled:
        raise ValueError("tune: the sweep logs to MLflow; mlflow.enabled must be true")
    name = tune_cfg.name or f"{job.name}-sweep"
    settings = job.storage.settings()
    storage = sweep_storage(tune_cfg.storage_path, job, "tune.storage_path")
    sweep_dir = f"{storage}/{name}"
    with hold_sweep(sweep_dir, name, "satp tune", "tune.name", settings):  # one writer per sweep, like a run
        base = resolve_paths(base_job_dict(job))
        base["mlflow"]["enabled"] = False
        ran = record.recorded_job(base, "tune", tune_cfg.model_dump(mode="json"))
        record.check_rerun(sweep_dir, ran, what="sweep", name=name, key="tune.name", restart=restart,  # before Ray
                           storage=settings)
        tracking_uri = job.mlflow.tracking_uri
        from pipeline.registry.addresses import check_reachable

        check_reachable(tracking_uri)  # fail fast, before any preprocessing or trial

        # the pre-flight of satp train, for every variant of the space: config, data roots, the Ray
        # address (connected here), the cluster against one trial's request (its largest worker count)
        from pipeline.train.preflight import preflight

        preflight(space, address=address, num_workers=max_workers(job, tune_cfg), extra_cpus=tune_cfg.trial_cpus,
                  ray_env={"OUTDATED_IGNORE": "1", "RAY_USAGE_STATS_ENABLED": "0", **store_env(job)})

        # preprocessing variants, built once here
        import preprocessing
        from preprocessing.config import DataConfig, ShardConfig, TransformConfig

        variants = data_variants(job)
        data_keys = sorted(variants[0]) if variants else []
        shard_dirs: dict[str, str] = {}
        for variant in variants:
            raw = apply_config(base, variant)
            out = preprocessing.preprocess(DataConfig.model_validate(raw["data"]), TransformConfig.model_validate(raw["transform"]),
                                           ShardConfig.model_validate(raw["shards"]), address=address, storage=settings)
            shard_dirs[variant_key(variant, data_keys)] = absolute(out)
            log.info("shards for %s: %s", variant or "the job", out)

        ctx = SweepContext(name=name, base=base, shard_dirs=shard_dirs, data_keys=data_keys,
                           train_storage=f"{sweep_dir}/train", max_epochs=max_epochs)

        # MLflow: experiment and parent run before any trial starts (one writer: this process)
        client = tracking.client(tracking_uri)
        exp_id = tracking.ensure_experiment(client, job.mlflow.experiment, tracking_uri)
        sweep_key = sweep_dir
        record.start(sweep_dir, ran, restart, settings)
        if restart:
            retire_sweep_runs(client, exp_id, sweep_key, "sweep started over (--restart)")
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
                    name=name, **ray_storage(storage, settings, "tune.storage_path"),
                    failure_config=tune.FailureConfig(max_failures=tune_cfg.max_failures),
                    callbacks=[SweepLogger(tracking_uri, exp_id, parent_id, sweep_key, ctx, max_epochs)],
                    verbose=verbose,
                ),
            )

        results, resumed = fit_trials(sweep_dir, trainable, new_tuner, client, parent_id, settings)

        trials = summarize(results, metric, mode, val_metric, max_epochs, saved_states(sweep_dir, settings), settings)
        for t in trials:
            found = tracking.find_run(client, exp_id, {SWEEP_KEY_TAG: sweep_key, TRIAL_TAG: t.trial_id})
            t.run_id = found.info.run_id if found is not None else None
            t.config = {**t.config, "__shard_dir__": shard_dirs[variant_key(t.config, data_keys)],
                        "__job__": trial_job(ctx, {k: v for k, v in t.config.items() if not k.startswith("__")},
                                             t.trial_id).model_dump(mode="json")}
        for t in trials:
            if t.run_id and t.checkpoint_path:
                catch_up_metrics(client, t.run_id, t.checkpoint_path, settings)
        if any(t.status == "interrupted" for t in trials):
            client.set_tag(parent_id, "satp.interrupted", "true")
            client.set_terminated(parent_id, status="KILLED")
            return SweepOutcome(name=name, path=sweep_dir, metric=metric, mode=mode, trials=trials, best=None,
                                parent_run_id=parent_id, tracking_uri=tracking_uri, registered=None, resumed=resumed,
                                seconds=time.time() - start, interrupted=True)
        ok = [t for t in trials if t.status != "error" and t.best is not None]
        best = None
        for t in ok:
            if best is None or better(t.best, best.best, mode):
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
            name_reg = default_model_name(job, task_name)
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
        return SweepOutcome(name=name, path=sweep_dir, metric=metric, mode=mode, trials=trials, best=best,
                            parent_run_id=parent_id, tracking_uri=tracking_uri, registered=registered, resumed=resumed,
                            seconds=time.time() - start)


def format_outcome(outcome: SweepOutcome) -> str:
    lines = [f"sweep {outcome.name}{' (resumed)' if outcome.resumed else ''}: {plural(len(outcome.trials), 'trial')}, "
             f"{len(outcome.early_stopped)} stopped early by ASHA, {outcome.seconds:.0f} s"]
    for t in sorted(outcome.trials, key=lambda t: t.trial_id):
        shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in t.config.items() if not k.startswith("__")}
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
