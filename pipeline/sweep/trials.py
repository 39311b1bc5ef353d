"""The trials of a sweep on the cluster: what each one needs (:class:`SweepContext`), its job, the
Tune trainable, the sweep's one writer (:func:`hold_sweep`), fitting or resuming the ``Tuner``, and
releasing the placement groups of stopped trials (Ray keeps them until the job ends)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from pipeline.config import JobConfig
from pipeline.sweep.space import apply_config, validate_raw, variant_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SweepContext:
    """What every trial needs (plain and picklable; shipped with ``tune.with_parameters``)."""

    name: str
    base: dict  # the job (paths absolute, MLflow off), without its tune and compare sections
    shard_dirs: dict[str, str]  # variant_key -> shard directory
    data_keys: list[str]
    train_storage: str  # the trials' Train runs live here
    max_epochs: int
    variants: dict[str, dict] = dataclasses.field(default_factory=dict)  # a comparison's: name -> its keys

    def settings(self, config: dict[str, Any]) -> dict[str, Any]:
        """The dotted keys a trial sets: its sampled ``config``, a comparison's variant as its keys."""
        return {**self.variants.get(config.get(VARIANT), {}), **{k: v for k, v in config.items() if k != VARIANT}}


#: a comparison's trial config names its variant under this key (not a key of the job)
VARIANT = "variant"


def run_trial(config: dict[str, Any], ctx: SweepContext) -> None:
    """A Tune trial: one full Ray Train run of the job with ``config`` applied."""
    started = time.time()  # the trial's start-up counts from here (its process may have started long before)
    import ray.tune

    from pipeline.train.driver import train_job
    from pipeline.train.plan import run_dir

    trial_id = ray.tune.get_context().get_trial_id()
    job = trial_job(ctx, config, trial_id)
    train_job(job, shard_dir=ctx.shard_dirs[variant_key(config, ctx.data_keys)], register=False,
              callbacks=[report_callback(str(run_dir(job)))], started_at=started)


def trial_job(ctx: SweepContext, config: dict[str, Any], trial_id: str) -> JobConfig:
    raw = apply_config(ctx.base, ctx.settings(config))
    raw["train"]["run_name"] = f"{ctx.name}-{trial_id}"
    raw["train"]["storage_path"] = ctx.train_storage
    raw["train"]["epochs"] = ctx.max_epochs
    raw["mlflow"]["enabled"] = False  # the driver's SweepLogger is the only MLflow writer
    return validate_raw(raw, f"trial {trial_id}")


#: ASHA's time unit: epochs completed, reported with every epoch's metrics. Not Tune's
#: ``training_iteration``: a resumed trial's Train run restarts from its last checkpoint, so its
#: iterations no longer count epochs.
TIME_ATTR = "epochs_done"


def report_callback(run: str):
    """Tune's ``TuneReportCallback`` (Train -> Tune metrics), adding :data:`TIME_ATTR` and the
    checkpoint as ``checkpoint_path`` in the trial's run folder ``run`` (a path, or a URI: Ray's path of
    a checkpoint on a store is the one in its file system, without the scheme)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and "epoch" not in metrics[0]:
                return  # a checkpoint within an epoch: Tune's iterations are epochs
            metrics = [dict(m, **{TIME_ATTR: int(m["epoch"]) + 1}) if "epoch" in m else m for m in metrics]
            if checkpoint is not None:
                metrics[0] = dict(metrics[0], checkpoint_path=f"{run}/{checkpoint.path.rstrip('/').rsplit('/', 1)[-1]}")
            super().after_report(run_context, metrics, None)

    return EpochReportCallback()


def trial_trainable(ctx: SweepContext, trial_cpus: float):
    """The Tune trainable of :func:`run_trial`; a resource request cannot be empty, so with
    ``trial_cpus`` 0 it asks for 1 MiB of Ray's logical memory."""
    from ray import tune

    resources = {"cpu": trial_cpus} if trial_cpus > 0 else {"cpu": 0, "memory": 2**20}
    return tune.with_resources(tune.with_parameters(run_trial, ctx=ctx), resources)


def sweep_storage(value: Optional[str], job, key: str) -> str:
    """The folder that holds a sweep's folder, an absolute path or a URI: ``value`` (named by ``key``),
    default ``<runs>/tune``; a URI is checked before anything is written."""
    from pipeline.config.train import runs_dir
    from pipeline.train.preflight import check_run_store
    from runtime.storage import absolute, is_uri

    if value and is_uri(value):
        check_run_store(key, value, job.storage.settings())
    return absolute(value or runs_dir() / "tune")


@contextlib.contextmanager
def hold_sweep(sweep_dir: str | Path, name: str, command: str, key: str, storage=None) -> Iterator[None]:
    """Hold the sweep's lease while the block runs (:class:`pipeline.train.lease.RunLease`,
    ``<sweep_dir>/satp-lease.json``): two sweeps of one name would share Tune's state and the trials'
    runs, so the second is refused in one line naming the holder (``key``: the job key to change).
    The folders the lease created are removed again if the sweep wrote nothing into them."""
    from pipeline.train.lease import RunLease
    from runtime.interrupts import deferred
    from runtime.storage import is_uri

    created, node = [], Path(sweep_dir).absolute()
    while not is_uri(sweep_dir) and not node.exists() and node != node.parent:
        created.append(node)
        node = node.parent
    lease = RunLease(sweep_dir, name, command=command, kind="sweep", key=key, storage=storage).acquire()
    try:
        yield
    finally:
        with deferred():
            lease.release()
            for folder in created:  # deepest first; one that holds anything stays
                try:
                    folder.rmdir()
                except OSError:
                    break


class _NoRestoreHint(logging.Filter):
    """Drops Tune's "Resume experiment with: Tuner.restore(path=..., trainable=...)" after an
    interruption: ``satp tune`` resumes by the same command, and says so itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tuner.restore(" not in record.getMessage()


def fit_trials(sweep_dir: str | Path, trainable, new_tuner, client, parent_id: str, storage=None):
    """Fit the trials: a new ``Tuner`` (``new_tuner()``), or the interrupted one in ``sweep_dir``
    restored. Returns ``(results, resumed)``; any failure marks the parent run FAILED."""
    from ray import tune

    from runtime.storage import ray_storage

    where = ray_storage(str(sweep_dir), storage, "tune.storage_path")
    place = {"path": where["storage_path"], "storage_filesystem": where.get("storage_filesystem")}
    resumed = tune.Tuner.can_restore(**place)
    tune_log, hint = logging.getLogger("ray.tune.tune"), _NoRestoreHint()
    tune_log.addFilter(hint)
    try:
        if resumed:
            log.info("resuming %s", sweep_dir)
            tuner = tune.Tuner.restore(**place, trainable=trainable, resume_unfinished=True, resume_errored=True)
        else:
            tuner = new_tuner()
        results = tuner.fit()
        release_after_sweep()
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(parent_id, status="FAILED")
        raise
    finally:
        tune_log.removeFilter(hint)
    return results, resumed


#: ids of this job's placement groups seen in use (see :func:`release_orphaned_placement_groups`)
_seen_in_use: set[str] = set()


def release_orphaned_placement_groups() -> tuple[int, int]:
    """Remove this job's placement groups that were in use and are entirely free now; return how
    many, and how many are in use. When ASHA stops a trial, Ray keeps its Train workers' placement
    group until the job ends, so its CPUs would stay reserved. Ray lists a group's resources as
    ``<resource>_group_<id>`` in ``ray.cluster_resources()`` and what is free of them in
    ``ray.available_resources()``: a group seen in use and entirely free later has lost its workers;
    one never seen in use is never touched; only this job's groups (their ids end with its id)."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    if not ray.is_initialized():
        return 0, 0
    try:
        job_id = ray.get_runtime_context().get_job_id()
        table = placement_group_table()
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception as exc:  # best effort: never fail a sweep over housekeeping
        log.debug("placement group table unavailable: %s", exc)
        return 0, 0
    removed = in_use = 0
    placed = set()
    for group_id, info in table.items():
        if info["state"] != "CREATED" or not group_id.endswith(job_id):
            continue
        held = {key: amount for key, amount in total.items() if key.endswith(f"_group_{group_id}")}
        if not held:
            continue
        placed.add(group_id)
        if any(free.get(key, 0.0) < amount for key, amount in held.items()):
            _seen_in_use.add(group_id)
            in_use += 1
        elif group_id in _seen_in_use:
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
                removed += 1
            except Exception as exc:
                log.debug("could not remove placement group %s: %s", group_id, exc)
    _seen_in_use.intersection_update(placed)
    if removed:
        log.info("released %d placement group(s) of stopped trials", removed)
    return removed, in_use


def release_after_sweep(timeout_s: float = 20.0) -> None:
    """After ``Tuner.fit``: wait (briefly) for the last trials' Train workers to end and release
    their placement groups, so that the cluster's resources are free again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, pending = release_orphaned_placement_groups()
        if not pending:
            return
        time.sleep(0.5)
