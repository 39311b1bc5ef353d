"""What a Ray Train worker needs to start, resolved in the driver: :class:`WorkerSetup`.

It travels in ``train_loop_config``, which Ray Train's controller unpickles too: so this module
imports no more than the job's configuration (not torch, PyG or the worker modules).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pipeline.config import JobConfig


@dataclasses.dataclass
class WorkerSetup:
    """Everything a worker needs, resolved in the driver (plain, picklable)."""

    job: JobConfig
    shard_dir: str
    model_config: dict
    task_name: str
    task_state: dict
    run_id: Optional[str]  # the MLflow run (mlflow.enabled)
    fault: Optional[dict] = None
    provenance: Optional[dict] = None  # config hash + git commits, recorded in every checkpoint (pipeline.train.rerun)
    resume_from: Optional[str] = None  # the name of a complete checkpoint newer than Ray's record (pipeline.train.plan)
    startup: Optional[dict] = None  # the driver's start-up events, wall-clock (pipeline.train.startup)
    process_env: Optional[dict] = None  # environment variables the worker sets when it starts (threads, console)
    damaged: Optional[dict] = None  # checkpoints the driver named damaged (CheckpointManager.damaged)
