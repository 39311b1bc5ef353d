"""A worker's checkpoints and reports to Ray Train, and the per-step losses they carry.

A checkpoint is a collective of every rank at the same global step; the report carries every step's
loss since the previous one for Ray Train's controller to log (:mod:`pipeline.train.epoch_logger`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.train import checkpoint as ckpt
from pipeline.train import faults


STEP_KEYS = ("step_losses", "world_size", "global_step")  # what every report adds (see Reports.write)
#: a rank's local folder for its part of a checkpoint, before satp copies it into the run's storage:
#: ``satp-ckpt-<machine>-<pid>-<start ticks>-<random>`` in the temporary directory
STAGING_PREFIX = "satp-ckpt-"


def staging_folder() -> tempfile.TemporaryDirectory:
    """A local folder for this process's part of a checkpoint, named after the process; first the
    folders of ended processes of this machine (:func:`pipeline.train.lease.this_machine`) are
    removed: a worker killed while it wrote one never removed its own."""
    import hashlib

    from pipeline.train.lease import process_running, process_started, this_machine

    machine = hashlib.sha1(this_machine().encode()).hexdigest()[:10]
    for folder in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}{machine}-*-*-*"):
        pid, started = folder.name[len(STAGING_PREFIX):].split("-")[1:3]
        if pid.isdigit() and started.isdigit() and not process_running(int(pid), int(started)):
            shutil.rmtree(folder, ignore_errors=True)  # another user's stays: not ours to remove
    pid = os.getpid()
    started = process_started(pid)  # None where /proc is not: a name no later sweep matches
    return tempfile.TemporaryDirectory(
        prefix=STAGING_PREFIX + (f"{machine}-{pid}-{started}-" if started is not None else ""))


class StepLosses:
    """The loss of every step since the last report, this rank's parts kept on the device."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []

    def add(self, global_step: int, loss_part: torch.Tensor) -> None:
        """This rank's part of the loss of global step ``global_step`` (a device scalar)."""
        self._steps.append(global_step)
        self._losses.append(loss_part.detach().float())

    def take(self) -> list[list[float]]:
        """``[global step, loss]`` of the steps since the last call, summed over the ranks (a
        collective: every rank calls it at the same steps)."""
        import torch.distributed as dist

        if not self._steps:
            return []
        parts = torch.stack(self._losses).to(torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(parts)
        out = [[step, loss] for step, loss in zip(self._steps, parts.tolist())]
        self._steps, self._losses = [], []
        return out


class Reports:
    """The checkpoints and reports of one rank (see the module docstring)."""

    def __init__(self, engine, context, checkpoints: ckpt.CheckpointManager, fault: Optional[dict]) -> None:
        self.engine, self.context, self.checkpoints, self.fault = engine, context, checkpoints, fault
        self.losses = StepLosses()

    def write(self, state: dict[str, Any], best_weights: Optional[dict], metrics: dict[str, Any], epoch: int) -> str:
        """Checkpoint ``state`` (and the best weights), then report ``metrics`` with it; return the
        checkpoint's name. ``epoch``: the epoch being trained or just done (messages). Every rank calls it."""
        metrics = dict(metrics, step_losses=self.losses.take(), world_size=self.context.world,
                       global_step=state["steps"])
        # written locally, then into the run's storage by satp (a full disk ends the run:
        # CheckpointManager.write), then reported where it lies
        with staging_folder() as directory:
            rank = self.context.rank
            ckpt.save(directory, self.engine, state, best_weights, rank)
            name = self.checkpoints.write(directory, rank, epoch,
                                          after_file=faults.pause_in_checkpoint(self.fault, rank, state["steps"]))
        self.context.report(metrics, name)
        return name
