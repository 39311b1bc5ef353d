"""The Structure-Aware Transformer (Chen, O'Bray, Borgwardt, ICML 2022).

:class:`SAT`: input encoders (:mod:`sat.encoders`), ``num_layers`` encoder layers (:mod:`sat.layers`),
a readout and a head (:mod:`sat.heads`), on a PyG batch of :class:`sat.SATData` or one graph.
Output: ``[B, num_classes]`` (graph heads), ``[N, num_classes]`` (``node_classification``),
``[B, max_seq_len, num_classes]`` (``code2_sequence``); with ``return_attention=True`` also one
``[B, num_heads, L, L]`` tensor per layer. A padded batch (:mod:`sat.padding`) gives one row per
slot of its capacity, the batch's own first."""
from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor, nn
from torch_geometric.utils import scatter

from .attention import ATTENTION_IMPLS
from .config import SATConfig
from .data import SUBGRAPH_KEYS
from .encoders import EdgeEncoder, NodeEncoder, PositionalEncoder
from .encodings import node_degree
from .heads import ClsToken, Head
from .layers import GNNLayer, SATLayer
from .layout import GraphLayout
from .norm import make_norm, normalise
from .validation import validate_batch

_NODE_ROW_KEYS = ("batch", "x", "node_depth", "rwpe", "lap_pe", "degree")  # tensors with one row per node


class SAT(nn.Module):
    """Structure-Aware Transformer of ``config`` (:class:`sat.SATConfig`).

    Example::

        model = SAT(SATConfig(node_in_dim=10, num_classes=2))
        logits = model(Batch.from_data_list(graphs))        # [B, 2]
    """

    def __init__(self, config: SATConfig):
        super().__init__()
        if not isinstance(config, SATConfig):
            raise TypeError(f"SAT expects a SATConfig, got {type(config).__name__} (use SATConfig.from_dict)")
        self.config = config
        d = config.hidden_dim
        self.node_encoder = NodeEncoder(config)
        self.pe_encoder = PositionalEncoder(config) if config.pe != "none" else None
        # edge features reach the model only through edge-aware base GNNs
        self.uses_edge_attr = config.uses_edge_features
        self.edge_encoder = EdgeEncoder(config) if self.uses_edge_attr else None
        if config.architecture == "gnn":
            edge_dim = config.effective_edge_dim if self.uses_edge_attr else None
            layers = [GNNLayer(d, config.gnn_type, config.dropout, config.norm, edge_dim, config.pna_settings(),
                               config.gnn_messages) for _ in range(config.num_layers)]
        else:
            layers = [SATLayer(config) for _ in range(config.num_layers)]
        self.layers = nn.ModuleList(layers)
        pre_norm = config.architecture == "sat" and config.pre_norm
        self.final_norm = make_norm(config.norm, d) if pre_norm else None
        self.cls = ClsToken(d) if config.readout == "cls" else None
        self.head = Head(config.head, d, config.num_classes, config.max_seq_len)

    def set_attention(self, impl: str) -> None:
        """Switch every layer to another attention implementation (same parameters; see
        :mod:`sat.attention`: ``auto``, ``varlen``, ``dense``)."""
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention: expected one of {list(ATTENTION_IMPLS)}, got {impl!r}")
        for layer in self.layers:
            if hasattr(layer, "attn"):  # GNNLayer has no attention
                layer.attn.impl = impl

    # ------------------------------------------------------------------ validation
    def validate(self, batch: Any) -> None:
        """Raise a one-line :class:`ValueError` for inputs this model cannot use
        (:func:`sat.validation.validate_batch`)."""
        validate_batch(self.config, batch)

    def layout(self, batch: Any) -> GraphLayout:
        """The batch's :class:`sat.layout.GraphLayout`: the one it carries (``batch.graph_layout``, built on
        the host by the loader) when it matches the batch's shapes, else one built here."""
        cls = self.cls is not None
        layout = getattr(batch, "graph_layout", None)
        if isinstance(layout, GraphLayout):
            # shapes only: no host read, and nothing that would break a compiled graph
            ptr = getattr(batch, "ptr", None)
            num_graphs = ptr.numel() - 1 if isinstance(ptr, torch.Tensor) else None
            if layout.matches(_node_rows(batch), cls, num_graphs):
                return layout
        graph_index = getattr(batch, "batch", None)
        if graph_index is None:
            sizes = [batch.num_nodes]
        else:
            num_graphs = int(getattr(batch, "num_graphs", None) or int(graph_index.max()) + 1)
            sizes = torch.bincount(graph_index.detach().cpu(), minlength=num_graphs).numpy()
        return GraphLayout.from_sizes(sizes, cls_token=cls).to(batch.edge_index.device)

    # ------------------------------------------------------------------ forward
    def forward(
        self, batch: Any, return_attention: bool = False, validate: bool = True
    ) -> Union[Tensor, tuple[Tensor, list[Tensor]]]:
        """Run the model on a PyG batch. ``validate=False`` skips :meth:`validate` (its checks read values
        back to the host): with a host-built ``graph_layout`` the forward pass then never syncs."""
        if validate:
            self.validate(batch)
        cfg = self.config
        edge_index = batch.edge_index.long()
        layout = self.layout(batch)
        n, num_graphs = layout.num_input_nodes, layout.num_graphs
        graph_index = getattr(batch, "batch", None)
        if graph_index is None:
            graph_index = torch.zeros(n, dtype=torch.long, device=edge_index.device)

        x = self.node_encoder(batch, n)
        if self.pe_encoder is not None:
            x = x + self.pe_encoder(batch, graph_index, num_graphs, n)
        edge_attr = self.edge_encoder(batch.edge_attr) if self.edge_encoder is not None else None
        subgraph = {k: getattr(batch, k).long() for k in SUBGRAPH_KEYS} if cfg.needs_subgraphs else None

        degree_scale = None
        if cfg.degree_scaling and self.cls is None and cfg.architecture == "sat":
            deg = getattr(batch, "degree", None)
            deg = node_degree(edge_index, n) if deg is None else deg.float().clamp(min=1.0)
            degree_scale = deg.rsqrt()

        if self.cls is not None:
            x, edge_index, subgraph = self.cls.attach(x, edge_index, subgraph, layout)
        if subgraph is not None:  # the same in every layer: built (and sorted) once per batch
            indices = (subgraph[k] for k in ("subgraph_node_index", "subgraph_edge_index", "subgraph_edge_id"))
            subgraph["fused_edges"] = self.layers[0].extractor.fused_edges(x, edge_attr, *indices)

        attention = []
        padding_rows = None if layout.node_mask is None else ~layout.node_mask.view(-1, 1)
        for layer in self.layers:
            if padding_rows is not None:  # keeps padding rows small and finite (sat.padding)
                x = x.masked_fill(padding_rows, 0)
            x, weights = layer(x, layout, edge_index, edge_attr, subgraph, degree_scale, return_attention)
            if return_attention:
                attention.append(weights)
        if self.final_norm is not None:
            x = normalise(self.final_norm, x, layout.node_mask)

        if cfg.head == "node_classification":
            out = self.head(x if layout.real_index is None else x[layout.real_index])
        elif self.cls is not None:
            out = self.head(x[layout.cls_index])
        else:
            out = self.head(scatter(x, graph_index, dim=0, dim_size=num_graphs, reduce=cfg.readout))  # mean or sum
        return (out, attention) if return_attention else out

    @torch.no_grad()
    def cls_attention(self, batch: Any) -> list[Tensor]:
        """Per graph, the last layer's attention of its [CLS] node over the graph's nodes, averaged over
        heads: ``B`` tensors ``[n_g]``, for attention maps (Sec. 5.5; ``readout='cls'`` only). Runs in
        the model's current mode (``model.eval()`` first for deterministic maps)."""
        if self.cls is None:
            raise ValueError("cls_attention needs a model with readout='cls'")
        _, attention = self.forward(batch, return_attention=True)
        last = attention[-1].mean(dim=1)  # [B, L, L]
        return [last[g, 0, 1:s].float() for g, s in enumerate(self.layout(batch).sizes.tolist())]


def _node_rows(batch: Any) -> int:
    """The number of node rows of ``batch``, from the shape of a tensor with one row per node (PyG's
    ``num_nodes`` property, the fallback, is resolved by Python code that ``torch.compile`` cannot
    trace through)."""
    for key in _NODE_ROW_KEYS:
        value = getattr(batch, key, None)
        if isinstance(value, torch.Tensor):
            return value.size(0)
    return int(batch.num_nodes)
