"""The driver's part shared by ``satp tune`` and ``satp compare``: under the sweep folder's lease, the
rerun check, the pre-flight of every variant, each distinct preprocessing built once, the MLflow parent
run, the Tune run of the trials (resumed when interrupted), and their summaries with their MLflow runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Mapping

from pipeline.config import JobConfig
from pipeline.registry import tracking
from pipeline.sweep import record
from pipeline.sweep.mlflow_logging import SWEEP_KEY_TAG, TRIAL_TAG, SweepLogger, retire_sweep_runs
from pipeline.sweep.summary import TrialSummary, saved_states, summarize
from pipeline.sweep.trials import SweepContext, fit_trials, hold_sweep, sweep_storage, trial_trainable

log = logging.getLogger(__name__)

#: what each section's command is called in its messages
WHAT = {"tune": "sweep", "compare": "comparison"}


@dataclasses.dataclass
class TrialsRun:
    """A sweep's trials, fitted: what the command sums up (still holding the folder's lease)."""

    name: str
    path: str  # the sweep's folder (Tune's experiment directory)
    ctx: SweepContext
    client: Any
    parent_id: str
    tracking_uri: str
    results: Any  # Tune's ResultGrid
    resumed: bool
    trials: list[TrialSummary]

    @property
    def interrupted(self) -> bool:
        return any(t.status == "interrupted" for t in self.trials)


def concurrency_cap(jobs: list[JobConfig], trial_cpus: float, cluster: dict[str, float]) -> int:
    """How many trials the cluster's resources run at once (each as the largest of ``jobs`` asks)."""
    need = {"CPU": max(j.resources.max_workers * j.resources.cpus_per_worker for j in jobs) + trial_cpus,
            "GPU": max(j.resources.max_workers * j.resources.gpus_per_worker if j.resources.use_gpu else 0
                       for j in jobs)}
    caps = [int(cluster.get(k, 0) // v) for k, v in need.items() if v > 0]
    return max(1, min(caps)) if caps else 1


@contextlib.contextmanager
def run_trials(job: JobConfig, section: str, name: str, base: dict, jobs: Mapping[str, JobConfig] | list[JobConfig],
               variants: dict[str, JobConfig], data_keys: list[str], *, param_space: dict, metric: str, mode: str,
               val_metric: str, max_epochs: int, address, restart: bool, verbose: int, seed=None,
               trial_variants=None, **tune_options) -> Iterator[TrialsRun]:
    """Run (or resume) the trials of ``job``'s ``section`` in the folder ``name`` and yield them, the
    folder's lease held until the block ends. ``base``: the job as a dict, paths resolved, MLflow off;
    ``jobs``: every variant, pre-flighted; ``variants``: the shard key of each preprocessing (see
    :func:`pipeline.sweep.space.variant_key` of ``data_keys``) -> its job; ``trial_variants``: see
    :class:`pipeline.sweep.trials.SweepContext`; ``tune_options``: more of Tune's ``TuneConfig``."""
    import ray
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    import preprocessing
    from pipeline.registry.addresses import check_reachable
    from pipeline.train.plan import store_env
    from pipeline.train.preflight import connect_and_check, early_checks
    from preprocessing.config import config_hash
    from runtime.storage import absolute, ray_storage

    cfg, what, key = getattr(job, section), WHAT[section], f"{section}.name"
    if not job.mlflow.enabled:
        raise ValueError(f"{section}: the {what} logs to MLflow; mlflow.enabled must be true")
    settings = job.storage.settings()
    storage = sweep_storage(cfg.storage_path, job, f"{section}.storage_path")
    sweep_dir = f"{storage}/{name}"
    with hold_sweep(sweep_dir, name, f"satp {section}", key, settings):  # one writer per sweep, like a run
        ran = record.recorded_job(base, section, cfg.model_dump(mode="json"))
        record.check_rerun(sweep_dir, ran, what=what, name=name, key=key, restart=restart, storage=settings)  # before Ray
        tracking_uri = job.mlflow.tracking_uri
        check_reachable(tracking_uri)  # fail fast, before any preprocessing or trial
        listed = list(jobs.values()) if isinstance(jobs, Mapping) else list(jobs)
        trial = {"num_workers": max(j.resources.max_workers for j in listed), "extra_cpus": cfg.trial_cpus}
        early_checks(jobs, address=address, **trial)
        connect_and_check(jobs, address=address, ray_env={"OUTDATED_IGNORE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                                                           **store_env(job)}, **trial)

        built: dict[str, str] = {}  # every distinct preprocessing once, here: the trials only read shards
        shard_dirs: dict[str, str] = {}
        for variant, v in variants.items():
            digest = config_hash(v.data, v.transform, v.shards) + v.shards.root
            if digest not in built:
                built[digest] = absolute(preprocessing.preprocess(v.data, v.transform, v.shards, address=address,
                                                                  storage=settings))
                log.info("shards for %s: %s", variant, built[digest])
            shard_dirs[variant] = built[digest]
        ctx = SweepContext(name=name, base=base, shard_dirs=shard_dirs, data_keys=data_keys,
                           train_storage=f"{sweep_dir}/train", max_epochs=max_epochs, variants=trial_variants or {})

        client = tracking.client(tracking_uri)  # the parent run before any trial starts (one writer: this process)
        exp_id = tracking.ensure_experiment(client, job.mlflow.experiment, tracking_uri)
        record.start(sweep_dir, ran, restart, settings)
        if restart:
            retire_sweep_runs(client, exp_id, sweep_dir, f"{what} started over (--restart)")
        kind = "sweep" if section == "tune" else "compare"  # the parent run's satp.kind
        parent_id, _ = tracking.reopen_run(client, exp_id, {SWEEP_KEY_TAG: sweep_dir, "satp.kind": kind}, name,
                                           {**base, section: cfg.model_dump(mode="json")})

        cluster = ray.cluster_resources()
        cap = concurrency_cap(listed, cfg.trial_cpus, cluster)
        concurrent = min(cap, cfg.max_concurrent_trials or cap)
        log.info("%s %s: at most %d trials at once (cluster %s)", what, name, concurrent,
                 {k: cluster.get(k) for k in ("CPU", "GPU") if k in cluster})
        trainable = trial_trainable(ctx, cfg.trial_cpus)

        def new_tuner():
            return tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=metric, mode=mode, **tune_options,
                    # the searcher caps concurrency (Tune ignores max_concurrent_trials with a generator)
                    search_alg=BasicVariantGenerator(random_state=seed, max_concurrent=concurrent),
                ),
                run_config=tune.RunConfig(
                    name=name, **ray_storage(storage, settings, f"{section}.storage_path"),
                    failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
                    callbacks=[SweepLogger(tracking_uri, exp_id, parent_id, sweep_dir, ctx)],
                    verbose=verbose,
                ),
            )

        results, resumed = fit_trials(sweep_dir, trainable, new_tuner, client, parent_id, settings)
        trials = summarize(results, metric, mode, val_metric, max_epochs, saved_states(sweep_dir, settings), settings)
        for t in trials:
            found = tracking.find_run(client, exp_id, {SWEEP_KEY_TAG: sweep_dir, TRIAL_TAG: t.trial_id})
            t.run_id = found.info.run_id if found is not None else None
        run = TrialsRun(name, sweep_dir, ctx, client, parent_id, tracking_uri, results, resumed, trials)
        yield run
        if run.interrupted:  # resumed by the same command; the command sets the status otherwise
            client.set_tag(parent_id, "satp.interrupted", "true")
            client.set_terminated(parent_id, status="KILLED")
