"""Where a :class:`~pipeline.train.trainer.Trainer` runs: its rank, its device, the run's checkpoints,
and whom it reports to: :class:`RayContext` (a Ray Train worker) or :class:`LocalContext` (one
process, no Ray: a gloo group of one for DeepSpeed, reports kept in :attr:`LocalContext.reports`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch


class TrainContext:
    """What a trainer asks of the place it runs in (see the module docstring)."""

    rank: int
    world: int
    device: torch.device
    run_dir: str  # the run's folder in its storage (a path or a URI): checkpoints, progress notes

    def restored_checkpoint(self) -> Optional[str]:
        """The name of the checkpoint the run's engine last registered (None: none)."""
        return None

    def report(self, metrics: dict[str, Any], checkpoint: str) -> None:
        """Report ``metrics`` with checkpoint ``checkpoint`` (a name in :attr:`run_dir`); every rank calls it."""
        raise NotImplementedError

    def preemption_notice(self) -> Optional[Any]:
        """A notice that a node of the group is being drained (a collective), else None."""
        return None


class RayContext(TrainContext):
    """A Ray Train worker's context in a run of ``job`` (``resources.use_gpu``: the worker's GPU is its device)."""

    def __init__(self, job) -> None:
        import ray.train

        from pipeline.train.plan import run_dir

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self._storage = ctx.get_storage()
        self.run_dir = str(run_dir(job))  # Ray's experiment folder, as satp names it (a path or a URI)
        if job.resources.use_gpu:
            import ray.train.torch as rtt

            self.device = rtt.get_device()
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def restored_checkpoint(self) -> Optional[str]:
        import ray.train

        restored = ray.train.get_checkpoint()  # in the run's storage
        return Path(restored.path).name if restored is not None else None

    def report(self, metrics: dict[str, Any], checkpoint: str) -> None:
        import ray.train

        path = f"{self._storage.experiment_fs_path.rstrip('/')}/{checkpoint}"  # in Ray's file system
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint(path=path, filesystem=self._storage.storage_filesystem),
                         checkpoint_dir_name=checkpoint,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)

    def preemption_notice(self) -> Optional[Any]:
        import ray.train

        return ray.train.get_preemption_info()


class LocalContext(TrainContext):
    """One process, no Ray: rank 0 of 1 on ``device`` (default the CPU), the run's checkpoints in
    ``run_dir``; each report is kept in :attr:`reports` (``(metrics, checkpoint name)``), the last
    one what a new trainer in this context restores."""

    def __init__(self, run_dir: str | os.PathLike, device: Optional[torch.device] = None) -> None:
        self.rank, self.world = 0, 1
        self.run_dir = str(run_dir)
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.reports: list[tuple[dict[str, Any], str]] = []
        _process_group_of_one()

    def restored_checkpoint(self) -> Optional[str]:
        return self.reports[-1][1] if self.reports else None

    def report(self, metrics: dict[str, Any], checkpoint: str) -> None:
        self.reports.append((dict(metrics), checkpoint))


def _process_group_of_one() -> None:
    """The environment DeepSpeed initialises its process group from (rank 0 of 1, on a free
    loopback port), unless this process has one already."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        from runtime.ports import free_ports

        os.environ["MASTER_PORT"] = str(free_ports(1)[0])
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
