"""Structure-aware multi-head self-attention (Chen et al., ICML 2022, Sec. 4.1, Eq. 3-4).

SAT's attention is a kernel smoother whose kernel compares *subgraph
representations* rather than node features:

    SA-attn(v) = sum_u  softmax_u( <W_Q phi(v, G), W_K phi(u, G)> / sqrt(d) )  W_V x_u

Queries and keys come from the structure extractor's output ``phi`` (see
:mod:`sat.extractors`), values from the node features ``x``. Every node attends
to every node of its own graph (a mini-batch is a disjoint union of graphs, so
attention never crosses graph boundaries).

Two interchangeable implementations share the same parameters:

* ``dense`` (default): graphs are padded into ``[G, L, H, D]`` blocks (like
  :func:`torch_geometric.utils.to_dense_batch`) and fed to
  :func:`torch.nn.functional.scaled_dot_product_attention` with an additive
  float mask over padded keys. Graphs are grouped by size into a few blocks so
  that one large graph does not pad a whole batch to its size.
* ``sparse``: scatter softmax over the list of all intra-graph node pairs, the
  formulation of the authors' code. It is the reference for tests and the
  benchmark baseline. The per-pair products (scores and weighted values) run in
  chunks inside two small autograd functions that recompute the gathers in the
  backward pass, so memory grows with ``sum_g n_g^2 * heads`` rather than
  ``sum_g n_g^2 * d`` (the authors' code keeps the ``[pairs, d]`` gathers:
  19.6 GB at the benchmark settings).

Attention weights, when requested, are returned densely as ``[B, H, L, L]``
(``L`` the largest graph of the batch; row = query, column = key, both in the
order of the graph's nodes, zero on padding).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.utils import softmax

ATTENTION_IMPLS = ("dense", "sparse")


class GraphLayout:
    """Index bookkeeping of a mini-batch of graphs, computed once per forward pass and
    shared by all layers' attention.

    Args:
        batch: ``[N]`` graph id of every node, sorted (PyG's ``Batch.batch``).
        num_graphs: ``B``.
        bucket_ratio: dense attention groups graphs whose sizes differ by at most this
            factor into one padded block; ``None`` pads all graphs to the largest one.
    """

    def __init__(self, batch: Tensor, num_graphs: int, bucket_ratio: Optional[float] = 1.5) -> None:
        self.batch = batch
        self.num_graphs = int(num_graphs)
        self.num_nodes = batch.numel()
        self.counts = torch.bincount(batch, minlength=self.num_graphs)
        self.ptr = torch.cat([self.counts.new_zeros(1), self.counts.cumsum(0)])
        self.local_index = torch.arange(self.num_nodes, device=batch.device) - self.ptr[batch]
        self.bucket_ratio = bucket_ratio
        self._sizes: Optional[list[int]] = None
        self._groups: dict[bool, list[tuple[Tensor, Tensor, int, int]]] = {}
        self._pairs: Optional[tuple[Tensor, Tensor]] = None

    @property
    def sizes(self) -> list[int]:
        """Number of nodes of every graph (a host copy, taken once)."""
        if self._sizes is None:
            self._sizes = self.counts.tolist()
        return self._sizes

    @property
    def max_nodes(self) -> int:
        return max(self.sizes, default=0)

    def dense_groups(self, bucketed: bool = True) -> list[tuple[Tensor, Tensor, int, int]]:
        """Padded blocks for dense attention.

        Returns a list of ``(nodes, flat, G, L)``: the ids of the block's nodes ``[n]``, their
        position ``graph_slot * L + local_index`` in the block ``[G, L]``, the number of graph
        slots ``G`` and the padded length ``L``. Unbucketed, there is one block whose slot of
        graph ``g`` is ``g`` (so it can be returned as ``[B, ...]``).
        """
        bucketed = bucketed and self.bucket_ratio is not None
        if bucketed in self._groups:
            return self._groups[bucketed]
        device = self.batch.device
        if not bucketed:
            nodes = torch.arange(self.num_nodes, device=device)
            L = self.max_nodes
            groups = [(nodes, self.batch * L + self.local_index, self.num_graphs, L)]
        else:
            sizes = self.sizes
            order = sorted((g for g in range(self.num_graphs) if sizes[g] > 0), key=lambda g: -sizes[g])
            runs: list[list[int]] = []
            for g in order:
                if runs and sizes[g] * self.bucket_ratio >= sizes[runs[-1][0]]:
                    runs[-1].append(g)
                else:
                    runs.append([g])
            if len(runs) == 1 and len(runs[0]) == self.num_graphs:
                groups = self.dense_groups(bucketed=False)
            else:
                slot = torch.full((self.num_graphs,), -1, dtype=torch.long)
                group_of = torch.full((self.num_graphs,), -1, dtype=torch.long)
                for gid, run in enumerate(runs):
                    slot[run] = torch.arange(len(run))
                    group_of[run] = gid
                slot, group_of = slot.to(device), group_of.to(device)
                node_group = group_of[self.batch]
                groups = []
                for gid, run in enumerate(runs):
                    nodes = (node_group == gid).nonzero().view(-1)
                    L = sizes[run[0]]
                    flat = slot[self.batch[nodes]] * L + self.local_index[nodes]
                    groups.append((nodes, flat, len(run), L))
        self._groups[bucketed] = groups
        return groups

    def pairs(self) -> tuple[Tensor, Tensor]:
        """All intra-graph ordered node pairs ``(target, source)``, each ``[sum_g n_g^2]``,
        sorted by target (sparse attention)."""
        if self._pairs is None:
            size_of_node = self.counts[self.batch]
            device = self.batch.device
            tgt = torch.repeat_interleave(torch.arange(self.num_nodes, device=device), size_of_node)
            start = size_of_node.cumsum(0) - size_of_node
            offset = torch.arange(tgt.numel(), device=device) - torch.repeat_interleave(start, size_of_node)
            src = self.ptr[self.batch][tgt] + offset
            self._pairs = (tgt, src)
        return self._pairs


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
        dropout: dropout on the attention weights.
        impl: ``"dense"`` or ``"sparse"`` (same parameters; switchable at any time).
        bias: bias of the query/key/value projections (off, as in the authors' code).

    Shapes:
        forward(x ``[N, d]``, x_struct ``[N, d]``, layout) -> ``([N, d], weights)`` where
        ``weights`` is ``None`` or ``[B, H, L, L]`` (see the module docstring).
    """

    def __init__(self, hidden_dim: int, num_heads: int, dropout: float = 0.0, impl: str = "dense", bias: bool = False):
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
        if self.impl == "sparse":
            out, weights = self._sparse(q, k, v, layout, return_attention)
        else:
            out, weights = self._dense(q, k, v, layout, return_attention)
        return self.out_proj(out.reshape(-1, H * D)), weights

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
            valid[flat] = True
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
