"""The SAT encoder layer (Chen et al., ICML 2022, Sec. 4.2, Fig. 1), and the base GNN's layer.

One layer = structure extractor + structure-aware attention + skip connection with the degree
factor + FFN, each sub-block followed (post-norm) or preceded (pre-norm) by a normalisation layer:

    x' = x + dropout(d_v^{-1/2} * SA-attn(v))     (degree factor optional)
    x'' = x' + dropout(W_2 dropout(relu(W_1 x')))

The degree factor reduces the influence of highly connected components (after Mialon et al.,
GraphiT). Each layer owns its structure extractor, applied to the layer's input.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import StructureAwareAttention
from .config import EDGE_AWARE_GNNS, MessageImpl, PNASettings, SATConfig
from .extractors import EXTRACTORS, EdgeGCNConv, SubgraphExtractor, gnn_layer
from .layout import GraphLayout
from .norm import make_norm, normalise


class SATLayer(nn.Module):
    """One SAT encoder layer of a model of ``config`` (:class:`sat.SATConfig`).

    Shapes: x ``[N, d]``, edge_index ``[2, E]``, edge_attr ``[E, edge_dim]`` or None, subgraph (the
    k-subgraph indices and their ``fused_edges``) or None, degree_scale ``[N]`` (``d_v^{-1/2}``) or
    None -> ``([N, d], attention weights or None)``.
    """

    def __init__(self, config: SATConfig):
        super().__init__()
        d = config.hidden_dim
        self.pre_norm = config.pre_norm
        self.extractor = None
        if config.k_hops > 0:
            edge_dim = config.effective_edge_dim if config.uses_edge_features else None
            self.extractor = EXTRACTORS[config.extractor](
                d, config.gnn_type, config.k_hops, edge_dim, config.concat_hops, config.pna_settings(),
                config.gnn_messages, config.recompute_gnn)
        self.attn = StructureAwareAttention(d, config.num_heads, config.attn_dropout, config.attention)
        ffn_dim = max(1, int(round(config.ffn_ratio * d)))
        self.ffn = nn.Sequential(nn.Linear(d, ffn_dim), nn.ReLU(), nn.Dropout(config.dropout), nn.Linear(ffn_dim, d))
        self.norm1 = make_norm(config.norm, d)
        self.norm2 = make_norm(config.norm, d)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, layout: GraphLayout, edge_index: Tensor, edge_attr: Optional[Tensor] = None,
                subgraph: Optional[dict[str, Any]] = None, degree_scale: Optional[Tensor] = None,
                return_attention: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        mask = layout.node_mask  # padded batches: BatchNorm's statistics over the real rows only
        h = normalise(self.norm1, x, mask) if self.pre_norm else x
        if self.extractor is None:
            h_struct = h
        elif isinstance(self.extractor, SubgraphExtractor):
            h_struct = self.extractor(h, edge_index, edge_attr, **subgraph, mask=mask)
        else:
            h_struct = self.extractor(h, edge_index, edge_attr, mask=mask)
        a, weights = self.attn(h, h_struct, layout, return_attention)
        if degree_scale is not None:
            a = a * degree_scale.unsqueeze(-1).to(a.dtype)
        x = x + self.dropout1(a)
        h = normalise(self.norm2, x, mask) if self.pre_norm else normalise(self.norm1, x, mask)
        x = (x if self.pre_norm else h) + self.dropout2(self.ffn(h))
        if not self.pre_norm:
            x = normalise(self.norm2, x, mask)
        return x, weights


class GNNLayer(nn.Module):
    """One layer of the base GNN alone (``architecture="gnn"``, the paper's "Base GNN" rows), as
    benchmarking-gnns builds it: ``x' = dropout(x + relu(norm(conv(x))))``. Takes :class:`SATLayer`'s
    arguments (ignoring the attention ones) and returns ``([N, d], None)``."""

    def __init__(self, hidden_dim: int, gnn_type: str = "gcn", dropout: float = 0.0, norm: str = "batch",
                 edge_dim: Optional[int] = None, pna: Optional[PNASettings] = None, gnn_messages: MessageImpl = "auto"):
        super().__init__()
        self.gnn_type = gnn_type
        self.edge_dim = edge_dim if gnn_type in EDGE_AWARE_GNNS else None
        self.conv = gnn_layer(gnn_type, hidden_dim, self.edge_dim, pna, gnn_messages)
        self.norm = make_norm(norm, hidden_dim)
        self.dropout = nn.Dropout(dropout)

    def _conv(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
        if self.edge_dim is not None or isinstance(self.conv, EdgeGCNConv):
            if edge_attr is None:
                raise ValueError(f"the {self.gnn_type} layer was built for edge features but got edge_attr=None")
            return self.conv(x, edge_index, edge_attr)
        if self.gnn_type == "gine":  # GINE without edge features: zero edge embeddings
            return self.conv(x, edge_index, x.new_zeros(edge_index.size(1), x.size(1)))
        return self.conv(x, edge_index)

    def forward(self, x: Tensor, layout: Optional[GraphLayout], edge_index: Tensor, edge_attr: Optional[Tensor] = None,
                subgraph: Optional[dict[str, Any]] = None, degree_scale: Optional[Tensor] = None,
                return_attention: bool = False) -> tuple[Tensor, None]:
        if return_attention:
            raise ValueError("architecture 'gnn' has no attention weights to return")
        mask = None if layout is None else layout.node_mask
        h = F.relu(normalise(self.norm, self._conv(x, edge_index, edge_attr), mask))
        return self.dropout(x + h), None
