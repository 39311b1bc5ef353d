"""Readouts and prediction heads of SAT (Chen et al., ICML 2022, Sec. 4.2 and 5.5).

Readouts: ``mean`` / ``sum`` pooling (in :class:`sat.SAT`) or ``cls``: a virtual [CLS] node per
graph without edges (Jain et al., 2021), whose attention gives SAT's attention maps. Heads: graph
classification / regression (MLP, ``[B, num_classes]``), ``node_classification`` (``[N, num_classes]``)
and ``code2_sequence`` (``max_seq_len`` linear layers as OGB's example, ``[B, max_seq_len, num_classes]``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .layout import GraphLayout


class ClsToken(nn.Module):
    """A learned [CLS] node per graph, placed before the graph's nodes (real node ``i`` of graph ``g``
    moves to ``i + g + 1``, the [CLS] node sits at ``ptr[g] + g``: the maps of a
    :class:`sat.layout.GraphLayout` with ``cls_token=True``). It has no edges; its k-subgraph is itself.
    """

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, hidden_dim) * hidden_dim**-0.5)

    def attach(
        self, x: Tensor, edge_index: Tensor, subgraph: Optional[dict[str, Tensor]], layout: GraphLayout
    ) -> tuple[Tensor, Tensor, Optional[dict[str, Tensor]]]:
        """Insert the [CLS] nodes: returns ``(x [N + B, d], edge_index, subgraph)`` in the ids of
        ``layout`` (a :class:`sat.layout.GraphLayout` built with ``cls_token=True``)."""
        node_pos, cls_pos = layout.real_index, layout.cls_index
        out = x.new_empty(layout.num_nodes, x.size(1))
        out[node_pos] = x
        out[cls_pos] = self.token.to(x.dtype).expand(layout.num_graphs, -1)
        if subgraph is not None:
            subgraph = dict(subgraph)
            subgraph["subgraph_node_index"] = torch.cat([node_pos[subgraph["subgraph_node_index"]], cls_pos])
            subgraph["subgraph_indicator"] = torch.cat([node_pos[subgraph["subgraph_indicator"]], cls_pos])
        return out, node_pos[edge_index], subgraph


class Head(nn.Module):
    """The prediction head of ``kind`` (see the module docstring).

    Shapes: graph heads take ``[B, d]`` and return ``[B, num_classes]`` (``code2_sequence``:
    ``[B, max_seq_len, num_classes]``); ``node_classification`` takes ``[N, d]``.
    """

    def __init__(self, kind: str, hidden_dim: int, num_classes: int, max_seq_len: int = 5):
        super().__init__()
        self.kind = kind
        if kind == "code2_sequence":
            self.seq = nn.ModuleList(nn.Linear(hidden_dim, num_classes) for _ in range(max_seq_len))
        else:
            self.mlp = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, num_classes))

    def forward(self, h: Tensor) -> Tensor:
        if self.kind == "code2_sequence":
            return torch.stack([lin(h) for lin in self.seq], dim=1)
        return self.mlp(h)
