"""Training metrics of a worker, accumulated on the device and reduced across ranks once per epoch,
and the collectives that gather predictions to rank 0."""
from __future__ import annotations

import time
from typing import Any

import torch


def gather_objects(obj: Any) -> list:
    """``obj`` of every rank (rank order); ``[obj]`` without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_from_rank_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank; ``obj`` itself without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def concat_gathered(parts: list[tuple[list, list]]) -> tuple[list, list]:
    """``(predictions, targets)`` of every rank, concatenated."""
    preds, targets = [], []
    for p, t in parts:
        preds.extend(p)
        targets.extend(t)
    return preds, targets


def sum_across(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over the ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


class EpochMeter:
    """One epoch of one rank: loss summed on the device (weighted by the task's batch size), host
    counters, timing, ``data_wait`` (blocked on the loader); :meth:`carry` brings the loss of the
    steps before a resume within the epoch."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.weight = 0
        self.graphs = 0
        self.steps = 0
        self.data_wait = 0.0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, weight: int, graphs: int) -> None:
        """A step's mean ``loss`` over ``weight`` items (the task's batch size), in a batch of ``graphs``."""
        self.loss_sum += loss.detach().float() * weight
        self.weight += weight
        self.graphs += graphs
        self.steps += 1

    def partial(self, device: torch.device) -> dict[str, float]:
        """The loss so far over all ranks (a collective), for a checkpoint taken within the epoch."""
        loss, weight = sum_across([float(self.loss_sum), self.weight], device)
        return {"loss_sum": loss, "weight": weight}

    def carry(self, partial: dict[str, float]) -> None:
        """Start from a checkpoint's :meth:`partial` (on one rank only: :meth:`reduce` sums the ranks),
        so that a resumed epoch's ``train_loss`` covers all its steps."""
        self.loss_sum += float(partial["loss_sum"])
        self.weight += float(partial["weight"])

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def reduce(self, device: torch.device) -> dict[str, float]:
        """The epoch's figures over all ranks (a collective: every rank calls it)."""
        seconds = self.seconds
        loss, weight, graphs, wait, rank_seconds = sum_across(
            [float(self.loss_sum), self.weight, self.graphs, self.data_wait, seconds], device)
        return {
            "train_loss": loss / max(weight, 1),
            "graphs_per_s": graphs / max(seconds, 1e-9),
            "data_wait_frac": wait / max(rank_seconds, 1e-9),
            "epoch_seconds": seconds,
        }
