"""A training job resolved once, at the edge: :class:`JobPlan`, which every later step reads.

A job file says what to train; the driver needs more, and each piece is derived here once
instead of again in every step that needs it:

* :meth:`JobPlan.resolve` (no data, no Ray): the defaults that depend on where the driver runs
  (run name, absolute storage path, tracking URI: :func:`resolve_job`), the task (its name, and
  through it the metric and mode; a ``train.target`` is checked against that metric), the Ray
  address and whether the run name starts over;
* :meth:`JobPlan.attach_shards` (after the data stage): the shards checked against the job (splits
  not empty, features the model reads present), the model built once to catch a bad
  configuration before any worker starts, the task object with the shards' vocabulary, and the
  worker setup (:class:`~pipeline.train.worker_setup.WorkerSetup`: model config, task state, precision),
  which is what the workers receive;
* :attr:`JobPlan.decision`: what the run name already holds (:mod:`pipeline.train.rerun`), set by
  the driver before and after the data stage.

``satp train`` builds the plan and hands it to :func:`pipeline.train.driver.train_plan`;
:func:`pipeline.train.driver.train_job` (sweeps' trials, the demo, Python callers) builds it
from a job.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

from pipeline.config import JobConfig
from pipeline.config.names import check_names
from pipeline.config.train import default_tracking_uri, runs_dir
from pipeline.tasks import TASK_CLASSES, Task, make_task, task_name_for
from pipeline.train import stopping
from pipeline.train.loader import open_split
from pipeline.train.preflight import check_shard_features
from pipeline.train.rerun import Decision
from pipeline.train.worker import build_model
from pipeline.train.worker_setup import WorkerSetup
from runtime.storage import is_uri

log = logging.getLogger(__name__)


def resolve_job(job: JobConfig) -> JobConfig:
    """Fill the defaults that depend on where the driver runs (absolute paths), in a copy."""
    job = job.model_copy(deep=True)
    train = job.train
    train.run_name = train.run_name or job.name
    if not is_uri(train.storage_path or ""):  # a URI stays as written (a path would lose a slash)
        train.storage_path = str(Path(train.storage_path or runs_dir() / "ray").expanduser().resolve())
    if job.mlflow.enabled:
        job.mlflow.tracking_uri = job.mlflow.tracking_uri or default_tracking_uri()
    return job


@dataclasses.dataclass
class JobPlan:
    """A job resolved for one training run (see the module docstring)."""

    job: JobConfig  # resolved (:func:`resolve_job`)
    task_name: str
    address: Optional[str] = None  # Ray cluster (None: $RAY_ADDRESS, else a new local one)
    restart: bool = False  # start the run name over when it holds a checkpoint
    early_checked: bool = False  # preflight.early_checks passed (satp train runs them before its heavy imports)
    setup: Optional[WorkerSetup] = None  # after attach_shards
    task: Optional[Task] = None  # after attach_shards (the shards' vocabulary)
    manifest: dict = dataclasses.field(default_factory=dict)  # the train split's, after attach_shards
    decision: Optional[Decision] = None  # what the run name holds, once decided (pipeline.train.rerun)

    @classmethod
    def resolve(cls, job: JobConfig, *, address: Optional[str] = None, restart: bool = False,
                early_checked: bool = False) -> "JobPlan":
        """The plan of ``job`` before any data exists; raises a one-line ``ValueError`` on an unknown
        task or a target its task does not report, or a name that cannot be a folder or an MLflow name
        (:mod:`pipeline.config.names`: checked before the run's lease is written under the run name)."""
        check_names(job)
        job = resolve_job(job)
        task_name = task_name_for(job.train.task, getattr(getattr(job, "data", None), "name", None))
        stopping.check_target(job.train.target, TASK_CLASSES[task_name].metric)
        return cls(job=job, task_name=task_name, address=address, restart=restart, early_checked=early_checked)

    @property
    def metric(self) -> str:
        return TASK_CLASSES[self.task_name].metric

    @property
    def mode(self) -> str:
        return TASK_CLASSES[self.task_name].mode

    @property
    def run_key(self) -> str:
        """The run's identity across attempts: ``<storage path>/<run name>`` (MLflow tag)."""
        return f"{self.job.train.storage_path}/{self.job.train.run_name}"

    @property
    def run_dir(self) -> Path | str:
        """The run's folder: a path, or the URI below a store's ``train.storage_path``."""
        if is_uri(self.job.train.storage_path):
            return self.run_key
        return Path(self.job.train.storage_path) / self.job.train.run_name

    @property
    def shard_dir(self) -> Optional[str]:
        return self.setup.shard_dir if self.setup is not None else None

    def attach_shards(self, shard_dir: str | Path) -> WorkerSetup:
        """Check the job against the shards in ``shard_dir`` and fill :attr:`setup`, :attr:`task` and
        :attr:`manifest`; raises a one-line ``ValueError`` before any worker starts."""
        self.setup, self.task, self.manifest = _against_shards(self.job, self.task_name, shard_dir)
        return self.setup


def worker_setup(job: JobConfig, shard_dir: str | Path) -> WorkerSetup:
    """The workers' setup of ``job`` on the shards in ``shard_dir`` (the model configured from their
    features), for callers that need the model without a run: a sweep's parameter count, the
    loader benchmark."""
    task_name = task_name_for(job.train.task, getattr(getattr(job, "data", None), "name", None))
    return _against_shards(job, task_name, shard_dir)[0]


def _against_shards(job: JobConfig, task_name: str, shard_dir: str | Path) -> tuple[WorkerSetup, Task, dict]:
    train_ds = open_split(shard_dir, "train")
    if len(train_ds) == 0:
        raise ValueError(f"{shard_dir}: the train split is empty")
    for split in ("valid", "test"):
        if len(open_split(shard_dir, split)) == 0:
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
        shard_dir=str(Path(shard_dir).resolve()),
        model_config=dataclasses.asdict(model_config),
        task_name=task_name,
        task_state={k: v for k, v in task.state().items() if k != "name"},
        precision=job.train.precision,  # "auto" resolved in the workers (the driver may have no GPU)
        run_id=None,
        tracking_uri=job.mlflow.tracking_uri if job.mlflow.enabled else None,
    )
    return setup, task, manifest
