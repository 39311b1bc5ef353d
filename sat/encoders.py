"""Input encoders of SAT: node features, edge features, absolute encodings (Chen et al., ICML 2022,
Sec. 4.3 and appendix C; OGB's examples for ogbg-code2 and ogbg-ppa).

Node encoders (``SATConfig.node_encoder``), each ``batch -> [N, d]``:

* ``embedding``: ``x`` long ``[N]`` or ``[N, 1]``, vocabulary ``node_in_dim`` (ZINC atoms, ...);
* ``linear``: ``x`` float ``[N, node_in_dim]`` (e.g. ogbg-ppa with precomputed edge sums, width 7);
* ``code2_ast``: OGB's ``ASTNodeEncoder``: type ``x[:, 0]`` + attribute ``x[:, 1]`` + depth
  ``node_depth`` clamped at ``code2_max_depth``;
* ``constant``: one learned vector for every node (ogbg-ppa's examples: zeros + ``Embedding(1, d)``);
* ``edge_sum``: a linear layer over the sum of the features of each node's incoming edges
  (:func:`sat.encodings.incident_edge_sum` of the raw ``edge_attr`` ``[E, node_in_dim]``).

Edge encoders (``SATConfig.edge_encoder``), ``edge_attr -> [E, effective_edge_dim]``:

* ``linear``: float (or 0/1 long, cast) ``[E, edge_in_dim]``. ogbg-code2 (OGB ``augment_edge``:
  columns edge type and direction) uses ``linear`` with ``edge_in_dim = 2``, as OGB's code2 example
  (``Linear(2, d)``); ogbg-ppa uses ``linear`` with ``edge_in_dim = 7``.
* ``embedding``: long ``[E]`` or ``[E, edge_in_columns]``, every column its own table of
  ``edge_in_dim`` entries, summed (code2 alternative: ``edge_in_dim = 2, edge_in_columns = 2``).

Absolute encodings (``SATConfig.pe``), added to the node embedding by a linear layer:
``rwpe`` from ``batch.rwpe`` ``[N, pe_dim]``; ``lap`` from ``batch.lap_pe`` ``[N, pe_dim]`` with a
random sign flip per graph and eigenvector in training mode (eigenvectors are defined up to sign).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .config import SATConfig
from .encodings import incident_edge_sum


def _attr(batch: Any, name: str) -> Optional[Tensor]:
    return getattr(batch, name, None)


class NodeEncoder(nn.Module):
    """Embeds the node inputs of a batch into ``[N, hidden_dim]``; see the module docstring."""

    def __init__(self, config: SATConfig):
        super().__init__()
        self.kind = config.node_encoder
        self.in_dim = config.node_in_dim
        d = config.hidden_dim
        if self.kind == "embedding":
            self.embedding = nn.Embedding(config.node_in_dim, d)
        elif self.kind in ("linear", "edge_sum"):
            self.linear = nn.Linear(config.node_in_dim, d)
        elif self.kind == "code2_ast":
            self.max_depth = config.code2_max_depth
            self.type_encoder = nn.Embedding(config.code2_num_node_types, d)
            self.attribute_encoder = nn.Embedding(config.code2_num_node_attributes, d)
            self.depth_encoder = nn.Embedding(config.code2_max_depth + 1, d)
        elif self.kind == "constant":
            self.embedding = nn.Embedding(1, d)
        else:
            raise ValueError(f"unknown node_encoder {self.kind!r}")

    def reset_parameters(self) -> None:
        for m in self.children():
            m.reset_parameters()

    def forward(self, batch: Any, n: int) -> Tensor:
        """``n``: the batch's number of node rows."""
        x = _attr(batch, "x")
        if self.kind == "embedding":
            return self.embedding(self._long_x(x, 1).view(-1))  # id ranges: sat.validation
        if self.kind == "linear":
            if x is None or not x.is_floating_point() or x.dim() != 2 or x.size(1) != self.in_dim:
                raise ValueError(
                    f"node_encoder='linear' expects float x of shape [N, {self.in_dim}] (model.node_in_dim), "
                    f"got {_describe(x)}"
                )
            return self.linear(x)
        if self.kind == "edge_sum":
            ea = _attr(batch, "edge_attr")
            if ea is None or ea.dim() != 2 or ea.size(1) != self.in_dim:
                raise ValueError(
                    f"node_encoder='edge_sum' expects edge_attr of shape [E, {self.in_dim}] (model.node_in_dim), "
                    f"got {_describe(ea)}"
                )
            return self.linear(incident_edge_sum(batch.edge_index, ea.float(), n))
        if self.kind == "code2_ast":
            ids = self._long_x(x, 2)
            depth = _attr(batch, "node_depth")
            if depth is None or depth.numel() != ids.size(0):
                raise ValueError(f"node_encoder='code2_ast' needs node_depth of shape [N]={ids.size(0)}, got {_describe(depth)}")
            depth = depth.view(-1).long().clamp(0, self.max_depth)
            return self.type_encoder(ids[:, 0]) + self.attribute_encoder(ids[:, 1]) + self.depth_encoder(depth)
        # constant
        return self.embedding.weight.expand(n, -1)

    def _long_x(self, x: Optional[Tensor], width: int) -> Tensor:
        ok = x is not None and not x.is_floating_point() and (
            (x.dim() == 2 and x.size(1) == width) or (width == 1 and x.dim() == 1)
        )
        if not ok:
            shape = "[N] or [N, 1]" if width == 1 else f"[N, {width}]"
            raise ValueError(f"node_encoder={self.kind!r} expects long x of shape {shape}, got {_describe(x)}")
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
        elif self.kind == "embedding":
            self.embedding = nn.Embedding(config.edge_in_dim * config.edge_in_columns, out)
            self.register_buffer("offsets", torch.arange(config.edge_in_columns) * config.edge_in_dim, persistent=False)
        else:
            raise ValueError(f"edge_encoder {self.kind!r} builds no module")

    def reset_parameters(self) -> None:
        for m in self.children():
            m.reset_parameters()

    def forward(self, edge_attr: Optional[Tensor]) -> Tensor:
        if self.kind == "linear":
            ok = edge_attr is not None and edge_attr.dim() == 2 and edge_attr.size(1) == self.in_dim
            if not ok:
                raise ValueError(
                    f"edge_encoder='linear' expects edge_attr of shape [E, {self.in_dim}] (model.edge_in_dim), "
                    f"got {_describe(edge_attr)}"
                )
            return self.linear(edge_attr if edge_attr.is_floating_point() else edge_attr.float())
        ok = edge_attr is not None and not edge_attr.is_floating_point()
        if ok:
            ids = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
            ok = ids.dim() == 2 and ids.size(1) == self.columns
        if not ok:
            raise ValueError(
                f"edge_encoder='embedding' expects long edge_attr of shape [E, {self.columns}] "
                f"(model.edge_in_columns), got {_describe(edge_attr)}"
            )
        return self.embedding(ids.long() + self.offsets).sum(dim=1)


class PositionalEncoder(nn.Module):
    """Absolute encoding (RWPE or Laplacian PE) of every node, ``[N, pe_dim] -> [N, hidden_dim]``."""

    def __init__(self, config: SATConfig):
        super().__init__()
        self.kind = config.pe
        self.attr = {"rwpe": "rwpe", "lap": "lap_pe"}[config.pe]
        self.pe_dim = config.pe_dim
        self.linear = nn.Linear(config.pe_dim, config.hidden_dim)

    def reset_parameters(self) -> None:
        self.linear.reset_parameters()

    def forward(self, batch: Any, graph_index: Tensor, num_graphs: int, n: int) -> Tensor:
        """``n``: the batch's number of node rows."""
        pe = _attr(batch, self.attr)
        if pe is None or pe.dim() != 2 or pe.size(1) != self.pe_dim or pe.size(0) != n:
            raise ValueError(
                f"pe={self.kind!r} expects batch.{self.attr} of shape [N={n}, {self.pe_dim}] "
                f"(model.pe_dim), got {_describe(pe)}"
            )
        pe = pe.to(self.linear.weight.dtype)  # fp32 (the weights' dtype) under autocast
        if self.kind == "lap" and self.training:
            sign = torch.randint(0, 2, (num_graphs, self.pe_dim), device=pe.device).float() * 2 - 1
            pe = pe * sign[graph_index]
        return self.linear(pe)


def _describe(t: Optional[Tensor]) -> str:
    if t is None:
        return "None"
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
