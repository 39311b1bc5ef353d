"""Job sections owned by training: ``train``, ``resources`` and ``mlflow``, with the defaults of a
small local run (``jobs/*.yaml`` set the paper's values; docs/jobs.md describes every key)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from preprocessing.config import StrictModel
from runtime.storage import validate

Precision = Literal["auto", "bf16", "fp16", "fp32"]
TaskName = Literal["code2", "ppa", "pattern", "cluster"]


class TargetConfig(StrictModel):
    """A quality target: the run stops at the first evaluation where ``metric`` reaches ``value``
    (``>=``, or ``<=`` for a task whose metric is minimised); see :mod:`pipeline.train.stopping`."""

    metric: str  # val_<task metric>, test_<...> or train_<...>, e.g. val_acc, val_f1
    value: float


class TrainConfig(StrictModel):
    """Optimisation, batching, checkpointing (paper, appendix C: AdamW with a linear warm-up, then
    cosine decay on OGB, or the Transformer's inverse-square-root decay on ZINC/PATTERN/CLUSTER)."""

    task: Optional[TaskName] = None  # None: inferred from data.name (see pipeline.tasks)
    epochs: int = Field(4, ge=1)
    warmup_epochs: float = Field(1.0, ge=0)
    warmup_steps: Optional[int] = Field(None, ge=0)
    lr: float = Field(1e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine decays to lr * min_lr_ratio
    weight_decay: float = Field(1e-6, ge=0)
    # after the warm-up; inverse_sqrt: lr * sqrt(warmup / step), the SAT authors' SBM/ZINC schedule
    scheduler: Literal["cosine", "constant", "inverse_sqrt"] = "cosine"
    # padded nodes (graphs x largest graph) of a batch; a larger graph gets a batch of its own
    node_budget: int = Field(4000, ge=1)
    # micro-batches per optimizer step, dealt to the workers, so steps do not depend on the worker
    # count (pipeline.train.global_batch); unset: the job's (maximum) worker count
    micro_batches_per_step: Optional[int] = Field(None, ge=1)
    max_graphs_per_batch: Optional[int] = Field(None, ge=1)
    eval_node_budget: Optional[int] = Field(None, ge=1)  # default: 2 x node_budget
    bucket_size: int = Field(2048, ge=1)  # graphs per shuffled bucket sorted by size
    loader_workers: int = Field(0, ge=0)
    train_subset: Optional[int] = Field(None, ge=1)  # first N graphs of a seeded permutation
    eval_subset: Optional[int] = Field(None, ge=1)  # the same, seeded by data.seed (not by train.seed)
    seed: int = 0
    # eager; static (padded to fixed capacities); compiled (static + torch.compile); captured (compiled +
    # a CUDA graph; GPU only): pipeline.train.step_modes
    step: Literal["eager", "static", "compiled", "captured"] = "eager"
    # capacities: mean + this many standard deviations of the first epoch's batch sizes, at most their largest
    capacity_sigmas: float = Field(5.0, ge=0)
    # DeepSpeed
    precision: Precision = "auto"  # auto: bf16 where supported, else fp16 on GPU, fp32 on CPU
    zero_stage: Literal[0, 1, 2] = 0
    grad_clip: float = Field(1.0, ge=0)  # 0 disables
    # training batches BatchNorm's statistics are recomputed over before each evaluation (0: never)
    precise_bn_batches: int = Field(0, ge=0)
    # bookkeeping
    eval_every: int = Field(1, ge=1)
    log_every_steps: int = Field(50, ge=1)
    run_name: Optional[str] = None  # default: the job's name; a rerun with the same name resumes
    storage_path: Optional[str] = None  # default: <runs>/ray
    checkpoints_to_keep: int = Field(2, ge=1)
    # a checkpoint every this many optimizer steps too (None: at epoch ends only)
    checkpoint_every_steps: Optional[int] = Field(None, ge=1)
    # steps between asking Ray Train whether a node is being drained (then a checkpoint at once)
    preemption_check_steps: int = Field(10, ge=1)
    max_failures: int = Field(2, ge=0)  # worker-group restarts from the last checkpoint
    # stopping before `epochs` (pipeline.train.stopping): at a target, or after `patience` evaluations
    # without a better validation metric
    target: Optional[TargetConfig] = None
    patience: Optional[int] = Field(None, ge=1)

    @field_validator("storage_path")
    @classmethod
    def _storage_path_is_a_path_or_uri(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else validate(value, "train.storage_path")

    @model_validator(mode="after")
    def _warmup(self) -> "TrainConfig":
        warmup = self.warmup_epochs if self.warmup_steps is None else self.warmup_steps
        if self.scheduler == "inverse_sqrt" and not warmup > 0:
            raise ValueError("scheduler 'inverse_sqrt' decays from the end of the warm-up; set warmup_steps > 0")
        return self


class ResourcesConfig(StrictModel):
    """Ray Train workers: one DeepSpeed rank each."""

    # a count, or [min, max]: an elastic run, resized as nodes leave and join (docs/scale.md)
    num_workers: Union[int, tuple[int, int]] = 2
    resize_check_s: float = Field(60.0, gt=0)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1, gt=0)
    gpus_per_worker: float = Field(1, ge=0)
    torch_threads: Optional[int] = Field(None, ge=1)  # default: cpus_per_worker
    # PACK: workers on as few nodes as possible; SPREAD: across nodes (a lost node takes fewer along)
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    # true: an autoscaling cluster adds the nodes; false: refused at once when the nodes cannot hold them
    wait_for_nodes: bool = False
    # auto: nccl for GPU workers that hold whole GPUs, else gloo (NCCL refuses two ranks on one device)
    collective_backend: Literal["auto", "nccl", "gloo"] = "auto"

    @field_validator("num_workers", mode="before")
    @classmethod
    def _count_or_range(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
            raise ValueError(f"expected a worker count (an integer >= 1) or a range [min, max], got {value!r}")
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"expected a worker count >= 1, got {value}")
            return value
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"expected a range of two integers [min, max], got {list(value)!r}")
        low, high = value
        if low < 1 or low > high:
            raise ValueError(f"expected a range [min, max] with 1 <= min <= max, got {list(value)!r}")
        return low if low == high else (low, high)

    @property
    def elastic(self) -> bool:
        """Whether the job gives a range of worker counts."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if self.elastic else self.num_workers

    @property
    def counts(self) -> range:
        """Every worker count the job may run at."""
        return range(self.min_workers, self.max_workers + 1)

    @model_validator(mode="after")
    def _gpu(self) -> "ResourcesConfig":
        if self.use_gpu and self.gpus_per_worker <= 0:
            raise ValueError("use_gpu needs gpus_per_worker > 0")
        if self.collective_backend == "nccl" and not self.use_gpu:
            raise ValueError("collective_backend 'nccl' needs GPU workers (use_gpu: true); CPU workers use gloo")
        if self.collective_backend == "nccl" and self.shares_gpus:
            raise ValueError(
                f"collective_backend 'nccl' with gpus_per_worker {self.gpus_per_worker:g} and {self.max_workers} "
                "workers: workers may share a GPU and NCCL refuses two ranks on one device; use gloo (or auto)")
        return self

    @property
    def shares_gpus(self) -> bool:
        """Whether two of the job's GPU workers may land on one device (a fractional GPU each)."""
        return self.use_gpu and self.max_workers > 1 and not float(self.gpus_per_worker).is_integer()

    @property
    def torch_backend(self) -> str:
        """``collective_backend`` with ``auto`` resolved: ``nccl`` or ``gloo``."""
        if self.collective_backend != "auto":
            return self.collective_backend
        return "nccl" if self.use_gpu and not self.shares_gpus else "gloo"


class MlflowConfig(StrictModel):
    """Tracking: one MLflow run per training run."""

    enabled: bool = True
    tracking_uri: Optional[str] = None  # default: sqlite:////abs/<runs>/mlflow.db
    experiment: str = "satp"
    registered_model: Optional[str] = None  # default: sat-<task>; registered at the end of a run
    log_system_metrics: bool = True

    @model_validator(mode="after")
    def _uri(self) -> "MlflowConfig":
        uri = self.tracking_uri
        if uri and uri.startswith("sqlite:") and not uri.startswith("sqlite:////"):
            raise ValueError(f"tracking_uri {uri!r}: use an absolute SQLite path (sqlite:////abs/path.db)")
        return self


def runs_dir() -> Path:
    """The project's run directory: ``$SATP_RUNS_DIR`` or ``./runs`` (absolute)."""
    return Path(os.environ.get("SATP_RUNS_DIR") or Path.cwd() / "runs").resolve()


def default_tracking_uri() -> str:
    return f"sqlite:///{runs_dir() / 'mlflow.db'}"
