"""Structure-aware multi-head self-attention (Chen et al., ICML 2022, Sec. 4.1, Eq. 3-4).

    SA-attn(v) = sum_u  softmax_u( <W_Q phi(v, G), W_K phi(u, G)> / sqrt(d) )  W_V x_u

Queries and keys come from the structure extractor's output, values from ``x``; every node attends
to its own graph. Implementations sharing the parameters: ``varlen`` (FlashAttention's packed
kernel; torch >= 2.10, CUDA, bf16/fp16, no attention dropout), ``dense`` (size-grouped padded
blocks into ``scaled_dot_product_attention``, without cuDNN, which re-plans every shape) and
``sparse`` (scatter softmax over node pairs, as the authors' code; memory ``sum_g n_g^2 * heads``).
``auto``: ``varlen`` where it applies, else ``dense``. Attention weights are ``[B, H, L, L]``."""
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


def _pair_dot(x: Tensor, y: Tensor, i: Tensor, j: Tensor, dtype: torch.dtype) -> Tensor:
    """``out[p, h] = <x[i[p], h, :], y[j[p], h, :]>``, a chunk of pairs at a time."""
    chunk = _chunk_size(x.size(1) * x.size(2))
    out = x.new_empty(i.numel(), x.size(1), dtype=dtype)
    for s in range(0, i.numel(), chunk):
        out[s : s + chunk] = (x[i[s : s + chunk]] * y[j[s : s + chunk]]).sum(-1)
    return out


def _pair_sum(w: Tensor, x: Tensor, i: Tensor, j: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """``out[n, h, :] = sum_{p : i[p] = n} w[p, h] * x[j[p], h, :]`` (``[rows, H, D]``), a chunk at a time."""
    chunk = _chunk_size(x.size(1) * x.size(2))
    out = torch.zeros(rows, x.size(1), x.size(2), dtype=dtype, device=x.device)
    for s in range(0, i.numel(), chunk):
        pairs = slice(s, s + chunk)
        out.index_add_(0, i[pairs], (w[pairs, :, None] * x[j[pairs]]).to(dtype))
    return out


class _PairDot(torch.autograd.Function):
    """``s[p, h] = <a[i[p], h, :], b[j[p], h, :]>``; saves only ``a``, ``b`` and the indices (the
    backward pass gathers again)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ctx.save_for_backward(a, b, i, j)
        return _pair_dot(a, b, i, j, torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b, i, j = ctx.saved_tensors
        grad_a = _pair_sum(grad, b, i, j, a.size(0), grad.dtype).to(a.dtype) if ctx.needs_input_grad[0] else None
        grad_b = _pair_sum(grad, a, j, i, b.size(0), grad.dtype).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None


class _PairAggregate(torch.autograd.Function):
    """``out[n, h, :] = sum_{p : i[p] = n} w[p, h] * v[j[p], h, :]``, recomputing the gathers in the
    backward pass."""

    @staticmethod
    def forward(ctx, w: Tensor, v: Tensor, i: Tensor, j: Tensor, num_nodes: int) -> Tensor:
        ctx.save_for_backward(w, v, i, j)
        return _pair_sum(w, v, i, j, num_nodes, torch.promote_types(w.dtype, v.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        w, v, i, j = ctx.saved_tensors
        grad_w = _pair_dot(grad, v, i, j, grad.dtype).to(w.dtype) if ctx.needs_input_grad[0] else None
        grad_v = _pair_sum(w, grad, j, i, v.size(0), grad.dtype).to(v.dtype) if ctx.needs_input_grad[1] else None
        return grad_w, grad_v, None, None, None


class StructureAwareAttention(nn.Module):
    """Multi-head structure-aware self-attention (Sec. 4.1): ``num_heads`` heads of ``hidden_dim /
    num_heads``, ``dropout`` on the attention weights, ``impl`` switchable at any time (the module
    docstring), ``bias`` of the query/key/value projections off as in the authors' code.

    Shapes: forward(x ``[N, d]``, x_struct ``[N, d]``, layout) -> ``([N, d], None or [B, H, L, L])``.
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
