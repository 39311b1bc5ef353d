"""Structure-aware multi-head self-attention (Chen et al., ICML 2022, Sec. 4.1, Eq. 3-4).

    SA-attn(v) = sum_u  softmax_u( <W_Q phi(v, G), W_K phi(u, G)> / sqrt(d) )  W_V x_u

Queries and keys come from the structure extractor's output, values from ``x``; every node attends
to its own graph. Implementations sharing the parameters: ``varlen`` (FlashAttention's packed
kernel; torch >= 2.10, CUDA, bf16/fp16, no attention dropout), ``dense`` (size-grouped padded
blocks into ``scaled_dot_product_attention``, without cuDNN, which re-plans every shape).
``auto``: ``varlen`` where it applies, else ``dense``. Attention weights are ``[B, H, L, L]``."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layout import GraphLayout

ATTENTION_IMPLS = ("auto", "varlen", "dense")
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


class StructureAwareAttention(nn.Module):
    """Multi-head structure-aware self-attention (Sec. 4.1): ``num_heads`` heads of ``hidden_dim /
    num_heads``, ``dropout`` on the attention weights, ``impl`` switchable at any time (the module
    docstring); the query/key/value projections have no bias, as in the authors' code.

    Shapes: forward(x ``[N, d]``, x_struct ``[N, d]``, layout) -> ``([N, d], None or [B, H, L, L])``.
    """

    def __init__(self, hidden_dim: int, num_heads: int, dropout: float = 0.0, impl: str = "auto"):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.dropout = dropout
        self.impl = impl
        self.to_qk = nn.Linear(hidden_dim, 2 * hidden_dim, bias=False)
        self.to_v = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim)
        nn.init.xavier_uniform_(self.to_qk.weight)
        nn.init.xavier_uniform_(self.to_v.weight)
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
