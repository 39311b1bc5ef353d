"""Structure-aware multi-head self-attention (Chen et al., ICML 2022, Sec. 4.1, Eq. 3-4).

SAT's attention is a kernel smoother whose kernel compares *subgraph
representations* rather than node features:

    SA-attn(v) = sum_u  softmax_u( <W_Q phi(v, G), W_K phi(u, G)> / sqrt(d) )  W_V x_u

Queries and keys come from the structure extractor's output ``phi`` (see
:mod:`sat.extractors`), values from the node features ``x``. Every node attends
to every node of its own graph (a mini-batch is a disjoint union of graphs, so
attention never crosses graph boundaries; :class:`sat.layout.GraphLayout` says where
each graph's nodes are).

Three implementations share the same parameters:

* ``varlen`` (GPU): the packed nodes go straight into FlashAttention-2's
  variable-length kernel (:func:`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10),
  one sequence per graph, no padding, no mask, no per-shape plan. CUDA with bf16/fp16
  inputs only, and without attention dropout (the kernel has none).
* ``dense``: graphs are padded into ``[G, L, H, D]`` blocks (like
  :func:`torch_geometric.utils.to_dense_batch`) and fed to
  :func:`torch.nn.functional.scaled_dot_product_attention` with an additive
  float mask over padded keys. Graphs are grouped by size into a few blocks so
  that one large graph does not pad a whole batch to its size. On CUDA the cuDNN
  backend is excluded: it builds an execution plan per exact shape (0.15-0.8 s each on
  Hopper), and the blocks change shape with nearly every batch.
* ``sparse``: scatter softmax over the list of all intra-graph node pairs, the
  formulation of the authors' code. It is the reference for tests and the
  benchmark baseline. The per-pair products (scores and weighted values) run in
  chunks inside two small autograd functions that recompute the gathers in the
  backward pass, so memory grows with ``sum_g n_g^2 * heads`` rather than
  ``sum_g n_g^2 * d`` (the authors' code keeps the ``[pairs, d]`` gathers:
  19.6 GB at the benchmark settings).

``auto`` (the default) takes ``varlen`` where it applies (CUDA, bf16/fp16 inputs under
autocast, no attention dropout in training, no attention weights requested) and ``dense``
everywhere else, so the model computes the same function on every device: only the
kernel differs. With ``attn_dropout > 0`` in training, ``auto`` stays on ``dense``.

Attention weights, when requested, are returned densely as ``[B, H, L, L]``
(``L`` the largest graph of the batch; row = query, column = key, both in the
order of the graph's nodes, zero on padding).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.utils import softmax

from .layout import GraphLayout

ATTENTION_IMPLS = ("auto", "varlen", "dense", "sparse")
_HALF = (torch.bfloat16, torch.float16)

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


def varlen_available() -> bool:
    """Whether this torch build has the packed variable-length attention kernel and a GPU."""
    return _varlen_attn is not None and torch.cuda.is_available()


def _sdpa_backends(device: torch.device):
    """SDPA without cuDNN on CUDA (see the module docstring); the default choice elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _chunk_size(width: int) -> int:
    return max(1024, (1 << 23) // max(width, 1))  # ~32 MiB of fp32 per gathered chunk


class _PairDot(torch.autograd.Function):
    """``s[p, h] = <a[i[p], h, :], b[j[p], h, :]>`` over a pair list, in chunks.

    Saves only ``a``, ``b`` and the indices; the backward pass gathers again per chunk.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, i: Tensor, j: Tensor) -> Tensor:
        chunk = _chunk_size(a.size(1) * a.size(2))
        out = a.new_empty(i.numel(), a.size(1), dtype=torch.promote_types(a.dtype, b.dtype))
        for s in range(0, i.numel(), chunk):
            out[s : s + chunk] = (a[i[s : s + chunk]] * b[j[s : s + chunk]]).sum(-1)
        ctx.save_for_backward(a, b, i, j)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b, i, j = ctx.saved_tensors
        chunk = ctx.chunk
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.zeros(a.shape, dtype=grad.dtype, device=a.device)
            for s in range(0, i.numel(), chunk):
                grad_a.index_add_(0, i[s : s + chunk], grad[s : s + chunk, :, None] * b[j[s : s + chunk]])
            grad_a = grad_a.to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.zeros(b.shape, dtype=grad.dtype, device=b.device)
            for s in range(0, i.numel(), chunk):
                grad_b.index_add_(0, j[s : s + chunk], grad[s : s + chunk, :, None] * a[i[s : s + chunk]])
            grad_b = grad_b.to(b.dtype)
        return grad_a, grad_b, None, None


class _PairAggregate(torch.autograd.Function):
    """``out[n, h, :] = sum_{p : i[p] = n} w[p, h] * v[j[p], h, :]``, in chunks (recomputing the
    gathers in the backward pass)."""

    @staticmethod
    def forward(ctx, w: Tensor, v: Tensor, i: Tensor, j: Tensor, num_nodes: int) -> Tensor:
        chunk = _chunk_size(v.size(1) * v.size(2))
        dtype = torch.promote_types(w.dtype, v.dtype)
        out = torch.zeros(num_nodes, v.size(1), v.size(2), dtype=dtype, device=v.device)
        for s in range(0, i.numel(), chunk):
            out.index_add_(0, i[s : s + chunk], w[s : s + chunk, :, None].to(dtype) * v[j[s : s + chunk]].to(dtype))
        ctx.save_for_backward(w, v, i, j)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        w, v, i, j = ctx.saved_tensors
        chunk = ctx.chunk
        grad_w = grad_v = None
        if ctx.needs_input_grad[0]:
            grad_w = torch.empty(w.shape, dtype=grad.dtype, device=w.device)
            for s in range(0, i.numel(), chunk):
                grad_w[s : s + chunk] = (grad[i[s : s + chunk]] * v[j[s : s + chunk]]).sum(-1)
            grad_w = grad_w.to(w.dtype)
        if ctx.needs_input_grad[1]:
            grad_v = torch.zeros(v.shape, dtype=grad.dtype, device=v.device)
            for s in range(0, i.numel(), chunk):
                grad_v.index_add_(0, j[s : s + chunk], w[s : s + chunk, :, None].to(grad.dtype) * grad[i[s : s + chunk]])
            grad_v = grad_v.to(v.dtype)
        return grad_w, grad_v, None, None, None


class StructureAwareAttention(nn.Module):
    """Multi-head structure-aware self-attention (Sec. 4.1).

    Args:
        hidden_dim: ``d``, split into ``num_heads`` heads of ``d / num_heads``.
        num_heads: ``H``.
        dropout: dropout on the attention weights (``varlen`` has none; ``auto`` then uses ``dense``).
        impl: ``"auto"``, ``"varlen"``, ``"dense"`` or ``"sparse"`` (same parameters; switchable
            at any time; see the module docstring).
        bias: bias of the query/key/value projections (off, as in the authors' code).

    Shapes:
        forward(x ``[N, d]``, x_struct ``[N, d]``, layout) -> ``([N, d], weights)`` where
        ``weights`` is ``None`` or ``[B, H, L, L]`` (see the module docstring).
    """

    def __init__(self, hidden_dim: int, num_heads: int, dropout: float = 0.0, impl: str = "auto", bias: bool = False):
        super().__init__()
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim {hidden_dim} is not divisible by num_heads {num_heads}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl: expected one of {list(ATTENTION_IMPLS)}, got {impl!r}")
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.dropout = dropout
        self.impl = impl
        self.to_qk = nn.Linear(hidden_dim, 2 * hidden_dim, bias=bias)
        self.to_v = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.to_qk.weight)
        nn.init.xavier_uniform_(self.to_v.weight)
        for lin in (self.to_qk, self.to_v):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.out_proj.reset_parameters()
        nn.init.zeros_(self.out_proj.bias)

    def forward(
        self, x: Tensor, x_struct: Tensor, layout: GraphLayout, return_attention: bool = False
    ) -> tuple[Tensor, Optional[Tensor]]:
        H, D = self.num_heads, self.head_dim
        q, k = self.to_qk(x_struct).chunk(2, dim=-1)
        v = self.to_v(x)
        q, k, v = (t.reshape(-1, H, D) for t in (q, k, v))
        impl = self.resolve_impl(q, return_attention)
        if impl == "varlen":
            out, weights = self._varlen(q, k, v, layout), None
        elif impl == "sparse":
            out, weights = self._sparse(q, k, v, layout, return_attention)
        else:
            out, weights = self._dense(q, k, v, layout, return_attention)
        return self.out_proj(out.reshape(-1, H * D)), weights

    def resolve_impl(self, q: Tensor, return_attention: bool = False) -> str:
        """The implementation that runs for queries ``q`` (``auto`` resolved; ``varlen`` checked)."""
        dropout_active = self.training and self.dropout > 0
        usable = _varlen_attn is not None and q.is_cuda and q.dtype in _HALF and not dropout_active
        if self.impl == "auto":
            return "varlen" if usable and not return_attention else "dense"
        if self.impl == "varlen" and (not usable or return_attention):
            raise ValueError(
                "attention 'varlen' needs torch >= 2.10, CUDA tensors in bf16/fp16 (autocast), no attention "
                f"dropout in training and no attention weights (got {q.device.type} {q.dtype}, "
                f"attn_dropout {self.dropout}); use attention 'auto' to fall back to 'dense'"
            )
        return self.impl

    def _varlen(self, q: Tensor, k: Tensor, v: Tensor, layout: GraphLayout) -> Tensor:
        # one sequence per graph; the kernel wants a unit stride on the head dimension only,
        # but q and k are column halves of one projection: make them dense rows
        cu, L = layout.cu_seqlens, layout.max_nodes
        return _varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, L, L)

    def _sparse(self, q: Tensor, k: Tensor, v: Tensor, layout: GraphLayout, return_attention: bool):
        tgt, src = layout.pairs()
        scores = _PairDot.apply(q, k, tgt, src) * (self.head_dim**-0.5)  # [P, H]
        attn = softmax(scores, tgt, num_nodes=layout.num_nodes)
        weights = None
        if return_attention:
            B, L = layout.num_graphs, layout.max_nodes
            weights = attn.new_zeros(B, L, L, self.num_heads)
            weights[layout.batch[tgt], layout.local_index[tgt], layout.local_index[src]] = attn
            weights = weights.permute(0, 3, 1, 2)
        attn = F.dropout(attn, p=self.dropout, training=self.training)
        out = _PairAggregate.apply(attn, v, tgt, src, layout.num_nodes)
        return out, weights

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, layout: GraphLayout, return_attention: bool):
        H, D = self.num_heads, self.head_dim
        parts = []
        weights = None
        for nodes, flat, G, L in layout.dense_groups(bucketed=not return_attention):
            blocks = []
            for t in (q, k, v):
                block = t.new_zeros(G * L, H, D)
                block[flat] = t[nodes]
                blocks.append(block.view(G, L, H, D).transpose(1, 2))  # [G, H, L, D]
            valid = torch.zeros(G * L, dtype=torch.bool, device=q.device)
            valid.index_fill_(0, flat, True)  # (valid[flat] = True copies a host scalar: a sync)
            # Additive float mask over padded keys. A finite minimum (not -inf) keeps every row
            # finite, padded query rows included (they are dropped below anyway).
            mask = torch.zeros(G * L, dtype=blocks[0].dtype, device=q.device)
            mask.masked_fill_(~valid, torch.finfo(mask.dtype).min)
            mask = mask.view(G, 1, 1, L)
            if return_attention:
                scores = blocks[0] @ blocks[1].transpose(-1, -2) * (D**-0.5) + mask
                attn = scores.softmax(dim=-1)
                weights = attn * valid.view(G, 1, L, 1).to(attn.dtype)
                res = F.dropout(attn, p=self.dropout, training=self.training) @ blocks[2]
            else:
                with _sdpa_backends(q.device):
                    res = F.scaled_dot_product_attention(
                        blocks[0], blocks[1], blocks[2], attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
                    )
            parts.append((nodes, res.transpose(1, 2).reshape(G * L, H, D)[flat]))
        if len(parts) == 1 and parts[0][0].numel() == layout.num_nodes:
            return parts[0][1], weights  # one block holding every node, in order
        out = q.new_zeros(layout.num_nodes, H, D, dtype=parts[0][1].dtype if parts else q.dtype)
        for nodes, res in parts:
            out = out.index_copy(0, nodes, res)
        return out, weights
