"""One optimisation step of a worker, and evaluation over a split: nothing read back to the host.

:class:`TrainStep` runs forward (``validate=False``: the data loader checked the batch on the
CPU, see :mod:`pipeline.train.loader`), the task's loss, DeepSpeed's backward and the optimizer step
(:func:`pipeline.train.engine.optimizer_step`), and returns the detached output and loss as device
tensors; :func:`evaluate` keeps each batch's predictions on the device and decodes them once.
"""
from __future__ import annotations

from typing import Any

import torch

from pipeline.train.engine import optimizer_step
from pipeline.train.loader import to_device
from pipeline.tasks import Task


class TrainStep:
    """``step(batch) -> (output, loss)`` on the engine's device (both detached)."""

    def __init__(self, engine, task: Task, grad_clip: float, clip_here: bool) -> None:
        self.engine = engine
        self.task = task
        self.grad_clip = grad_clip
        self.clip_here = clip_here

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.engine(batch, validate=False)
        loss = self.task.loss(out, batch)
        self.engine.backward(loss)
        optimizer_step(self.engine, self.grad_clip, self.clip_here)
        return out.detach(), loss.detach()


def evaluate(engine, task: Task, loader, device: torch.device) -> tuple[list, list]:
    """This rank's ``(predictions, targets)`` over the batches of ``loader`` (in loader order)."""
    engine.eval()
    predictions: list[torch.Tensor] = []
    targets: list = []
    with torch.no_grad():
        for batch in loader:
            targets.extend(task.targets(batch))  # from the CPU batch, before it moves
            out = engine(to_device(batch, device), validate=False)
            predictions.append(task.predictions(out))
    if not predictions:
        return [], targets
    return task.decode(torch.cat(predictions).cpu()), targets
