"""Synthetic ogbg-code2- and ogbg-ppa-shaped graphs for benchmarks and tests.

Node counts are lognormal with mean 125 and sigma 0.75 (``mu = ln 125 - sigma^2 / 2``), clipped to
[10, 1000]. Each graph is a random tree whose node ids are its DFS pre-order (as in OGB's
``py2graph``), edges parent -> child; leaves are the attributed nodes (~55% of nodes); node types
are in [0, 98), attributes in [0, 10030), ``node_depth`` counts ancestors. Then the equivalent of
OGB's code2 ``augment_edge``: AST edges (attr ``[0, 0]``), reversed AST edges (``[0, 1]``),
next-token edges between consecutive attributed nodes in DFS order (``[1, 0]``) and their reverse
(``[1, 1]``): ~383 directed edges per graph. ``y`` holds 5 target subtoken ids in [0, 5002).

API::

    from benchmarks.graphs.synthetic import code2_like_graphs, code2_node_counts
    graphs = code2_like_graphs(64, seed=0)      # list[SATData], deterministic in (n, seed)
    batch = Batch.from_data_list(graphs[:32])

Fields of every graph: ``x`` long ``[N, 2]`` (type, attribute), ``node_depth`` long ``[N]``,
``node_is_attributed`` long ``[N]``, ``edge_index`` long ``[2, E]``, ``edge_attr`` long ``[E, 2]``,
``y`` long ``[1, 5]``, ``num_nodes``. Matching model settings: ``node_encoder='code2_ast'``,
``edge_encoder='linear'`` with ``edge_in_dim=2``, ``head='code2_sequence'`` with ``num_classes=5002``.

:func:`ppa_like_graphs` gives ogbg-ppa-shaped graphs (~243 nodes, average degree ~18, 7 float edge
features, 37 classes: :func:`preprocessing.synthetic.synthetic_ppa_graph`, what
``satp data synthetic-ppa`` writes), each edge followed by its reverse as OGB's loader adds them, with the
fields of a ``jobs/ppa.yaml`` shard row (:func:`preprocessing.transforms.transform_graph`):
``x`` float ``[N, 7]`` (the sum of incident edge features), ``edge_attr`` float ``[E, 7]``,
``degree`` ``[N]``, ``y`` ``[1]``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from preprocessing.config import TransformConfig
from preprocessing.synthetic import NUM_CLASSES as PPA_CLASSES
from preprocessing.synthetic import class_prototypes, synthetic_ppa_graph
from preprocessing.transforms import augment_edge, transform_graph
from sat.data import SATData

NUM_NODE_TYPES = 98
NUM_NODE_ATTRIBUTES = 10030
NUM_CLASSES = 5002  # 5000 subtokens + UNK + EOS
MAX_SEQ_LEN = 5
MEAN_NODES, SIGMA, MIN_NODES, MAX_NODES = 125.0, 0.75, 10, 1000


def code2_node_counts(n: int, seed: int = 0) -> np.ndarray:
    """``n`` node counts, lognormal (mean 125, sigma 0.75) clipped to [10, 1000]."""
    rng = np.random.default_rng(seed)
    mu = math.log(MEAN_NODES) - SIGMA**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, SIGMA, size=n)), MIN_NODES, MAX_NODES).astype(np.int64)


def _random_dfs_tree(num_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """Parents of nodes 1..N-1 of a random tree labelled in DFS pre-order.

    Node ``i`` hangs below a node of the current root-to-last-node path: after each node the walk
    climbs ``j`` levels with probability ``q (1-q)^j`` (``q = 0.45``), which leaves ~55% leaves and
    shallow depths (mean ~4).
    """
    parents = np.empty(num_nodes - 1, dtype=np.int64)
    path = [0]
    climbs = rng.geometric(0.45, size=num_nodes) - 1  # 0, 1, 2, ... levels to climb
    for i in range(1, num_nodes):
        up = min(int(climbs[i]), len(path) - 1)
        if up:
            del path[len(path) - up :]
        parents[i - 1] = path[-1]
        path.append(i)
    return parents


def code2_like_graphs(n: int, seed: int = 0) -> list[SATData]:
    """``n`` synthetic code2-shaped graphs (see the module docstring); deterministic in ``(n, seed)``."""
    counts = code2_node_counts(n, seed)
    rng = np.random.default_rng(seed + 1)
    graphs = []
    for num_nodes in counts.tolist():
        parents = _random_dfs_tree(num_nodes, rng)
        children = np.arange(1, num_nodes)
        depth = np.zeros(num_nodes, dtype=np.int64)
        for c, p in zip(children, parents):  # parents precede children in DFS order
            depth[c] = depth[p] + 1
        has_child = np.zeros(num_nodes, dtype=bool)
        has_child[parents] = True
        is_attributed = (~has_child).astype(np.int64)
        edge_index, edge_attr = augment_edge(np.stack([parents, children]), is_attributed)
        x = np.stack(
            [rng.integers(0, NUM_NODE_TYPES, num_nodes), rng.integers(0, NUM_NODE_ATTRIBUTES, num_nodes)], axis=1
        )
        graphs.append(
            SATData(
                x=torch.from_numpy(x),
                node_depth=torch.from_numpy(depth),
                node_is_attributed=torch.from_numpy(is_attributed),
                edge_index=torch.from_numpy(edge_index),
                edge_attr=torch.from_numpy(edge_attr),
                y=torch.from_numpy(rng.integers(0, NUM_CLASSES, (1, MAX_SEQ_LEN))),
                num_nodes=num_nodes,
            )
        )
    return graphs


def ppa_like_graphs(n: int, seed: int = 0) -> list[SATData]:
    """``n`` synthetic ppa-shaped graphs as ``jobs/ppa.yaml`` stores them; deterministic in ``(n, seed)``."""
    rng = np.random.default_rng(seed)
    prototypes = class_prototypes(seed)
    transform = TransformConfig(rwpe_steps=0, k_hops=0, ppa_node_input="edge_sum")
    graphs = []
    for graph_id, label in enumerate(rng.integers(0, PPA_CLASSES, size=n).tolist()):
        pairs, feats, num_nodes = synthetic_ppa_graph(rng, label, prototypes)
        raw = {"graph_id": graph_id, "num_nodes": num_nodes, "y": label,
               # each edge followed by its reverse, as OGB's loader adds them
               "edge_index": np.stack([pairs, pairs[:, ::-1]], axis=1).reshape(-1, 2).T,
               "edge_attr": np.repeat(feats, 2, axis=0)}
        row = transform_graph(raw, "ppa", transform)
        graphs.append(SATData(num_nodes=num_nodes, **{k: torch.from_numpy(np.asarray(row[k]))
                                                       for k in ("x", "edge_index", "edge_attr", "degree", "y")}))
    return graphs
