"""Normalisation of SAT (Chen et al., ICML 2022, Sec. 4.2) that ignores the padding rows of a
fixed-capacity batch (:mod:`sat.padding`): :class:`BatchNorm` computes its statistics and running
averages over the rows of ``mask`` only; without a mask, or in evaluation, it is ``BatchNorm1d``
(same parameters and state-dict keys).

Shapes: ``x`` ``[N, C]``, ``mask`` ``[N]`` (bool) or ``None`` -> ``[N, C]``."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn


class BatchNorm(nn.BatchNorm1d):
    """``BatchNorm1d`` whose batch statistics skip the rows where ``mask`` is ``False``
    (see the module docstring)."""

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        uses_batch_statistics = self.training or self.running_mean is None
        if mask is None or not uses_batch_statistics:
            return super().forward(x)
        # statistics in fp32 at least (fp64 stays fp64), as BatchNorm keeps them under autocast
        dtype = torch.promote_types(x.dtype, torch.float32)
        values = x.to(dtype)
        keep = mask.view(-1, 1)
        count = mask.sum().to(dtype)
        mean = torch.where(keep, values, 0).sum(0) / count
        centred = torch.where(keep, values - mean, 0)
        var = (centred * centred).sum(0) / count  # biased, as BatchNorm normalises with
        out = (values - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            out = out * self.weight + self.bias
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, count)
        return out.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, count: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor: Union[float, Tensor] = self.momentum
        if factor is None:  # cumulative moving average, as BatchNorm1d (a device tensor: no host read)
            factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
        unbiased = var * count / (count - 1).clamp(min=1)
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def normalise(norm: nn.Module, x: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``norm(x)``, passing the padding mask to the layers that need it (:class:`BatchNorm`;
    ``LayerNorm`` works row by row and needs none)."""
    return norm(x, mask) if isinstance(norm, BatchNorm) else norm(x)


def make_norm(kind: str, dim: int) -> nn.Module:
    """``batch`` (:class:`BatchNorm`) or ``layer`` (``nn.LayerNorm``) over ``dim`` channels."""
    if kind == "batch":
        return BatchNorm(dim)
    if kind == "layer":
        return nn.LayerNorm(dim)
    raise ValueError(f"unknown norm {kind!r}; expected 'batch' or 'layer'")
