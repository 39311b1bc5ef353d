"""A synthetic ogbg-ppa in OGB's raw layout (``satp data synthetic-ppa --out ROOT [--graphs N]``).

Shaped like the real dataset (FACTS: ~243 nodes, average degree ~18, 7 float edge features in
[0, 1], 37 classes, split by species): each graph is a degree-corrected stochastic block model.
Its class ``c`` sets the structure and the edge features, so that a model can learn it:

- number of blocks ``1 + c % 4`` and share of within-block edges ``0.5 / 0.725 / 0.95``
  (``(c // 4) % 3``), degree heterogeneity (``c // 12``: Pareto node weights of shape 4, 2.5,
  1.8 or 1.4);
- edge features: a class prototype in [0.15, 0.85]^7 plus Gaussian noise (sd 0.15), clipped
  to [0, 1].

Graphs belong to "species" groups (about 10 graphs each, at least 3 groups); whole groups go to
train/valid/test (~60/20/20 of the graphs). Edges are written once per undirected edge (OGB's
loader adds the reverse). Deterministic for a given ``(graphs, seed)``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from preprocessing.ogb_layout import assign_groups, atomic_dataset_dir, write_gz_array, write_splits

NUM_CLASSES = 37
NUM_EDGE_FEATURES = 7
_PARETO_SHAPE = (4.0, 2.5, 1.8, 1.4)


def class_prototypes(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, 1])
    return rng.uniform(0.15, 0.85, size=(NUM_CLASSES, NUM_EDGE_FEATURES))


def synthetic_ppa_graph(rng: np.random.Generator, label: int, prototypes: np.ndarray,
                        mean_nodes: float = 243.0, mean_degree: float = 18.0) -> tuple[np.ndarray, np.ndarray, int]:
    """One graph of class ``label``: ``(edges [E, 2] one direction, edge features [E, 7] float32, N)``."""
    n = int(np.clip(round(rng.normal(mean_nodes, 50.0)), 60, 600))
    blocks = 1 + label % 4
    within = (0.5, 0.725, 0.95)[(label // 4) % 3]
    weights = rng.pareto(_PARETO_SHAPE[min(label // 12, 3)], size=n) + 1.0
    weights /= weights.sum()
    block_of = np.sort(rng.integers(0, blocks, size=n))
    starts = np.searchsorted(block_of, np.arange(blocks))
    sizes = np.bincount(block_of, minlength=blocks)
    m = int(round(n * mean_degree / 2 * 1.08))  # a few duplicates are dropped below
    u = rng.choice(n, size=m, p=weights)
    v_any = rng.choice(n, size=m, p=weights)
    b = block_of[u]
    v_in = starts[b] + np.floor(rng.random(m) * np.maximum(sizes[b], 1)).astype(np.int64)
    v = np.where(rng.random(m) < within, v_in, v_any)
    lo, hi = np.minimum(u, v), np.maximum(u, v)
    keep = lo != hi
    codes = np.unique(lo[keep] * n + hi[keep])  # sorted as the (lo, hi) pairs, faster than unique(axis=0)
    pairs = np.stack([codes // n, codes % n], axis=1)
    if len(pairs) == 0:
        pairs = np.array([[0, 1]])
    pairs = pairs[rng.permutation(len(pairs))]
    feats = prototypes[label] + rng.normal(0.0, 0.15, size=(len(pairs), NUM_EDGE_FEATURES))
    return pairs.astype(np.int64), np.clip(feats, 0.0, 1.0).astype(np.float32), n


def build_synthetic_ppa(out: str | Path, graphs: int = 2000, seed: int = 0, force: bool = False) -> dict:
    """Write ``out/ogbg_ppa`` (see the module docstring); return a summary dict."""
    if graphs < 3:
        raise ValueError(f"--graphs: expected at least 3 graphs, got {graphs}")
    rng = np.random.default_rng(seed)
    prototypes = class_prototypes(seed)
    labels = rng.permutation(np.arange(graphs) % NUM_CLASSES)
    n_groups = max(3, graphs // 10)
    groups = rng.integers(0, n_groups, size=graphs)
    groups[:3] = [0, 1, 2]  # every split gets a group
    edges, feats, n_nodes, n_edges = [], [], [], []
    for label in labels.tolist():
        e, f, n = synthetic_ppa_graph(rng, label, prototypes)
        edges.append(e)
        feats.append(f)
        n_nodes.append(n)
        n_edges.append(len(e))
    sizes = {f"{g:05d}": int(c) for g, c in zip(*np.unique(groups, return_counts=True))}
    group_split = assign_groups(sizes, (0.6, 0.2, 0.2))
    split_of = np.array([group_split[f"{g:05d}"] for g in groups])
    split_ids = {s: np.flatnonzero(split_of == s) for s in ("train", "valid", "test")}
    name = "ogbg-ppa"
    with atomic_dataset_dir(Path(out), name, force=force) as folder:
        raw = folder / "raw"
        write_gz_array(raw / "edge.csv.gz", np.concatenate(edges))
        write_gz_array(raw / "edge-feat.csv.gz", np.concatenate(feats), fmt="%.4f")
        write_gz_array(raw / "num-node-list.csv.gz", np.asarray(n_nodes))
        write_gz_array(raw / "num-edge-list.csv.gz", np.asarray(n_edges))
        write_gz_array(raw / "graph-label.csv.gz", labels)
        write_splits(folder, name, split_ids)
    return {
        "graphs": graphs,
        "mean_nodes": float(np.mean(n_nodes)),
        "mean_degree": float(2 * np.sum(n_edges) / np.sum(n_nodes)),
        "splits": {s: int(v.size) for s, v in split_ids.items()},
    }
