"""Sum of OGB-GCN edge messages, fused into one pass per output row (Triton) or in plain torch.

:class:`sat.extractors.EdgeGCNConv` sums ``norm_uv * relu(W x_u + E e_uv)`` into ``v``. In the
k-subgraph extractor of SAT (Chen et al., ICML 2022, Sec. 4.1) there are ``Es`` subgraph edges,
about 44 per node on code2, and torch runs that sum as a gather of ``[Es, d]`` rows, an add, a
ReLU, a product and an atomic scatter; its backward pass is atomic index-adds into the gathered
inputs, and autograd keeps several ``[Es, d]`` activations. :func:`aggregate_edge_messages` with
``impl="fused"`` computes the same sum in one Triton kernel: each output row walks its own edges
in a CSR order (a sort of the destination indices), accumulates in fp32 (fp64 for fp64 inputs)
and is written once. The backward pass recomputes the ReLU mask and runs the same kind of
kernel per input, over the edges sorted by that input's row. Nothing of size ``[Es, d]`` is kept
or materialised, and no atomics are used.

On CUDA the kernels are compiled; CPU tensors run them only in Triton's interpreter (slow; the
CPU tests do so). ``impl="auto"`` takes the kernel on CUDA when Triton is installed, torch otherwise.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.utils import scatter

from .config import MessageImpl


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: MessageImpl, device: torch.device) -> str:
    """``fused`` or ``torch`` for tensors on ``device``."""
    if impl == "auto":
        return "fused" if device.type == "cuda" and triton_available() else "torch"
    if impl == "fused" and not triton_available():
        raise RuntimeError("gnn_messages='fused' needs Triton (pip install triton); use 'auto' or 'torch'")
    if impl not in ("fused", "torch"):
        raise ValueError(f"unknown message implementation {impl!r}; expected 'auto', 'fused' or 'torch'")
    return impl


def aggregate_edge_messages(
    a: Tensor, b: Tensor, ia: Tensor, ib: Tensor, dst: Tensor, norm: Tensor, num_out: int, impl: MessageImpl = "auto"
) -> Tensor:
    """``out[v] = sum_{j: dst[j] = v} norm[j] * relu(a[ia[j]] + b[ib[j]])``.

    Shapes: a ``[Na, d]``, b ``[Nb, d]``, ia / ib / dst / norm ``[Es]`` -> ``[num_out, d]`` in the
    dtype of ``a`` (``b`` is cast to it). Differentiable in ``a`` and ``b``.
    """
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(1):
        raise ValueError(f"aggregate_edge_messages: a {tuple(a.shape)} and b {tuple(b.shape)} must be [rows, d] alike")
    b = b.to(a.dtype)
    if resolve_impl(impl, a.device) == "torch":
        message = F.relu(a.index_select(0, ia) + b.index_select(0, ib)) * norm.to(a.dtype).view(-1, 1)
        return scatter(message, dst, dim=0, dim_size=num_out, reduce="sum")
    return _FusedAggregate.apply(a, b, ia, ib, dst, norm, num_out)


def _csr(index: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Edge order grouped by ``index`` and the ``[num_rows + 1]`` segment offsets (no host sync)."""
    keys, perm = torch.sort(index)
    rows = torch.arange(num_rows + 1, device=index.device, dtype=keys.dtype)
    return perm, torch.searchsorted(keys, rows)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two kernels, jitted. Triton reads ``TRITON_INTERPRET`` when it is first imported: with
    ``1`` they run in its CPU interpreter (how the CPU tests run them), else they compile for CUDA."""
    import triton

    from . import _edge_message_kernels as source

    return triton.jit(source.aggregate_kernel), triton.jit(source.input_grad_kernel)


# Launch configurations (BLOCK_E edges per loop step, BLOCK_D columns per program, warps per
# program) for rows with few edges (on code2: ~2.5 per subgraph entry, ~13 per graph edge) and
# rows with many (the first layer's gradient into graph nodes: ~40 each). Chosen on an H100 by
# benchmarks/gpu_messages.py (benchmarks/RESULTS.md): one program per row and few warps keep
# many short rows in flight; long rows want wide edge tiles.
KERNEL_CONFIGS = {"short": (1, 256, 2), "long": (32, 64, 2)}
LONG_ROWS = 16  # mean edges per row from which the "long" configuration applies


def _launch(kernel_index: int, reference: Tensor, rows: int, width: int, edges: int, *args,
            config: Optional[tuple[int, int, int]] = None) -> None:
    import triton
    import triton.language as tl

    if reference.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "gnn_messages='fused' needs CUDA tensors; on CPU its kernels run only in Triton's interpreter "
            "(TRITON_INTERPRET=1 before triton is imported)"
        )
    if rows == 0 or width == 0:
        return
    block_e, block_d, warps = config or KERNEL_CONFIGS["long" if edges >= LONG_ROWS * rows else "short"]
    block_d = min(block_d, triton.next_power_of_2(width))
    acc = tl.float64 if reference.dtype == torch.float64 else tl.float32
    _kernels()[kernel_index][(rows, triton.cdiv(width, block_d))](
        *args, width, BLOCK_E=block_e, BLOCK_D=block_d, ACC=acc, num_warps=warps
    )


def _index(t: Tensor) -> Tensor:
    return t.contiguous().long()


class _FusedAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, ia, ib, dst, norm, num_out):
        a, b, norm = a.contiguous(), b.contiguous(), norm.contiguous().float()
        ia, ib, dst = _index(ia), _index(ib), _index(dst)
        out = a.new_empty(num_out, a.size(1))
        perm, seg = _csr(dst, num_out)
        _launch(0, a, num_out, a.size(1), dst.numel(), a, b, ia, ib, norm, perm, seg, out)
        ctx.save_for_backward(a, b, ia, ib, dst, norm)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, ia, ib, dst, norm = ctx.saved_tensors
        grad_out = grad_out.contiguous().to(a.dtype)
        grad_a = _input_grad(a, b, ia, ib, dst, norm, grad_out) if ctx.needs_input_grad[0] else None
        grad_b = _input_grad(b, a, ib, ia, dst, norm, grad_out) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None, None, None, None


def _input_grad(own: Tensor, other: Tensor, i_own: Tensor, i_other: Tensor, dst: Tensor, norm: Tensor,
                grad_out: Tensor) -> Tensor:
    grad = torch.empty_like(own)
    perm, seg = _csr(i_own, own.size(0))
    _launch(1, own, own.size(0), own.size(1), dst.numel(), own, other, i_other, dst, norm, grad_out, perm, seg, grad)
    return grad
