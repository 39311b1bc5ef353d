"""One optimisation step of a worker, and evaluation over a split: nothing read back to the host.

:meth:`TrainStep.finish` reduces the gradients over the ranks (at ZeRO stage 0 one explicit
all-reduce; stages 1 and 2 in DeepSpeed's accumulation) and steps the optimizer. ``train.step``:
``eager`` (batches as cut); ``static`` (padded to fixed capacities, :mod:`pipeline.train.capacity`);
``compiled`` (``static``, compiled by ``engine.compile``); ``captured`` (``compiled``, replayed as a
CUDA graph, :mod:`pipeline.train.cuda_graphs`). A batch over capacity runs eagerly with the compiled
code set aside, so an odd shape never recompiles.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from pipeline.tasks import Task
from pipeline.train.engine import optimizer_step
from pipeline.train.loader import to_device
from sat.padding import padding_of

def pads_batches(mode: str) -> bool:
    """Whether ``train.step = mode`` pads batches to fixed capacities."""
    return mode != "eager"


def compiles_model(mode: str) -> bool:
    """Whether ``train.step = mode`` compiles the model."""
    return mode in ("compiled", "captured")


class TrainStep:
    """``accumulate(batch, scale)`` per micro-batch, ``finish()`` per step (``step(batch)``: both),
    outputs and losses on the device, detached; ``forward(batch)`` for evaluation. ``batch``: on the
    CPU (pinned) or on the device already."""

    def __init__(self, engine, task: Task, grad_clip: float, clip_here: bool, mode: str = "eager",
                 device: Optional[torch.device] = None) -> None:
        self.engine = engine
        self.task = task
        self.grad_clip = grad_clip
        self.clip_here = clip_here
        self.mode = mode
        self.device = device if device is not None else next(engine.module.parameters()).device
        self.overflow = 0  # batches over capacity, run eagerly (reset by the caller)
        self.deepspeed_accumulates = engine.zero_optimization_stage() > 0  # see the module docstring
        self.graphs = None
        if mode == "captured" and self.device.type == "cuda":
            from pipeline.train.cuda_graphs import CapturedSteps

            self.graphs = CapturedSteps(engine, task)

    def _eager_if(self, unpadded: bool):
        """Compiled code set aside for a batch that is not padded (see the module docstring)."""
        if unpadded and compiles_model(self.mode):
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _padded(self, batch: Any) -> bool:
        padded = padding_of(batch) is not None
        if not padded and pads_batches(self.mode):
            self.overflow += 1
        return padded

    def accumulate(self, batch: Any, scale: float = 1.0, index: int = 0, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of micro-batch ``index`` of this rank's ``count`` in the step, its loss
        scaled by ``scale`` for the backward pass; returns the output and the unscaled loss."""
        padded = self._padded(batch)
        if padded and self.graphs is not None:
            out, loss = self.graphs.train(batch, scale, index, count)
        else:
            batch = to_device(batch, self.device)
            with self._eager_if(not padded):
                out = self.engine(batch, validate=False)
            loss = self.task.loss(out, batch)
            self.engine.backward(loss * scale if scale != 1.0 else loss, scale_wrt_gas=False)
            if self.deepspeed_accumulates:
                optimizer_step(self.engine, self.grad_clip, self.clip_here)  # DeepSpeed steps at the boundary
        return out.detach(), loss.detach()

    def finish(self) -> None:
        """The step's end on every rank: the gradients all-reduced (several ranks; ZeRO stage 0) and
        the optimizer stepped. A collective: every rank calls it once per step."""
        if self.deepspeed_accumulates:
            return
        if self.engine.dp_world_size > 1:
            self.engine.allreduce_gradients()
        optimizer_step(self.engine, self.grad_clip, self.clip_here)

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole step of one micro-batch: :meth:`accumulate`, then :meth:`finish`."""
        out, loss = self.accumulate(batch)
        self.finish()
        return out, loss

    @torch.no_grad()
    def forward(self, batch: Any) -> torch.Tensor:
        """The model's output on ``batch`` in the mode the module is in, without gradients; replayed
        only in evaluation mode (the BatchNorm statistics pass, :mod:`pipeline.train.precise_bn`, is not)."""
        padded = self._padded(batch)
        if padded and self.graphs is not None and not any(m.training for m in self.engine.module.modules()):
            return self.graphs.evaluate(batch)
        batch = to_device(batch, self.device)
        with self._eager_if(not padded):
            return self.engine(batch, validate=False)


def evaluate(engine, task: Task, loader, forward: Callable[[Any], torch.Tensor]) -> tuple[list, list]:
    """This rank's ``(predictions, targets)`` over the batches of ``loader`` (in loader order), the
    padding of padded batches left out; ``forward``: :meth:`TrainStep.forward`."""
    engine.eval()
    predictions: list[torch.Tensor] = []
    targets: list = []
    with torch.no_grad():
        for batch in loader:
            targets.extend(task.targets(batch))  # from the CPU batch, before it moves
            out = forward(batch)
            predictions.append(task.real_rows(task.predictions(out), batch))
    if not predictions:
        return [], targets
    return task.decode(torch.cat(predictions).cpu()), targets
