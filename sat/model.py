"""The Structure-Aware Transformer (Chen, O'Bray, Borgwardt, ICML 2022).

:class:`SAT` stacks input encoders (:mod:`sat.encoders`), ``num_layers`` SAT encoder layers
(:mod:`sat.layers`: structure extractor + structure-aware attention + FFN), a readout and a head
(:mod:`sat.heads`). It is built from a :class:`sat.SATConfig` and runs on a PyG batch of
:class:`sat.SATData` (``Batch.from_data_list``); a single graph without ``batch`` works too.

Inputs read from the batch (N nodes, E edges, B graphs):

``x`` (see ``node_encoder``), ``edge_index [2, E]``, ``edge_attr [E, *]`` (edge-aware GNNs and
``edge_sum``), ``batch [N]``, ``degree [N]`` (optional; else :func:`sat.encodings.node_degree`),
``rwpe`` / ``lap_pe [N, pe_dim]`` (``pe``), ``node_depth [N]`` (``code2_ast``) and the four
``subgraph_*`` tensors (``extractor='subgraph'``, ``k_hops >= 1``).

Output of ``forward``: ``[B, num_classes]`` for graph heads, ``[N, num_classes]`` for
``node_classification``, ``[B, max_seq_len, num_classes]`` for ``code2_sequence``. With
``return_attention=True``, ``(output, attention)`` where ``attention`` is a list with one tensor
per layer of shape ``[B, num_heads, L, L]``: softmax weights of query (row) over key (column),
nodes in the graph's order, ``L`` the largest graph of the batch, zero on padding. With the
``cls`` readout each graph's [CLS] node comes first (index 0) and ``L`` counts it.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from .attention import GraphLayout
from .config import SATConfig
from .data import SUBGRAPH_KEYS
from .encoders import EdgeEncoder, NodeEncoder, PositionalEncoder
from .encodings import node_degree
from .extractors import GNN_TYPES, takes_edge_attr
from .heads import ClsToken, Head, pool_nodes
from .layers import SATLayer


class SAT(nn.Module):
    """Structure-Aware Transformer.

    Args:
        config: all hyperparameters (:class:`sat.SATConfig`).
        bucket_ratio: dense attention pads graphs in groups whose sizes differ by at most this
            factor (``None``: one padded block for the whole batch). Only affects speed/memory.

    Example::

        model = SAT(SATConfig(node_in_dim=10, num_classes=2))
        logits = model(Batch.from_data_list(graphs))        # [B, 2]
    """

    def __init__(self, config: SATConfig, bucket_ratio: Optional[float] = 1.5):
        super().__init__()
        if not isinstance(config, SATConfig):
            raise TypeError(f"SAT expects a SATConfig, got {type(config).__name__} (use SATConfig.from_dict)")
        if config.gnn_type not in GNN_TYPES:
            raise ValueError(f"model.gnn_type: unknown GNN type {config.gnn_type!r}; expected one of {list(GNN_TYPES)}")
        self.config = config
        self.bucket_ratio = bucket_ratio
        d = config.hidden_dim
        self.node_encoder = NodeEncoder(config)
        self.pe_encoder = PositionalEncoder(config) if config.pe != "none" else None
        # edge features reach the model only through edge-aware base GNNs
        self.uses_edge_attr = (
            config.k_hops > 0 and config.edge_encoder != "none" and takes_edge_attr(config.gnn_type, config.use_edge_attr)
        )
        self.edge_encoder = EdgeEncoder(config) if self.uses_edge_attr else None
        edge_dim = config.effective_edge_dim if self.uses_edge_attr else None
        self.layers = nn.ModuleList(
            SATLayer(
                d,
                config.num_heads,
                ffn_ratio=config.ffn_ratio,
                dropout=config.dropout,
                attn_dropout=config.attn_dropout,
                attention=config.attention,
                norm=config.norm,
                pre_norm=config.pre_norm,
                extractor=config.extractor,
                gnn_type=config.gnn_type,
                k_hops=config.k_hops,
                edge_dim=edge_dim,
                concat_hops=config.concat_hops,
                pna_degree_histogram=config.pna_degree_histogram,
            )
            for _ in range(config.num_layers)
        )
        self.final_norm = (nn.BatchNorm1d(d) if config.norm == "batch" else nn.LayerNorm(d)) if config.pre_norm else None
        self.cls = ClsToken(d) if config.readout == "cls" else None
        self.head = Head(config.head, d, config.num_classes, config.max_seq_len)

    @property
    def needs_subgraphs(self) -> bool:
        return self.config.extractor == "subgraph" and self.config.k_hops > 0

    def reset_parameters(self) -> None:
        for m in (self.node_encoder, self.pe_encoder, self.edge_encoder, self.final_norm, self.cls, self.head):
            if m is not None:
                m.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()

    def set_attention(self, impl: str) -> None:
        """Switch every layer to the ``dense`` or ``sparse`` attention (same parameters)."""
        if impl not in ("dense", "sparse"):
            raise ValueError(f"attention: expected 'dense' or 'sparse', got {impl!r}")
        for layer in self.layers:
            layer.attn.impl = impl

    # ------------------------------------------------------------------ validation
    def validate(self, batch: Any) -> None:
        """Raise a one-line :class:`ValueError` for inputs this model cannot use."""
        edge_index = getattr(batch, "edge_index", None)
        n = batch.num_nodes
        if n is None or n < 1:
            raise ValueError("the batch has no nodes")
        if edge_index is None or edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
            shape = None if edge_index is None else list(edge_index.shape)
            raise ValueError(f"edge_index must be an integer tensor of shape [2, E], got {shape}")
        if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= n):
            raise ValueError(
                f"edge_index holds node ids outside [0, {n}) (min {int(edge_index.min())}, max {int(edge_index.max())})"
            )
        graph_index = getattr(batch, "batch", None)
        if graph_index is not None:
            if graph_index.numel() != n:
                raise ValueError(f"batch.batch has {graph_index.numel()} entries for {n} nodes")
            if graph_index.numel() > 1 and bool((graph_index[1:] < graph_index[:-1]).any()):
                raise ValueError("batch.batch must be sorted (nodes grouped by graph, as Batch.from_data_list makes)")
        deg = getattr(batch, "degree", None)
        if deg is not None and deg.numel() != n:
            raise ValueError(f"batch.degree has {deg.numel()} entries for {n} nodes")
        if self.uses_edge_attr:
            ea = getattr(batch, "edge_attr", None)
            if ea is None:
                raise ValueError(
                    f"gnn_type={self.config.gnn_type!r} with use_edge_attr=True needs batch.edge_attr "
                    "(or set model.use_edge_attr: false / model.edge_encoder: none)"
                )
            if ea.size(0) != edge_index.size(1):
                raise ValueError(f"edge_attr has {ea.size(0)} rows for {edge_index.size(1)} edges")
        if self.needs_subgraphs:
            missing = [k for k in SUBGRAPH_KEYS if getattr(batch, k, None) is None]
            if missing:
                raise ValueError(
                    f"extractor='subgraph' needs the k-hop subgraph indices; the batch lacks {missing} "
                    "(compute them with sat.add_subgraph_indices(data, k) or the preprocessing stage)"
                )
            sni, ind = batch.subgraph_node_index, batch.subgraph_indicator
            if sni.numel() != ind.numel():
                raise ValueError("subgraph_node_index and subgraph_indicator differ in length")
            for name, t, hi in (
                ("subgraph_node_index", sni, n),
                ("subgraph_indicator", ind, n),
                ("subgraph_edge_index", batch.subgraph_edge_index, sni.numel()),
                ("subgraph_edge_id", batch.subgraph_edge_id, edge_index.size(1)),
            ):
                if t.numel() and (t.min() < 0 or t.max() >= hi):
                    raise ValueError(f"{name} holds ids outside [0, {hi})")

    # ------------------------------------------------------------------ forward
    def forward(self, batch: Any, return_attention: bool = False) -> Union[Tensor, tuple[Tensor, list[Tensor]]]:
        """Run the model on a PyG batch; see the module docstring for inputs and outputs."""
        self.validate(batch)
        cfg = self.config
        n = batch.num_nodes
        edge_index = batch.edge_index.long()
        device = edge_index.device
        graph_index = getattr(batch, "batch", None)
        if graph_index is None:
            graph_index = torch.zeros(n, dtype=torch.long, device=device)
            num_graphs = 1
        else:
            graph_index = graph_index.long()
            num_graphs = int(getattr(batch, "num_graphs", None) or int(graph_index.max()) + 1)

        x = self.node_encoder(batch)
        if self.pe_encoder is not None:
            x = x + self.pe_encoder(batch, graph_index, num_graphs)
        edge_attr = self.edge_encoder(batch.edge_attr) if self.edge_encoder is not None else None
        subgraph = {k: getattr(batch, k).long() for k in SUBGRAPH_KEYS} if self.needs_subgraphs else None

        degree_scale = None
        if cfg.degree_scaling and self.cls is None:
            deg = getattr(batch, "degree", None)
            deg = node_degree(edge_index, n) if deg is None else deg.float().clamp(min=1.0)
            degree_scale = deg.rsqrt()

        node_pos = cls_pos = None
        if self.cls is not None:
            ptr = torch.cat([graph_index.new_zeros(1), torch.bincount(graph_index, minlength=num_graphs).cumsum(0)])
            x, graph_index, edge_index, node_pos, cls_pos, subgraph = self.cls.attach(
                x, graph_index, ptr, edge_index, subgraph
            )
        layout = GraphLayout(graph_index, num_graphs, self.bucket_ratio)

        attention = []
        for layer in self.layers:
            x, weights = layer(x, layout, edge_index, edge_attr, subgraph, degree_scale, return_attention)
            if return_attention:
                attention.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)

        if self.head.node_level:
            out = self.head(x if node_pos is None else x[node_pos])
        else:
            if cls_pos is not None:
                h = x[cls_pos]
            else:
                h = pool_nodes(x, graph_index, num_graphs, cfg.readout)
            out = self.head(h)
        return (out, attention) if return_attention else out

    @torch.no_grad()
    def cls_attention(self, batch: Any) -> list[Tensor]:
        """Per graph, the last layer's attention of its [CLS] node over the graph's nodes,
        averaged over heads: a list of ``B`` tensors ``[n_g]`` (each sums to 1 minus the
        [CLS] node's attention to itself), for attention-map plots (Sec. 5.5).

        Runs in the model's current mode (call ``model.eval()`` first for deterministic maps).
        Requires ``readout='cls'``.
        """
        if self.cls is None:
            raise ValueError("cls_attention needs a model with readout='cls'")
        _, attention = self.forward(batch, return_attention=True)
        last = attention[-1].mean(dim=1)  # [B, L, L]
        graph_index = getattr(batch, "batch", None)
        if graph_index is None:
            sizes = [batch.num_nodes]
        else:
            sizes = torch.bincount(graph_index, minlength=last.size(0)).tolist()
        return [last[g, 0, 1 : 1 + s].float() for g, s in enumerate(sizes)]
