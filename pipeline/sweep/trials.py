"""The trials of a sweep on the cluster: what each one needs (:class:`SweepContext`), its job, the
Tune trainable, the sweep's one writer (:func:`hold_sweep`), fitting or resuming the ``Tuner``, and
releasing the placement groups of stopped trials (Ray keeps them until the job ends)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator

from pipeline.config import JobConfig
from pipeline.sweep.space import apply_config, validate_raw

log = logging.getLogger(__name__)


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
    return validate_raw(raw, f"trial {trial_id}")


#: ASHA's time unit: epochs completed, reported with every epoch's metrics. Not Tune's
#: ``training_iteration``: a resumed trial's Train run restarts from its last checkpoint, so its
#: iterations no longer count epochs.
TIME_ATTR = "epochs_done"


def report_callback():
    """Tune's ``TuneReportCallback`` (Train -> Tune metrics), adding :data:`TIME_ATTR`."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and "epoch" not in metrics[0]:
                return  # a checkpoint within an epoch: Tune's iterations are epochs
            metrics = [dict(m, **{TIME_ATTR: int(m["epoch"]) + 1}) if "epoch" in m else m for m in metrics]
            super().after_report(run_context, metrics, checkpoint)

    return EpochReportCallback()


def trial_trainable(trial_fn, ctx: SweepContext, trial_cpus: float):
    """The Tune trainable of ``trial_fn``. The Tune function only drives its Train run; a resource
    request cannot be empty, so with ``trial_cpus`` 0 it asks for 1 MiB of Ray's logical memory."""
    from ray import tune

    resources = {"cpu": trial_cpus} if trial_cpus > 0 else {"cpu": 0, "memory": 2**20}
    return tune.with_resources(tune.with_parameters(trial_fn, ctx=ctx), resources)


@contextlib.contextmanager
def hold_sweep(sweep_dir: Path, name: str, command: str, key: str) -> Iterator[None]:
    """Hold the sweep's lease while the block runs: one writer per sweep folder, as per run
    (:class:`pipeline.train.lease.RunLease`, ``<sweep_dir>/satp-lease.json``). Two sweeps of one
    name would share Tune's state and the trials' runs, and take each other's trial leases; the
    second is refused at once, in one line naming the holder (``key``: the job key to change), and
    a sweep whose holder died is taken over with one warning line. The folders the lease created
    are removed again if the sweep wrote nothing into them (its pre-flight failed)."""
    from pipeline.train.lease import RunLease
    from runtime.interrupts import deferred

    created, node = [], Path(sweep_dir).absolute()
    while not node.exists() and node != node.parent:
        created.append(node)
        node = node.parent
    lease = RunLease(sweep_dir, name, command=command, kind="sweep", key=key).acquire()
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


def fit_trials(sweep_dir: Path, trainable, new_tuner, client, parent_id: str):
    """Fit the trials: a new ``Tuner`` (``new_tuner()``), or the interrupted one in ``sweep_dir``
    restored. Returns ``(results, resumed)``; any failure marks the parent run FAILED."""
    from ray import tune

    resumed = tune.Tuner.can_restore(str(sweep_dir))
    tune_log, hint = logging.getLogger("ray.tune.tune"), _NoRestoreHint()
    tune_log.addFilter(hint)
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
    finally:
        tune_log.removeFilter(hint)
    return results, resumed


def release_orphaned_placement_groups(with_pending: bool = False):
    """Remove the placement groups of this job whose creating actor died; return how many.

    When ASHA stops a trial, Tune ends the trial's actor, which kills its Train controller
    (an owned actor) and the Train workers, but not the workers' placement group: Ray keeps a
    placement group until its job ends, so the CPUs would stay reserved and the next trials wait
    forever. satp's runs start no Train ``PlacementGroupCleaner`` (a process per run, which polls
    the State API and so needs a dashboard: :func:`pipeline.train.driver._trainer_class`); this
    releases them instead. Only this job's non-detached groups are touched.
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
