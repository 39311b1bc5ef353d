"""Fixed batch capacities, chosen from the data: the shapes a static, compiled or captured step is
built for (``train.step``; :mod:`sat.padding`).

Each capacity is the mean plus ``train.capacity_sigmas`` standard deviations of its quantity over
the first epoch's batches (NVIDIA's MLPerf GNN code: 5), at most its largest: a rare batch above
runs eagerly instead of making every step pay for it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from sat.padding import Capacity

#: capacity field -> the per-graph column whose sizes it sums over a batch
SUMMED = {"nodes": "num_nodes", "edges": "edge_index", "subgraph_entries": "subgraph_node_index",
          "subgraph_edges": "subgraph_edge_index"}


def graph_sizes(dataset, subgraphs: bool) -> dict[str, np.ndarray]:
    """Every graph's node and edge counts (and k-subgraph entries and edges when ``subgraphs``),
    from a :class:`preprocessing.reader.ShardDataset`'s offsets."""
    columns = [c for field, c in SUMMED.items() if subgraphs or not field.startswith("subgraph")]
    return {c: np.asarray(dataset.sizes(c), dtype=np.int64) for c in columns}


def batch_totals(batches: Sequence[np.ndarray], sizes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per batch (graph id arrays): its graphs, largest graph, and the sums of each column of ``sizes``."""
    lengths = np.asarray([len(b) for b in batches], dtype=np.int64)
    ids = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    totals = {"graphs": lengths, "graph_nodes": np.maximum.reduceat(sizes["num_nodes"][ids], starts)}
    for field, column in SUMMED.items():
        if column in sizes:
            totals[field] = np.add.reduceat(sizes[column][ids], starts)
    return totals


def bound(values: np.ndarray, sigmas: float) -> int:
    """``mean + sigmas * std`` of ``values``, rounded up, at most their largest value."""
    return int(min(values.max(), math.ceil(values.mean() + sigmas * values.std())))


def capacity_for(totals: dict[str, np.ndarray], sigmas: float) -> Capacity:
    """The :class:`~sat.padding.Capacity` for batches of these :func:`batch_totals` (those of several
    splits concatenated); see the module docstring."""
    subgraphs = "subgraph_entries" in totals
    return Capacity(
        nodes=bound(totals["nodes"], sigmas) + 1,
        edges=max(1, bound(totals["edges"], sigmas)),
        graphs=bound(totals["graphs"], sigmas),
        graph_nodes=bound(totals["graph_nodes"], sigmas),
        subgraph_entries=bound(totals["subgraph_entries"], sigmas) + 1 if subgraphs else 0,
        subgraph_edges=bound(totals["subgraph_edges"], sigmas) if subgraphs else 0,
    )


def share_over(totals: dict[str, np.ndarray], capacity: Capacity) -> float:
    """The share of the batches of these :func:`batch_totals` that exceed ``capacity`` (they run eagerly)."""
    count = len(totals["graphs"])
    return float(np.mean([bool(capacity.shortfall(**{k: int(v[i]) for k, v in totals.items()})) for i in range(count)]))


def describe(capacity: Optional[Capacity]) -> str:
    """One line: ``nodes 4097, edges 31000, graphs 64 (+ 8 padding), longest graph 512 ...``."""
    if capacity is None:
        return "none (batches as they come)"
    text = (f"nodes {capacity.nodes}, edges {capacity.edges}, graphs {capacity.graphs} "
            f"(+ {capacity.padding_graphs} padding), longest graph {capacity.graph_nodes}")
    if capacity.subgraph_entries:
        text += f", subgraph entries {capacity.subgraph_entries}, subgraph edges {capacity.subgraph_edges}"
    return text


def run_capacities(job, config, train_split: tuple,
                   eval_splits: Sequence[tuple]) -> tuple[dict[str, Optional[Capacity]], float]:
    """The training and evaluation capacities of a run whose ``train.step`` pads batches (else
    ``None`` each), and the share of the first epoch's training batches over the training capacity.
    ``train_split`` and each of ``eval_splits``: ``(dataset, sampler)``, every rank's batches measured."""
    from pipeline.train.step import pads_batches

    if not pads_batches(job.train.step):
        return {"train": None, "eval": None}, 0.0
    sigmas, subgraphs = job.train.capacity_sigmas, config.needs_subgraphs

    def totals(dataset, sampler) -> dict[str, np.ndarray]:
        return batch_totals(sampler.global_batches(0), graph_sizes(dataset, subgraphs))

    parts = [totals(*split) for split in eval_splits]
    merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else None
    train_totals = totals(*train_split)
    train = capacity_for(train_totals, sigmas)
    return ({"train": train, "eval": capacity_for(merged, sigmas) if merged is not None else None},
            share_over(train_totals, train))
