"""Input encoders of SAT (Chen et al., ICML 2022, Sec. 4.3 and appendix C; OGB's code2 / ppa examples).

Node encoders, ``batch -> [N, d]``: ``embedding`` (long ``x``), ``linear`` (float ``x [N, F]``),
``code2_ast`` (OGB's ``ASTNodeEncoder``: type + attribute + clamped ``node_depth``) and ``constant``
(one learned vector). Edge encoders, ``edge_attr -> [E, effective_edge_dim]``: ``linear`` and
``embedding`` (one table per column, summed). Absolute encodings through a linear layer: ``rwpe``
and ``lap`` (signs flipped at random per graph and eigenvector in training)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .config import SATConfig


class NodeEncoder(nn.Module):
    """Embeds the node inputs of a batch into ``[N, hidden_dim]``; see the module docstring."""

    def __init__(self, config: SATConfig):
        super().__init__()
        self.kind = config.node_encoder
        self.in_dim = config.node_in_dim
        d = config.hidden_dim
        if self.kind == "embedding":
            self.embedding = nn.Embedding(config.node_in_dim, d)
        elif self.kind == "linear":
            self.linear = nn.Linear(config.node_in_dim, d)
        elif self.kind == "code2_ast":
            self.max_depth = config.code2_max_depth
            self.type_encoder = nn.Embedding(config.code2_num_node_types, d)
            self.attribute_encoder = nn.Embedding(config.code2_num_node_attributes, d)
            self.depth_encoder = nn.Embedding(config.code2_max_depth + 1, d)
        else:  # constant
            self.embedding = nn.Embedding(1, d)

    def forward(self, batch: Any, n: int) -> Tensor:
        """``n``: the batch's number of node rows."""
        x = getattr(batch, "x", None)
        if self.kind == "embedding":
            return self.embedding(self._long_x(x, 1).view(-1))  # id ranges: sat.validation
        if self.kind == "linear":
            _expect(x, _has_width(x, self.in_dim) and x.is_floating_point(),
                    f"node_encoder='linear' expects float x of shape [N, {self.in_dim}] (model.node_in_dim)")
            return self.linear(x)
        if self.kind == "code2_ast":
            ids = self._long_x(x, 2)
            depth = getattr(batch, "node_depth", None)
            _expect(depth, depth is not None and depth.numel() == ids.size(0),
                    f"node_encoder='code2_ast' needs node_depth of shape [N]={ids.size(0)}")
            depth = depth.view(-1).long().clamp(0, self.max_depth)
            return self.type_encoder(ids[:, 0]) + self.attribute_encoder(ids[:, 1]) + self.depth_encoder(depth)
        # constant
        return self.embedding.weight.expand(n, -1)

    def _long_x(self, x: Optional[Tensor], width: int) -> Tensor:
        ok = x is not None and not x.is_floating_point() and (
            (x.dim() == 2 and x.size(1) == width) or (width == 1 and x.dim() == 1)
        )
        shape = "[N] or [N, 1]" if width == 1 else f"[N, {width}]"
        _expect(x, ok, f"node_encoder={self.kind!r} expects long x of shape {shape}")
        return x.long()


class EdgeEncoder(nn.Module):
    """Embeds ``edge_attr`` into ``[E, effective_edge_dim]``; see the module docstring."""

    def __init__(self, config: SATConfig):
        super().__init__()
        self.kind = config.edge_encoder
        self.in_dim = config.edge_in_dim
        self.columns = config.edge_in_columns
        out = config.effective_edge_dim
        if self.kind == "linear":
            self.linear = nn.Linear(config.edge_in_dim, out)
        else:  # embedding
            self.embedding = nn.Embedding(config.edge_in_dim * config.edge_in_columns, out)
            self.register_buffer("offsets", torch.arange(config.edge_in_columns) * config.edge_in_dim, persistent=False)

    def forward(self, edge_attr: Optional[Tensor]) -> Tensor:
        if self.kind == "linear":
            _expect(edge_attr, _has_width(edge_attr, self.in_dim),
                    f"edge_encoder='linear' expects edge_attr of shape [E, {self.in_dim}] (model.edge_in_dim)")
            return self.linear(edge_attr if edge_attr.is_floating_point() else edge_attr.float())
        ok = edge_attr is not None and not edge_attr.is_floating_point()
        if ok:
            ids = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
            ok = ids.dim() == 2 and ids.size(1) == self.columns
        _expect(edge_attr, ok,
                f"edge_encoder='embedding' expects long edge_attr of shape [E, {self.columns}] (model.edge_in_columns)")
        return self.embedding(ids.long() + self.offsets).sum(dim=1)


class PositionalEncoder(nn.Module):
    """Absolute encoding (RWPE or Laplacian PE) of every node, ``[N, pe_dim] -> [N, hidden_dim]``."""

    def __init__(self, config: SATConfig):
        super().__init__()
        self.kind = config.pe
        self.attr = {"rwpe": "rwpe", "lap": "lap_pe"}[config.pe]
        self.pe_dim = config.pe_dim
        self.linear = nn.Linear(config.pe_dim, config.hidden_dim)

    def forward(self, batch: Any, graph_index: Tensor, num_graphs: int, n: int) -> Tensor:
        """``n``: the batch's number of node rows."""
        pe = getattr(batch, self.attr, None)
        _expect(pe, _has_width(pe, self.pe_dim) and pe.size(0) == n,
                f"pe={self.kind!r} expects batch.{self.attr} of shape [N={n}, {self.pe_dim}] (model.pe_dim)")
        pe = pe.to(self.linear.weight.dtype)  # fp32 (the weights' dtype) under autocast
        if self.kind == "lap" and self.training:
            sign = torch.randint(0, 2, (num_graphs, self.pe_dim), device=pe.device).float() * 2 - 1
            pe = pe * sign[graph_index]
        return self.linear(pe)


def _has_width(t: Optional[Tensor], width: int) -> bool:
    return t is not None and t.dim() == 2 and t.size(1) == width


def _expect(t: Optional[Tensor], ok: bool, expected: str) -> None:
    """A one-line ``ValueError`` saying what was expected and what ``t`` is, unless ``ok``."""
    if not ok:
        got = "None" if t is None else f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
        raise ValueError(f"{expected}, got {got}")
