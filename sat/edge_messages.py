"""Sum of OGB-GCN edge messages, fused into one pass per output row (Triton) or in plain torch.

:class:`sat.extractors.EdgeGCNConv` sums ``norm_uv * relu(W x_u + E e_uv)`` into ``v``; in SAT's
k-subgraph extractor (Chen et al., ICML 2022, Sec. 4.1) over many subgraph edges. ``impl="fused"``
does it in one Triton kernel: each output row walks its edges in CSR order, accumulates in fp32
(fp64 for fp64) and is written once; the backward recomputes the ReLU mask; nothing ``[Es, d]`` is
kept, no atomics, and GCN's root term (:class:`RootTerm`) is one more edge per row.
``impl="auto"``: the kernel on CUDA with Triton, else torch (CPU runs it only in Triton's interpreter)."""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
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
    return impl


class Grouping:
    """An index ``[E]`` into ``num_rows`` rows and its CSR grouping (:meth:`csr`), sorted on first
    use and kept: sums over the same edges share one, so it is sorted once per batch."""

    def __init__(self, index: Tensor, num_rows: int):
        self.index = index.contiguous().long()
        self.num_rows = num_rows
        self._csr: Optional[tuple[Tensor, Tensor]] = None

    def csr(self) -> tuple[Tensor, Tensor]:
        """``(perm [E], seg [num_rows + 1])``: the edges in row order and each row's segment of
        ``perm`` (no host sync)."""
        if self._csr is None:
            keys, perm = torch.sort(self.index)
            rows = torch.arange(self.num_rows + 1, device=keys.device, dtype=keys.dtype)
            self._csr = perm, torch.searchsorted(keys, rows)
        return self._csr


class RootTerm(NamedTuple):
    """A message from every output row to itself, ``out[v] += weight[v] * relu(a[index[v]] + bias)``
    (OGB-GCN's root term ``relu(W x_v + r) / deg_v``; the bias goes to :func:`aggregate_edge_messages`).
    ``index [num_out]`` (``None``: row ``v`` of ``a`` for output ``v``), ``weight [num_out]``."""

    index: Optional[Tensor]
    weight: Tensor


class MessageEdges(NamedTuple):
    """The edges of :func:`aggregate_edge_messages`: edge ``j`` adds ``norm[j] * relu(a[ia[j]] +
    b[ib[j]])`` to output row ``dst[j]``. With a root term its ``num_out`` edges ``index[v] -> v``
    follow the ``num_edges`` others and read row ``num_b`` of ``b``, where the bias goes.

    Build with :func:`message_edges`; :meth:`with_sources` gives the same edges from other rows,
    sharing the groupings, so each is sorted once per batch.
    """

    ia: Grouping  # rows of a
    ib: Grouping  # rows of b, and row num_b for the root edges
    dst: Grouping  # output rows
    norm: Tensor  # [num_edges (+ num_out)]: the edge weights, then the root weights
    num_edges: int
    has_root: bool
    root_identity: bool  # the root edge of output v reads row v of a

    @property
    def num_b(self) -> int:
        return self.ib.num_rows - int(self.has_root)

    def with_sources(self, ia: Tensor, num_a: int, root_index: Optional[Tensor] = None) -> "MessageEdges":
        """The same edges, weights and destinations (sharing their groupings) from rows ``ia``
        ``[num_edges]`` of another ``a [num_a, d]``; the root edges, if any, read ``root_index``
        (``None``: row ``v`` for output ``v``)."""
        if self.has_root:
            num_out = self.dst.num_rows
            if root_index is None and num_a != num_out:
                raise ValueError(f"message_edges: a root term without index needs a row of a per output, got {num_a} "
                                 f"rows for {num_out} outputs")
            roots = torch.arange(num_out, device=ia.device) if root_index is None else root_index.long()
            ia = torch.cat([ia.long(), roots])
        return self._replace(ia=Grouping(ia, num_a), root_identity=self.has_root and root_index is None)


def message_edges(
    ia: Tensor, ib: Tensor, dst: Tensor, norm: Tensor, num_a: int, num_b: int, num_out: int,
    root: Optional[RootTerm] = None,
) -> MessageEdges:
    """The edges ``ia[j], ib[j] -> dst[j]`` (rows of ``a [num_a, d]`` and ``b [num_b, d]``, into
    ``num_out`` outputs) with weights ``norm [Es]``, and ``root``'s edges after them; the weights
    are kept in the wider of their dtypes (fp32, or fp64 for fp64 sums)."""
    num_edges = dst.numel()
    if root is not None:
        outputs = torch.arange(num_out, device=dst.device)
        ib = torch.cat([ib.long(), outputs.new_full((num_out,), num_b)])
        dst = torch.cat([dst.long(), outputs])
        wide = torch.promote_types(norm.dtype, root.weight.dtype)
        norm = torch.cat([norm.to(wide), root.weight.to(wide)])
    has_root = root is not None
    edges = MessageEdges(Grouping(ia, num_a), Grouping(ib, num_b + has_root), Grouping(dst, num_out), norm, num_edges,
                         has_root, False)
    return edges.with_sources(ia, num_a, root.index) if has_root else edges


def aggregate_edge_messages(a: Tensor, b: Tensor, edges: MessageEdges, bias: Optional[Tensor] = None,
                            impl: MessageImpl = "auto", linear: Optional[nn.Linear] = None) -> Tensor:
    """``out[v] = sum_{j: dst[j] = v} norm[j] * relu(a[ia[j]] + b[ib[j]])`` over ``edges``, plus
    their root term with ``bias`` (see :class:`MessageEdges`).

    ``linear``: the sum reads ``linear(a)``, which the fused path recomputes in the backward pass
    rather than keeping it.

    Shapes: a ``[Na, d]`` (``[Na, d_in]`` with ``linear``), b ``[Nb, d]``, bias ``[d]`` ->
    ``[num_out, d]`` in the dtype of ``a`` (of ``linear(a)``; ``b`` is cast to it, the bias added as
    ``a + bias`` would be; ``fused`` sums in fp32, fp64 for fp64 inputs, and rounds once).
    """
    width = a.size(-1) if linear is None else linear.out_features
    if a.dim() != 2 or b.dim() != 2 or width != b.size(1):
        raise ValueError(f"aggregate_edge_messages: a {tuple(a.shape)} (width {width} after linear) and b "
                         f"{tuple(b.shape)} must be [rows, d] alike")
    if (a.size(0), b.size(0)) != (edges.ia.num_rows, edges.num_b):
        raise ValueError(f"aggregate_edge_messages: the edges index {edges.ia.num_rows} rows of a and {edges.num_b} of b, "
                         f"got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if (bias is not None) != edges.has_root:
        raise ValueError("aggregate_edge_messages: a root bias goes with edges built with a root term, and only with them")
    if resolve_impl(impl, a.device) == "fused":
        weight, lin_bias = (None, None) if linear is None else (linear.weight, linear.bias)
        return _FusedAggregate.apply(a, weight, lin_bias, b, bias, edges)
    if linear is not None:
        a = linear(a)
    b = b.to(a.dtype)
    graph_edges = slice(0, edges.num_edges)
    ia, ib, dst = (g.index[graph_edges] for g in edges[:3])
    message = F.relu(a.index_select(0, ia) + b.index_select(0, ib)) * edges.norm[graph_edges].to(a.dtype).view(-1, 1)
    out = scatter(message, dst, dim=0, dim_size=edges.dst.num_rows, reduce="sum")
    if edges.has_root:
        roots = slice(edges.num_edges, None)
        own = a if edges.root_identity else a.index_select(0, edges.ia.index[roots])
        out = out + (F.relu(own + bias) * edges.norm[roots].view(-1, 1)).to(a.dtype)
    return out


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two kernels, jitted. Triton reads ``TRITON_INTERPRET`` when it is first imported: with
    ``1`` they run in its CPU interpreter (how the CPU tests run them), else they compile for CUDA."""
    import triton

    from . import _edge_message_kernels as source

    return triton.jit(source.aggregate_kernel), triton.jit(source.input_grad_kernel)


# Launch configurations (BLOCK_E edges per loop step, BLOCK_D columns per program, warps per
# program): few warps keep many short rows in flight; long rows want wide edge tiles.
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


class _FusedAggregate(torch.autograd.Function):
    """The root edges read the bias as row ``Nb`` of ``b``, appended here (widened as torch's
    ``a + bias`` would be); the bias's gradient is a chunked torch reduction. With a linear map,
    ``a = F.linear(x, weight, lin_bias)`` is formed here under the caller's autocast, and again in
    the backward pass in the same dtype."""

    @staticmethod
    def forward(ctx, x, weight, lin_bias, b, bias, edges: MessageEdges):
        a = x if weight is None else F.linear(x, weight, lin_bias)
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        b = b.to(a.dtype)
        a = a.contiguous()
        if bias is not None:
            wide = torch.promote_types(a.dtype, bias.dtype)  # as torch's a + bias: an fp32 bias stays fp32
            b = torch.cat([b.to(wide), bias.to(wide).view(1, -1)])
        b = b.contiguous()
        num_out, width = edges.dst.num_rows, a.size(1)
        out = a.new_empty(num_out, width)
        _launch(0, a, num_out, width, edges.dst.index.numel(), a, b, edges.ia.index, edges.ib.index,
                _weights(edges, a), *edges.dst.csr(), out)
        ctx.edges, ctx.bias_dtype = edges, None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight, lin_bias, b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, lin_bias, b = ctx.saved_tensors
        edges: MessageEdges = ctx.edges
        dtype = ctx.a_dtype
        if weight is None:
            a = x.contiguous()
        else:  # W x again, in the forward's dtype (autocast is off in the backward pass)
            x_, weight_ = x.to(dtype), weight.to(dtype)
            a = F.linear(x_, weight_, None if lin_bias is None else lin_bias.to(dtype)).contiguous()
        norm, dst = _weights(edges, a), edges.dst.index
        grad_out = grad_out.contiguous().to(dtype)
        grad_x = grad_weight = grad_lin_bias = grad_a = grad_b = grad_bias = None
        if any(ctx.needs_input_grad[:3]):  # over the edges and the root edges
            grad_a = _input_grad(a, b, edges.ia, edges.ib.index, dst, norm, grad_out, dst.numel())
        if ctx.needs_input_grad[3]:  # over the edges: the root edges read the bias row, left out here
            grad_b = _input_grad(b[: edges.num_b], a, edges.ib, edges.ia.index, dst, norm, grad_out, edges.num_edges)
            grad_b = grad_b.to(ctx.b_dtype)
        if ctx.needs_input_grad[4]:
            roots = slice(edges.num_edges, None)
            grad_bias = _root_bias_grad(a, b[edges.num_b], edges.ia.index[roots], norm[roots], grad_out,
                                        edges.root_identity).to(ctx.bias_dtype)
        if weight is None:
            grad_x = grad_a
        elif grad_a is not None:  # the linear map's backward, in its forward dtype as autocast runs it
            if ctx.needs_input_grad[0]:
                grad_x = (grad_a @ weight_).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_a.T @ x_).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                grad_lin_bias = grad_a.sum(0).to(lin_bias.dtype)
        return grad_x, grad_weight, grad_lin_bias, grad_b, grad_bias, None


def _weights(edges: MessageEdges, a: Tensor) -> Tensor:
    """The edge weights in the kernels' accumulation precision: fp64 for fp64 inputs, else fp32."""
    return edges.norm.to(torch.float64 if a.dtype == torch.float64 else torch.float32).contiguous()


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


def _input_grad(own: Tensor, other: Tensor, own_rows: Grouping, i_other: Tensor, dst: Tensor, norm: Tensor,
                grad_out: Tensor, num_edges: int) -> Tensor:
    """The gradient into the rows of ``own``, each over its edges in ``own_rows`` (whose root bias
    row, past the end of ``own``, gets no program)."""
    grad = torch.empty_like(own)
    _launch(1, own, own.size(0), own.size(1), num_edges, own, other, i_other, dst, norm, grad_out, *own_rows.csr(), grad)
    return grad
