"""Input checks of a SAT batch against a model configuration, one-line ``ValueError`` each: the values
a model would index with (node ids, vocabulary ids, graph order). They read values back to the host,
so a pipeline runs them in its data-loading workers and calls the model with ``validate=False``."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from .config import SATConfig
from .data import SUBGRAPH_KEYS


def _outside(t: Tensor, lo: int, hi: int) -> bool:
    return t.numel() > 0 and bool(t.min() < lo or t.max() >= hi)


def validate_batch(config: SATConfig, batch: Any) -> None:
    """Raise a one-line :class:`ValueError` when ``batch`` cannot be used by a model of ``config``."""
    edge_index = getattr(batch, "edge_index", None)
    n = batch.num_nodes
    if n is None or n < 1:
        raise ValueError("the batch has no nodes")
    if edge_index is None or edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
        shape = None if edge_index is None else list(edge_index.shape)
        raise ValueError(f"edge_index must be an integer tensor of shape [2, E], got {shape}")
    if _outside(edge_index, 0, n):
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
    _validate_node_ids(config, batch)
    if config.uses_edge_features:
        ea = getattr(batch, "edge_attr", None)
        if ea is None:
            raise ValueError(
                f"gnn_type={config.gnn_type!r} with use_edge_attr=True needs batch.edge_attr "
                "(or set model.use_edge_attr: false / model.edge_encoder: none)"
            )
        if ea.size(0) != edge_index.size(1):
            raise ValueError(f"edge_attr has {ea.size(0)} rows for {edge_index.size(1)} edges")
        if config.edge_encoder == "embedding" and not ea.is_floating_point() and _outside(ea, 0, config.edge_in_dim):
            raise ValueError(f"edge_attr holds ids outside [0, {config.edge_in_dim}) (model.edge_in_dim)")
    if config.needs_subgraphs:
        _validate_subgraphs(batch, n, edge_index.size(1))


def _validate_node_ids(config: SATConfig, batch: Any) -> None:
    x = getattr(batch, "x", None)
    if x is None or x.is_floating_point():
        return  # the encoders name a missing or mistyped x (shape checks)
    if config.node_encoder == "embedding" and _outside(x, 0, config.node_in_dim):
        raise ValueError(f"x holds ids outside the node vocabulary [0, {config.node_in_dim}) (model.node_in_dim)")
    if config.node_encoder == "code2_ast" and x.dim() == 2 and x.size(1) == 2:
        for col, size, what in (
            (0, config.code2_num_node_types, "type"),
            (1, config.code2_num_node_attributes, "attribute"),
        ):
            if _outside(x[:, col], 0, size):
                raise ValueError(f"x[:, {col}] holds node {what} ids outside [0, {size})")


def _validate_subgraphs(batch: Any, n: int, num_edges: int) -> None:
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
        ("subgraph_edge_id", batch.subgraph_edge_id, num_edges),
    ):
        if _outside(t, 0, hi):
            raise ValueError(f"{name} holds ids outside [0, {hi})")
