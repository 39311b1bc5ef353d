"""BatchNorm statistics recomputed before an evaluation ("precise BN", ``train.precise_bn_batches``).

Training's moving averages mix batches taken under different weights (Wu & Johnson, "Rethinking
'Batch' in BatchNorm", 2021, Sec. 3), and dropout right before a BatchNorm layer, as in SAT's
layers, shifts the variance it sees (Li et al., CVPR 2019). :func:`recompute_batchnorm_stats`
replaces the running statistics by their plain average over a few training batches run with dropout
off (:class:`StatisticsBatches`), and says how far the moving averages were (:class:`StatisticsShift`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline.train.batching import NodeBudgetSampler, split_sampler
from pipeline.train.global_batch import GlobalBatches

PRECISE_BN_SEED_OFFSET = 104729  # the statistics batches' seed: train.seed + this


def batchnorm_layers(module: torch.nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of ``module`` that keep running statistics."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class StatisticsBatches:
    """The sampler of the batches that :func:`recompute_batchnorm_stats` runs: this rank's micro-batch of
    each of the first ``count`` global steps of ``sampler``'s epoch (shuffled, with a seed of its own),
    so every rank runs as many: fresh ones every epoch."""

    def __init__(self, sampler: NodeBudgetSampler, count: int, rank: int = 0, world: int = 1) -> None:
        self.steps, self.count, self.rank, self.epoch = GlobalBatches(sampler, world), int(count), rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter([self.steps.step(self.epoch, s)[self.rank] for s in range(len(self))])

    def __len__(self) -> int:
        return min(self.count, self.steps.steps_per_epoch)


@dataclass(frozen=True)
class StatisticsShift:
    """Training's moving averages against the recomputed statistics, over every BatchNorm channel.

    ``var_ratio``: the geometric mean of running variance / recomputed variance (above 1: inflated,
    as by dropout); ``worst_layer_var_ratio``: the same for the layer farthest from 1;
    ``mean_shift``: the mean of |running mean - recomputed mean| / recomputed standard deviation.
    """

    var_ratio: float
    worst_layer_var_ratio: float
    mean_shift: float

    def metrics(self) -> dict[str, float]:
        """As the run logs them: ``bn_var_ratio``, ``bn_worst_layer_var_ratio``, ``bn_mean_shift``."""
        return {"bn_var_ratio": self.var_ratio, "bn_worst_layer_var_ratio": self.worst_layer_var_ratio,
                "bn_mean_shift": self.mean_shift}


def statistics_shift(layers: list[_BatchNorm], old: list[tuple[torch.Tensor, torch.Tensor]]) -> StatisticsShift:
    """:class:`StatisticsShift` of ``layers``' current statistics against ``old`` (running mean and
    variance per layer, in the same order)."""
    log_ratios, layer_logs, shifts = [], [], []
    for bn, (mean, var) in zip(layers, old):
        new_var = bn.running_var.double() + bn.eps
        log_ratio = torch.log((var.double() + bn.eps) / new_var)
        log_ratios.append(log_ratio)
        layer_logs.append(float(log_ratio.mean()))
        shifts.append((mean.double() - bn.running_mean.double()).abs() / new_var.sqrt())
    worst = max(layer_logs, key=abs)
    return StatisticsShift(var_ratio=math.exp(float(torch.cat(log_ratios).mean())),
                           worst_layer_var_ratio=math.exp(worst), mean_shift=float(torch.cat(shifts).mean()))


@torch.no_grad()
def recompute_batchnorm_stats(
    module: torch.nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any]
) -> Optional[StatisticsShift]:
    """Replace the running mean and variance of ``module``'s BatchNorm layers by their average over
    ``batches`` (each batch weighing the same, as BatchNorm's cumulative average does), computed by
    ``forward(batch)`` with the module in evaluation mode except its BatchNorm layers (dropout off),
    then averaged over the ranks; returns how far the old statistics were from the new. With no
    batch (or no BatchNorm layer) the statistics are left as they were: None.
    """
    layers = batchnorm_layers(module)
    if not layers:
        return None
    was_training = module.training
    saved = [(bn.momentum, bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
             for bn in layers]
    module.eval()
    for bn in layers:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the batches
        bn.train()
    seen = 0
    try:
        for batch in batches:
            forward(batch)
            seen += 1
    finally:
        for bn, (momentum, *_rest) in zip(layers, saved):
            bn.momentum = momentum
        module.train(was_training)
    if seen == 0:
        for bn, (_momentum, mean, var, count) in zip(layers, saved):
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
            bn.num_batches_tracked.copy_(count)
        return None
    _average_over_ranks(layers)
    return statistics_shift(layers, [(mean, var) for _m, mean, var, _c in saved])


def _average_over_ranks(layers: list[_BatchNorm]) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    flat = torch.cat([t.float().view(-1) for bn in layers for t in (bn.running_mean, bn.running_var)])
    dist.all_reduce(flat)  # SUM: gloo has no AVG
    flat /= dist.get_world_size()
    offset = 0
    for bn in layers:
        for t in (bn.running_mean, bn.running_var):
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def statistics_batches(job, dataset, rank: int = 0, world: int = 1) -> StatisticsBatches:
    """The training batches over which BatchNorm's statistics are recomputed before an evaluation
    (``train.precise_bn_batches`` of them, shuffled with a seed apart from the training order's)."""
    sampler = split_sampler(job, dataset, shuffle=True, seed=job.train.seed + PRECISE_BN_SEED_OFFSET)
    return StatisticsBatches(sampler, job.train.precise_bn_batches, rank, world)
