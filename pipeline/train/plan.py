"""A training job resolved once, at the edge: :class:`JobPlan`, which every later step reads.

A plan is read-only: each stage makes the next one (``dataclasses.replace``); :meth:`JobPlan.decision`
is the one place that decides whether the run is finished, resumes or starts. This module imports
no more than the job's configuration: ``satp train`` reads a run's lease and checkpoints with it
before its heavy imports.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from pipeline.config import JobConfig
from pipeline.config.names import check_names
from pipeline.config.train import default_tracking_uri, runs_dir
from pipeline.train import rerun
from pipeline.train.checkpoint import CheckpointManager
from pipeline.train.rerun import Decision, Previous
from pipeline.train.worker_setup import WorkerSetup
from runtime.storage import absolute, forwarded_env, is_uri

log = logging.getLogger(__name__)


def resolve_job(job: JobConfig) -> JobConfig:
    """Fill the defaults that depend on where the driver runs (absolute paths), in a copy; raises a
    one-line ``ValueError`` on a name that cannot be a folder or an MLflow name."""
    check_names(job)
    job = job.model_copy(deep=True)
    train = job.train
    train.run_name = train.run_name or job.name
    train.storage_path = absolute(train.storage_path or runs_dir() / "ray")  # a URI stays as written
    if job.mlflow.enabled:
        job.mlflow.tracking_uri = job.mlflow.tracking_uri or default_tracking_uri()
    return job


def run_dir(job: JobConfig) -> Path | str:
    """The run's folder, ``<storage path>/<run name>``, of a job resolved by :func:`resolve_job`: a path,
    or a URI below a store's ``train.storage_path``."""
    if is_uri(job.train.storage_path):
        return f"{job.train.storage_path.rstrip('/')}/{job.train.run_name}"
    return Path(job.train.storage_path) / job.train.run_name


def run_checkpoints(job: JobConfig) -> CheckpointManager:
    """The checkpoints of the run folder (:func:`run_dir`) of a resolved job, reached with its storage settings."""
    return CheckpointManager(run_dir(job), storage=job.storage.settings())


def store_env(job: JobConfig) -> dict[str, str]:
    """What the job's Ray processes need in their environment to reach its object store
    (:func:`runtime.storage.forwarded_env`) when a path of the job is a URI, else nothing."""
    paths = (job.shards.root, job.train.storage_path, job.tune.storage_path if job.tune is not None else None)
    return forwarded_env() if any(is_uri(p or "") for p in paths) else {}


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A job resolved for one training run (see the module docstring)."""

    job: JobConfig  # resolved (:func:`resolve_job`)
    task_name: str
    checkpoints: CheckpointManager  # the run folder's
    address: Optional[str] = None  # Ray cluster (None: $RAY_ADDRESS, else a new local one)
    restart: bool = False  # start the run name over when it holds a checkpoint
    examined: bool = False  # :attr:`previous` looked up (:meth:`examine`)
    previous: Optional[Previous] = None  # the run's newest intact checkpoint
    setup: Optional[WorkerSetup] = None  # after with_shards
    task: Any = None  # after with_shards (a pipeline.tasks.Task with the shards' vocabulary)
    manifest: dict = dataclasses.field(default_factory=dict)  # the train split's, after with_shards

    @classmethod
    def resolve(cls, job: JobConfig, *, address: Optional[str] = None, restart: bool = False) -> "JobPlan":
        """The plan of ``job`` before any data exists; raises a one-line ``ValueError`` on an unknown
        task or a target its task does not report, or a bad name (:func:`resolve_job`)."""
        from pipeline.tasks import TASK_CLASSES, task_name_for
        from pipeline.train import stopping

        job = resolve_job(job)
        task_name = task_name_for(job.train.task, job.data.name)
        stopping.check_target(job.train.target, TASK_CLASSES[task_name].metric)
        return cls(job=job, task_name=task_name, checkpoints=run_checkpoints(job), address=address, restart=restart)

    @property
    def run_key(self) -> str:
        """The run's identity across attempts: ``<storage path>/<run name>`` (MLflow tag)."""
        return f"{self.job.train.storage_path}/{self.job.train.run_name}"

    def examine(self) -> "JobPlan":
        """This plan with the run's newest intact checkpoint (:func:`pipeline.train.rerun.previous_run`,
        which names what is damaged), found once: under the run's lease nothing else changes it."""
        return dataclasses.replace(self, examined=True, previous=rerun.previous_run(self.checkpoints))

    def with_shards(self, shard_dir: str | Path) -> "JobPlan":
        """This plan checked against the shards in ``shard_dir``, with :attr:`setup`, :attr:`task` and
        :attr:`manifest`; raises a one-line ``ValueError`` before any worker starts."""
        setup, task, manifest = _against_shards(self.job, self.task_name, shard_dir)
        return dataclasses.replace(self, setup=setup, task=task, manifest=manifest)

    def with_setup(self, **changes) -> "JobPlan":
        """This plan with its worker setup's fields ``changes`` set (the MLflow run, the resume point)."""
        return dataclasses.replace(self, setup=dataclasses.replace(self.setup, **changes))

    def decision(self) -> Optional[Decision]:
        """What this run does with what its run name holds (:attr:`previous`): ``fresh``, ``restart``,
        ``resume`` (from the previous checkpoint) or ``finished`` (it has done ``train.epochs``, or
        the job's stopping rules ended it: nothing is trained); raises
        :class:`~pipeline.train.rerun.RerunConflict` when it holds another configuration's checkpoint.
        Before :meth:`with_shards` a conflict raises at once, and the answer is known only when the
        job's shards exist for the raw files as they are (else None: decided after the data)."""
        from pipeline.registry.versions import git_commit

        if not self.examined:
            raise RuntimeError("JobPlan.decision before JobPlan.examine")
        job, previous = self.job, self.previous
        if self.setup is not None:
            return _decide(job, rerun.weights_config(job, self.manifest, self.task_name), git_commit(), previous,
                           self.restart)
        if self.restart or previous is None:
            return None
        import preprocessing
        from preprocessing.columnar import raw_fingerprint
        from preprocessing.sources import dataset_dir

        folder = dataset_dir(job.data)
        if folder.exists():
            fingerprint = raw_fingerprint(folder, job.data.name)
            manifest = rerun.job_manifest(job, fingerprint)
            if manifest is not None:
                return _decide(job, rerun.weights_config(job, manifest, self.task_name), git_commit(), previous)
        else:  # built with the shards: everything but the raw data's fingerprint can be compared now
            fingerprint = ((previous.provenance.get("config") or {}).get("data") or {}).get("fingerprint")
        expected = {"config_hash": preprocessing.config_hash(job.data, job.transform, job.shards),
                    "source": {"fingerprint": fingerprint}}
        _decide(job, rerun.weights_config(job, expected, self.task_name), git_commit(), previous)  # raises on a conflict
        return None


def _decide(job, config: dict, commit: str, previous: Optional[Previous], restart: bool = False) -> Decision:
    """:meth:`JobPlan.decision` for the weights configuration ``config`` (:func:`pipeline.train.rerun.weights_config`)."""
    digest = rerun.config_hash(config)
    fresh = {"config_hash": digest, "config": config, "data_settings": rerun.data_settings(job), "git_commits": [commit]}
    if previous is None:
        return Decision("fresh", None, fresh)
    if restart:
        return Decision("restart", previous, fresh)
    recorded = previous.provenance
    if recorded.get("config_hash") != digest:
        diffs = rerun.config_differences(job, recorded.get("config") or {}, config, recorded.get("data_settings"))
        if diffs:
            raise rerun.RerunConflict(rerun.conflict_message(job, previous, diffs))
    commits = previous.commits or [commit]
    if commits[-1] != commit:
        commits.append(commit)
    if previous.epoch >= job.train.epochs - 1 or rerun.stopped_by_rules(job, config["task"], previous.state):
        return Decision("finished", previous, dict(recorded, git_commits=previous.commits or [commit]))
    return Decision("resume", previous, dict(fresh, git_commits=commits))


def worker_setup(job: JobConfig, shard_dir: str | Path) -> WorkerSetup:
    """The workers' setup of ``job`` on the shards in ``shard_dir``, for callers that need the model
    without a run (a sweep's parameter count, benchmarks)."""
    from pipeline.tasks import task_name_for

    task_name = task_name_for(job.train.task, job.data.name)
    return _against_shards(job, task_name, shard_dir)[0]


def _against_shards(job: JobConfig, task_name: str, shard_dir: str | Path) -> tuple[WorkerSetup, Any, dict]:
    from pipeline.tasks import make_task
    from pipeline.train.engine import build_model
    from pipeline.train.loader import open_split
    from pipeline.train.preflight import check_shard_features

    storage = job.storage.settings()
    train_ds = open_split(shard_dir, "train", storage)
    if len(train_ds) == 0:
        raise ValueError(f"{shard_dir}: the train split is empty")
    for split in ("valid", "test"):
        if len(open_split(shard_dir, split, storage)) == 0:
            raise ValueError(f"{shard_dir}: the {split} split is empty")
    task = make_task(task_name, vocab=train_ds.vocab)
    model_config = task.configure(job.model, train_ds[0])
    if model_config.gnn_type == "pna" and model_config.has_gnn and not model_config.pna_degree_histogram:
        model_config = dataclasses.replace(model_config, pna_degree_histogram=train_ds.in_degree_histogram())
    manifest = train_ds.manifest or {}
    check_shard_features(model_config, manifest, shard_dir)
    try:
        build_model(model_config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model: {str(exc).splitlines()[0]}") from None
    setup = WorkerSetup(
        job=job,
        shard_dir=absolute(shard_dir),
        model_config=dataclasses.asdict(model_config),
        task_name=task_name,
        task_state={k: v for k, v in task.state().items() if k != "name"},
        run_id=None,
    )
    return setup, task, manifest
