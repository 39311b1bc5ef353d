"""Training and evaluation steps captured as CUDA graphs (``train.step: captured``).

On a GPU a step of SAT costs what the host takes to launch its kernels; over batches padded to fixed
capacities (:mod:`sat.padding`) every kernel has the same shapes and addresses, so the step is
recorded once and replayed: one launch. The all-reduce and ``engine.step()`` run eagerly around it
(:meth:`pipeline.train.step.TrainStep.finish`). fp16 and ZeRO stages above 0 are refused.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline.tasks import Task
from pipeline.train.loader import to_device
from sat.layout import GraphLayout

WARMUP_STEPS = 3


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor a padded batch carries, in a fixed order: its tensor attributes by name, then
    its layout's index tensors. Two batches padded to one capacity give lists of equal shapes."""
    out: list[torch.Tensor] = []
    for key in sorted(batch.keys()):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, GraphLayout):
            out.extend(value.tensors())
    return out


def copy_into(static: list[torch.Tensor], batch: Any) -> None:
    """Copy ``batch``'s tensors into ``static`` (:func:`batch_tensors` of the captured batch)."""
    source = batch_tensors(batch)
    if len(source) != len(static) or any(s.shape != t.shape or s.dtype != t.dtype for s, t in zip(source, static)):
        raise ValueError("a padded batch differs in its tensors from the captured one (another capacity?)")
    for dst, src in zip(static, source):
        dst.copy_(src, non_blocking=True)


class _Graph:
    """One captured graph: its input tensors and what it returns."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: tuple) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def replay(self, batch: Any) -> tuple:
        copy_into(self.inputs, batch)
        self.graph.replay()
        return self.outputs


class CapturedSteps:
    """The captured training step and evaluation forward of one DeepSpeed engine (see the module
    docstring); each graph is captured on the first padded batch of its kind."""

    def __init__(self, engine, task: Task) -> None:
        if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
            raise ValueError("train.step 'captured': fp16 scales the loss on the host; use bf16 or fp32")
        if engine.zero_optimization_stage() > 0:
            raise ValueError("train.step 'captured': ZeRO stages above 0 reduce gradients in hooks; use zero_stage 0")
        self.engine, self.task = engine, task
        self.module = engine.module
        self.device = next(self.module.parameters()).device
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._train: Optional[_Graph] = None
        self._eval: Optional[_Graph] = None
        self._grads: list[Optional[torch.Tensor]] = []
        self._sums: Optional[list[torch.Tensor]] = None  # several micro-batches in a step
        self._scale = torch.ones((), device=self.device)

    def _autocast(self):
        enabled = bool(self.engine.torch_autocast_enabled())
        dtype = self.engine.torch_autocast_dtype() if enabled else None
        return torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False)

    def _forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with self._autocast():
            out = self.module(batch, validate=False)
            loss = self.task.loss(out, batch)
        (loss * self._scale).backward()
        return out.detach(), loss.detach()

    def _forward(self, batch: Any) -> torch.Tensor:
        with torch.no_grad(), self._autocast():
            return self.module(batch, validate=False)

    def _capture(self, fn, batch: Any, training: bool) -> _Graph:
        static = to_device(batch, self.device)
        buffers = [b.detach().clone() for b in self.module.buffers()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                fn(static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # the warm-up trained nothing: BatchNorm's statistics as they were
            for b, saved in zip(self.module.buffers(), buffers):
                b.copy_(saved)
        if training:
            for p in self.params:
                p.grad = None  # the captured backward allocates the gradients in the graph's pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(static)
        if training:
            self._grads = [p.grad for p in self.params]
        return _Graph(graph, batch_tensors(static), outputs if isinstance(outputs, tuple) else (outputs,))

    def train(self, batch: Any, scale: float = 1.0, index: int = 0, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss (scaled by ``scale``) and backward of a padded batch, replayed: micro-batch
        ``index`` of this rank's ``count`` in the step. After the last one the parameters hold the
        step's gradients (:meth:`pipeline.train.step.TrainStep.finish` then reduces and steps)."""
        if self._train is None:
            self._train = self._capture(self._forward_backward, batch, training=True)
        self._scale.fill_(scale)
        out, loss = self._train.replay(batch)
        grads = self._grads
        if count > 1:  # the next replay overwrites the graph's gradients: sum them apart
            if self._sums is None:
                self._sums = [torch.empty_like(g) for g in self._grads]
            (torch._foreach_copy_ if index == 0 else torch._foreach_add_)(self._sums, self._grads)
            grads = self._sums
        if index == count - 1:
            for p, grad in zip(self.params, grads):
                p.grad = grad  # DeepSpeed's zero_grad set them to None after the last step
        return out, loss

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The model's output on a padded batch in evaluation mode, replayed."""
        if self._eval is None:
            self._eval = self._capture(self._forward, batch, training=False)
        return self._eval.replay(batch)[0]
