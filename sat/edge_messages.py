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
or materialised, and no atomics are used. GCN's root term (:class:`RootTerm`) joins the same sum
as one more edge per output row, so under autocast the layer's output is one bf16 tensor rounded
once, instead of bf16 messages plus an fp32 root term and their fp32 sum.

On CUDA the kernels are compiled; CPU tensors run them only in Triton's interpreter (slow; the
CPU tests do so). ``impl="auto"`` takes the kernel on CUDA when Triton is installed, torch otherwise.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple, Optional

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


class RootTerm(NamedTuple):
    """A message from every output row to itself: ``out[v] += weight[v] * relu(a[index[v]] + bias)``
    (OGB-GCN's root term ``relu(W x_v + r) / deg_v``).

    Shapes: index ``[num_out]`` rows of ``a``, or ``None`` when row ``v`` of ``a`` is output row
    ``v``; bias ``[d]``; weight ``[num_out]``.
    """

    index: Optional[Tensor]
    bias: Tensor
    weight: Tensor


def aggregate_edge_messages(
    a: Tensor, b: Tensor, ia: Tensor, ib: Tensor, dst: Tensor, norm: Tensor, num_out: int, impl: MessageImpl = "auto",
    root: Optional[RootTerm] = None,
) -> Tensor:
    """``out[v] = sum_{j: dst[j] = v} norm[j] * relu(a[ia[j]] + b[ib[j]])``, plus ``root``'s term.

    Shapes: a ``[Na, d]``, b ``[Nb, d]``, ia / ib / dst / norm ``[Es]`` -> ``[num_out, d]`` in the
    dtype of ``a`` (``b`` is cast to it; the root bias is added in the wider of its dtype and
    ``a``'s, as ``a + bias`` would be; ``fused`` sums in fp32, fp64 for fp64 inputs, and rounds each
    output once). Differentiable in ``a``, ``b`` and the root bias.
    """
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(1):
        raise ValueError(f"aggregate_edge_messages: a {tuple(a.shape)} and b {tuple(b.shape)} must be [rows, d] alike")
    if root is not None and root.index is None and a.size(0) != num_out:
        raise ValueError(f"aggregate_edge_messages: a root term without index needs a row per output, got {a.size(0)} "
                         f"rows for {num_out} outputs")
    b = b.to(a.dtype)
    if resolve_impl(impl, a.device) == "torch":
        message = F.relu(a.index_select(0, ia) + b.index_select(0, ib)) * norm.to(a.dtype).view(-1, 1)
        out = scatter(message, dst, dim=0, dim_size=num_out, reduce="sum")
        if root is not None:
            own = a if root.index is None else a.index_select(0, root.index)
            out = out + (F.relu(own + root.bias) * root.weight.view(-1, 1)).to(a.dtype)
        return out
    root_index, bias, root_weight = root if root is not None else (None, None, None)
    return _FusedAggregate.apply(a, b, bias, ia, ib, dst, norm, root_index, root_weight, num_out)


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
    """The root term runs as ``num_out`` more edges ``index[v] -> v`` whose ``b`` row is the bias,
    appended as row ``Nb`` (``b`` widened to the bias's dtype where that is wider, fp32 under
    autocast, so that the ReLU sees ``a + bias`` as torch computes it). The same kernels then add
    it to each output row before its one rounding, and nothing of size ``[num_out, d]`` is kept
    for it. The bias's gradient, a sum over all outputs (one very long kernel row), is a chunked
    torch reduction instead."""

    @staticmethod
    def forward(ctx, a, b, bias, ia, ib, dst, norm, root_index, root_weight, num_out):
        acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        a, b = a.contiguous(), b.contiguous()
        ia, ib, dst, norm = _index(ia), _index(ib), _index(dst), norm.to(acc_dtype)
        ctx.num_edges, ctx.num_b, ctx.root_identity = dst.numel(), b.size(0), root_index is None
        ctx.bias_dtype = None if bias is None else bias.dtype
        if bias is not None:
            outputs = torch.arange(num_out, device=a.device)
            wide = torch.promote_types(a.dtype, bias.dtype)  # as torch's a + bias: an fp32 bias stays fp32
            b = torch.cat([b.to(wide), bias.to(wide).view(1, -1)])
            ia = torch.cat([ia, outputs if root_index is None else _index(root_index)])
            ib = torch.cat([ib, outputs.new_full((num_out,), ctx.num_b)])
            dst = torch.cat([dst, outputs])
            norm = torch.cat([norm, root_weight.to(acc_dtype)])
        norm = norm.contiguous()
        out = a.new_empty(num_out, a.size(1))
        perm, seg = _csr(dst, num_out)
        _launch(0, a, num_out, a.size(1), dst.numel(), a, b, ia, ib, norm, perm, seg, out)
        ctx.save_for_backward(a, b, ia, ib, dst, norm)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, ia, ib, dst, norm = ctx.saved_tensors
        grad_out = grad_out.contiguous().to(a.dtype)
        grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:  # over the edges and the root term's
            grad_a = _input_grad(a, b, ia, ib, dst, norm, grad_out)
        edges = slice(0, ctx.num_edges)
        if ctx.needs_input_grad[1]:
            grad_b = _input_grad(b[: ctx.num_b], a, ib[edges], ia[edges], dst[edges], norm[edges], grad_out)
            grad_b = grad_b.to(a.dtype)  # b came in a's dtype
        if ctx.needs_input_grad[2]:
            grad_bias = _root_bias_grad(a, b[ctx.num_b], ia[ctx.num_edges:], norm[ctx.num_edges:], grad_out,
                                        ctx.root_identity).to(ctx.bias_dtype)
        return grad_a, grad_b, grad_bias, None, None, None, None, None, None, None


ROOT_GRAD_ROWS = 1 << 16  # outputs per chunk of the root bias's gradient: bounds its temporaries


def _root_bias_grad(a: Tensor, bias: Tensor, index: Tensor, weight: Tensor, grad_out: Tensor, identity: bool) -> Tensor:
    """``sum_v weight[v] * grad_out[v] * (a[index[v]] + bias > 0)`` (the ReLU mask as the kernel
    computes it), accumulated in ``weight``'s dtype, a chunk of outputs at a time."""
    total = torch.zeros(bias.numel(), dtype=weight.dtype, device=a.device)
    for start in range(0, grad_out.size(0), ROOT_GRAD_ROWS):
        rows = slice(start, start + ROOT_GRAD_ROWS)
        own = a[rows] if identity else a.index_select(0, index[rows])
        gated = torch.where((own + bias) > 0, grad_out[rows], 0)
        total += gated.T.to(weight.dtype) @ weight[rows]
    return total


def _input_grad(own: Tensor, other: Tensor, i_own: Tensor, i_other: Tensor, dst: Tensor, norm: Tensor,
                grad_out: Tensor) -> Tensor:
    grad = torch.empty_like(own)
    perm, seg = _csr(i_own, own.size(0))
    _launch(1, own, own.size(0), own.size(1), dst.numel(), own, other, i_other, dst, norm, grad_out, perm, seg, grad)
    return grad
