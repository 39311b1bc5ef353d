"""Structure extractors phi(u, G) of SAT (Chen et al., ICML 2022, Sec. 4.1).

* :class:`SubtreeExtractor` (k-subtree): the output at ``u`` of ``k`` layers of a base GNN on the
  whole graph; at most as expressive as 1-WL.
* :class:`SubgraphExtractor` (k-subgraph): the same GNN inside the k-hop subgraph of every node
  (precomputed indices, :class:`sat.data.SATData`), sum-pooled, concatenated with ``x_u`` and
  projected; strictly more expressive than 1-WL (cf. Zhang & Li, Nested GNNs, 2021).

Base GNNs (:func:`gnn_layer`): GCN, GIN, GraphSAGE, PNA and GINE; GCN and PNA also take edge
features, GCN in the form of OGB's examples (:class:`EdgeGCNConv`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch_geometric.nn import GCNConv, GINConv, GINEConv, PNAConv, SAGEConv
from torch_geometric.utils import degree as pyg_degree
from torch_geometric.utils import scatter

from .config import EDGE_AWARE_GNNS, MessageImpl, PNASettings
from .edge_messages import MessageEdges, RootTerm, aggregate_edge_messages, message_edges, resolve_impl
from .norm import BatchNorm

GNN_TYPES = ("gcn", "gin", "gine", "sage", "pna")


class EdgeGCNConv(nn.Module):
    """GCN with edge features, as ``GCNConv`` of OGB's ``examples/graphproppred``:

        h_v = sum_{u -> v} norm_uv * relu(W x_u + E e_uv) + relu(W x_v + r) / deg_v

    with ``norm_uv = (deg_u deg_v)^{-1/2}``, ``deg = 1 + out-degree``. In the k-subgraph extractor the
    linear maps run before the gathers (``node_index [S]``, ``edge_id [Es]``). ``message_impl``:
    :mod:`sat.edge_messages` (``auto``: fused on CUDA for the gathered inputs only).

    Shapes: x ``[N, d]``, edge_index ``[2, E]`` (``[2, Es]``), edge_attr ``[E, edge_dim]`` -> ``[N, d]`` (``[S, d]``)."""

    def __init__(self, hidden_dim: int, edge_dim: int, message_impl: MessageImpl = "auto"):
        super().__init__()
        self.message_impl = message_impl
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.root_emb = nn.Embedding(1, hidden_dim)
        self.edge_encoder = nn.Linear(edge_dim, hidden_dim)

    def sums_fused(self, device: torch.device, gathered: bool) -> bool:
        """Whether the layer sums its messages in the fused kernel on ``device``; ``gathered``:
        with the k-subgraph extractor's gathers."""
        return resolve_impl(self.message_impl, device) == "fused" and (gathered or self.message_impl == "fused")

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor, node_index: Optional[Tensor] = None,
                edge_id: Optional[Tensor] = None, graph_edge_index: Optional[Tensor] = None,
                fused_edges: Optional[MessageEdges] = None) -> Tensor:
        """``forward(x[node_index], edge_index, edge_attr[edge_id])``, the gathers (optional) after the
        linear maps. ``graph_edge_index`` (with both gathers) forms messages per graph edge, which needs
        ``node_index[edge_index[0]] == graph_edge_index[0][edge_id]`` (true of :class:`sat.data.SATData`'s
        indices). ``fused_edges``: :func:`gcn_message_edges` of these indices, shared by the layers."""
        edge_embedding = self.edge_encoder(edge_attr)
        num_entries = x.size(0) if node_index is None else node_index.numel()
        gathered = node_index is not None or edge_id is not None
        if self.sums_fused(x.device, gathered):
            if fused_edges is None:
                fused_edges = gcn_message_edges(edge_index, x.size(0), edge_attr.size(0), num_entries, x.dtype,
                                                node_index, edge_id)
            # W x is formed inside, and again in the backward pass rather than kept
            return aggregate_edge_messages(x, edge_embedding, fused_edges, self.root_emb.weight[0], "fused",
                                           self.linear)
        x = self.linear(x)
        deg, norm = _gcn_norm(edge_index, num_entries)
        root = F.relu(x + self.root_emb.weight)  # per node, then gathered
        if node_index is not None and edge_id is not None and graph_edge_index is not None:
            # relu(W x_u + E e_uv) per graph edge [E, d], gathered per subgraph edge: no [Es, d] gathers
            # of x_u and e_uv, nor the activations autograd would keep of their sum
            message = F.relu(x.index_select(0, graph_edge_index[0]) + edge_embedding).index_select(0, edge_id)
        else:
            if node_index is not None:
                x = x.index_select(0, node_index)
            if edge_id is not None:
                edge_embedding = edge_embedding.index_select(0, edge_id)
            message = F.relu(x.index_select(0, edge_index[0]) + edge_embedding)
        if node_index is not None:
            root = root.index_select(0, node_index)
        out = scatter(message * norm.to(x.dtype).view(-1, 1), edge_index[1], dim=0, dim_size=num_entries, reduce="sum")
        return out + root / deg.view(-1, 1).to(x.dtype)


class FixedShapeGCNConv(GCNConv):
    """PyG's ``GCNConv`` (Kipf & Welling, ICLR 2017; same parameters and state-dict keys) with its self-loops
    added at a fixed shape: existing loops weigh 0 and one loop per node is appended, the same sum from
    shapes that depend on ``N`` and ``E`` only (no graph break under ``torch.compile``).

    Shapes: x ``[N, d]``, edge_index ``[2, E]`` -> ``[N, d]``."""

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:  # type: ignore[override]
        n = x.size(0)
        loops = torch.arange(n, device=edge_index.device)
        row = torch.cat([edge_index[0], loops])
        col = torch.cat([edge_index[1], loops])
        weight = torch.cat([(edge_index[0] != edge_index[1]).to(x.dtype), x.new_ones(n)])
        deg_inv_sqrt = scatter(weight, col, dim=0, dim_size=n, reduce="sum").pow(-0.5)
        deg_inv_sqrt = deg_inv_sqrt.masked_fill(deg_inv_sqrt == float("inf"), 0.0)
        norm = deg_inv_sqrt[row] * weight * deg_inv_sqrt[col]
        h = self.lin(x)
        out = scatter(h.index_select(0, row) * norm.view(-1, 1), col, dim=0, dim_size=n, reduce="sum")
        return out if self.bias is None else out + self.bias


def _gcn_norm(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """OGB-GCN's ``deg = 1 + out-degree`` ``[N]`` and edge weights ``(deg_u deg_v)^{-1/2}`` ``[E]``,
    counted in fp32 (exact under autocast)."""
    row, col = edge_index
    deg = pyg_degree(row, num_nodes, dtype=torch.float32) + 1
    deg_inv_sqrt = deg.pow(-0.5)
    return deg, deg_inv_sqrt[row] * deg_inv_sqrt[col]


def gcn_message_edges(
    edge_index: Tensor, num_sources: int, num_edge_rows: int, num_entries: int, dtype: torch.dtype,
    node_index: Optional[Tensor] = None, edge_id: Optional[Tensor] = None,
) -> MessageEdges:
    """The edges of :class:`EdgeGCNConv`'s fused sum over ``edge_index [2, Es]`` (rows ``node_index[u]``
    and ``edge_id[j]``, each gather optional) and its root term ``relu(W x_v + r) / deg_v``."""
    row, col = edge_index
    deg, norm = _gcn_norm(edge_index, num_entries)
    source = row if node_index is None else node_index.index_select(0, row)
    edge_rows = edge_id if edge_id is not None else torch.arange(row.numel(), device=row.device)
    inv_deg = deg.to(torch.promote_types(dtype, deg.dtype)).reciprocal()
    return message_edges(source, edge_rows, col, norm, num_sources, num_edge_rows, num_entries,
                         RootTerm(node_index, inv_deg))


def _mlp(hidden_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim))


def gnn_layer(gnn_type: str, hidden_dim: int, edge_dim: Optional[int] = None, pna: Optional[PNASettings] = None,
              message_impl: MessageImpl = "auto") -> nn.Module:
    """One base-GNN layer ``[N, d] -> [N, d]`` of ``gnn_type`` (:data:`GNN_TYPES`).

    ``edge_dim``: the width of the edge features it takes (``None``: none; ignored by ``gin`` and
    ``sage``); ``pna``: PNA's settings; ``message_impl``: how :class:`EdgeGCNConv` sums its messages.
    """
    if gnn_type == "gcn":
        return FixedShapeGCNConv(hidden_dim, hidden_dim) if edge_dim is None else EdgeGCNConv(hidden_dim, edge_dim,
                                                                                               message_impl)
    if gnn_type == "gin":
        return GINConv(_mlp(hidden_dim), train_eps=True)
    if gnn_type == "gine":
        edge_dim = edge_dim if edge_dim not in (None, hidden_dim) else None  # None: edge features as wide as x
        return GINEConv(_mlp(hidden_dim), train_eps=True, edge_dim=edge_dim)
    if gnn_type == "sage":
        return SAGEConv(hidden_dim, hidden_dim)
    if gnn_type == "pna":
        if pna is None:
            raise ValueError("gnn_type='pna' needs pna_degree_histogram (in-degree histogram of the training graphs)")
        deg = torch.as_tensor(pna.degree_histogram, dtype=torch.long)
        return PNAConv(hidden_dim, hidden_dim, list(pna.aggregators), list(pna.scalers), deg, edge_dim=edge_dim,
                       towers=pna.towers_for(hidden_dim), divide_input=pna.divide_input)
    raise ValueError(f"unknown gnn_type {gnn_type!r}; expected one of {list(GNN_TYPES)}")


class _GNNStack(nn.Module):
    """``k`` layers of a base GNN, each followed by ReLU; returns the last output, or the
    concatenation ``[x, h_1, ..., h_k]`` when ``concat_hops`` (authors' ``StructureExtractor``)."""

    def __init__(self, hidden_dim, gnn_type, k, edge_dim, concat_hops, pna, message_impl="auto"):
        super().__init__()
        if k < 1:
            raise ValueError(f"a structure extractor needs k >= 1, got {k}")
        self.gnn_type = gnn_type
        self.edge_dim = edge_dim if gnn_type in EDGE_AWARE_GNNS else None
        self.concat_hops = concat_hops
        self.convs = nn.ModuleList(
            gnn_layer(gnn_type, hidden_dim, self.edge_dim, pna, message_impl) for _ in range(k)
        )
        self.out_dim = (k + 1) * hidden_dim if concat_hops else hidden_dim

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor], node_index: Optional[Tensor] = None,
                edge_id: Optional[Tensor] = None, graph_edge_index: Optional[Tensor] = None,
                fused_edges: Optional[tuple[MessageEdges, MessageEdges]] = None) -> Tensor:
        """Run the stack on ``(x[node_index], edge_index, edge_attr[edge_id])`` (gathers optional;
        :class:`EdgeGCNConv` gathers after its linear maps, see its ``graph_edge_index`` and
        ``fused_edges``)."""
        uses_edges = self.gnn_type == "gine" or self.edge_dim is not None
        if uses_edges and edge_attr is None and self.gnn_type != "gine":
            raise ValueError(f"the {self.gnn_type} extractor was built for edge features but got edge_attr=None")
        gathers_late = isinstance(self.convs[0], EdgeGCNConv)
        if uses_edges and not gathers_late:  # GINE without edge features: zero edge embeddings
            edge_attr = (x.new_zeros(edge_index.size(1), x.size(1)) if edge_attr is None
                         else edge_attr if edge_id is None else edge_attr.index_select(0, edge_id))
        hops = [x if node_index is None else x.index_select(0, node_index)] if self.concat_hops else []
        for depth, conv in enumerate(self.convs):
            pending = node_index if depth == 0 else None  # rows of x still to be gathered
            if gathers_late:
                edges = None if fused_edges is None else fused_edges[min(depth, 1)]
                x = conv(x, edge_index, edge_attr, pending, edge_id, graph_edge_index, edges)
            else:
                if pending is not None:
                    x = x.index_select(0, pending)
                x = conv(x, edge_index, edge_attr) if uses_edges else conv(x, edge_index)
            x = F.relu(x)
            if self.concat_hops:
                hops.append(x)
        return torch.cat(hops, dim=-1) if self.concat_hops else x


class _Extractor(nn.Module):
    """A k-layer base GNN, then BatchNorm and a projection back to ``hidden_dim`` (the k-subgraph extractor
    concatenates the node's own features first). ``concat_hops``: concatenate every hop's output (the
    authors' ``StructureExtractor``); ``recompute_gnn``: keep none of the GNN's activations and rerun it
    in the backward pass (``torch.utils.checkpoint``; BatchNorm stays outside)."""

    keeps_input = False

    def __init__(self, hidden_dim: int, gnn_type: str, k: int, edge_dim: Optional[int] = None,
                 concat_hops: bool = False, pna: Optional[PNASettings] = None, message_impl: MessageImpl = "auto",
                 recompute_gnn: bool = False):
        super().__init__()
        self.gnn = _GNNStack(hidden_dim, gnn_type, k, edge_dim, concat_hops, pna, message_impl)
        width = self.gnn.out_dim + (hidden_dim if self.keeps_input else 0)
        self.norm = BatchNorm(width)
        self.out_proj = nn.Linear(width, hidden_dim)
        self.recompute_gnn = recompute_gnn

    def _run(self, fn, *args: Optional[Tensor]) -> Tensor:
        """``fn(*args)``, recomputed in the backward pass when ``recompute_gnn`` (and grad is on)."""
        if self.recompute_gnn and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


class SubtreeExtractor(_Extractor):
    """k-subtree GNN extractor: ``phi(u, G) = GNN^(k)(G)_u`` (Sec. 4.1), then BatchNorm and a
    linear projection (as in the authors' ``StructureExtractor``); arguments as :class:`_Extractor`.

    Shapes: x ``[N, d]``, edge_index ``[2, E]``, edge_attr ``[E, edge_dim]``, mask ``[N]`` (the
    real rows of a padded batch, for BatchNorm's statistics: :mod:`sat.norm`) -> ``[N, d]``.
    """

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        h = self._run(lambda x_, e_: self.gnn(x_, edge_index, e_), x, edge_attr)
        return self.out_proj(self.norm(h, mask))


class SubgraphExtractor(_Extractor):
    """k-subgraph GNN extractor (Sec. 4.1): ``phi(u, G) = W [x_u || sum_{w in S_k(u)} GNN^(k)(S_k(u))_w]``,
    the GNN run on the disjoint union of the k-hop subgraphs (:class:`sat.data.SATData`'s indices),
    sum-pooled per centre (the authors' ``KHopStructureExtractor``).

    Shapes: x ``[N, d]``, subgraph_node_index / subgraph_indicator ``[S]``, subgraph_edge_index ``[2, Es]``,
    subgraph_edge_id ``[Es]``, edge_attr ``[E, edge_dim]`` -> ``[N, d]``; memory ``S * d`` per layer."""

    keeps_input = True

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor] = None, *, subgraph_node_index: Tensor,
                subgraph_indicator: Tensor, subgraph_edge_index: Tensor, subgraph_edge_id: Tensor,
                fused_edges: Optional[tuple[MessageEdges, MessageEdges]] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        """``fused_edges``: :meth:`fused_edges` of these inputs, built once per batch (else here);
        ``mask``: the real rows of a padded batch (:mod:`sat.norm`)."""
        if fused_edges is None:
            fused_edges = self.fused_edges(x, edge_attr, subgraph_node_index, subgraph_edge_index, subgraph_edge_id)

        def gnn_and_pool(x_: Tensor, edge_attr_: Optional[Tensor]) -> Tensor:
            h = self.gnn(x_, subgraph_edge_index, edge_attr_, node_index=subgraph_node_index, edge_id=subgraph_edge_id,
                         graph_edge_index=edge_index, fused_edges=fused_edges)
            # summed in the input's precision (fp32 under autocast) whatever the GNN's output dtype
            return scatter(h.to(x_.dtype), subgraph_indicator, dim=0, dim_size=x_.size(0), reduce="sum")

        pooled = self._run(gnn_and_pool, x, edge_attr)
        return self.out_proj(self.norm(torch.cat([x, pooled], dim=-1), mask))

    def fused_edges(
        self, x: Tensor, edge_attr: Optional[Tensor], subgraph_node_index: Tensor, subgraph_edge_index: Tensor,
        subgraph_edge_id: Tensor,
    ) -> Optional[tuple[MessageEdges, MessageEdges]]:
        """The message edges of the first and the later GCN layers, sharing their sorts, where they sum
        fused, else ``None``; they depend on the batch only, so every extractor over it takes them."""
        conv = self.gnn.convs[0]
        if edge_attr is None or not isinstance(conv, EdgeGCNConv) or not conv.sums_fused(x.device, gathered=True):
            return None
        entries = subgraph_node_index.numel()
        first = gcn_message_edges(subgraph_edge_index, x.size(0), edge_attr.size(0), entries, x.dtype,
                                  subgraph_node_index, subgraph_edge_id)
        return first, first.with_sources(subgraph_edge_index[0], entries)


EXTRACTORS = {"subtree": SubtreeExtractor, "subgraph": SubgraphExtractor}
