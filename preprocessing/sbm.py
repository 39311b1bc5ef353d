"""PATTERN and CLUSTER regenerated offline by the SBM recipe of Dwivedi et al., "Benchmarking Graph
Neural Networks" (JMLR 2023, arXiv:2003.00982): ``satp data sbm-pattern --out ROOT [--seed S]
[--graphs N] [--force]`` (and ``sbm-cluster``). The notebooks' parameters, re-implemented with numpy:
the graphs follow the benchmark's distribution, they are not the released graphs.

- PATTERN (2 classes): 100 pattern instances (``n0 ~ U{5..34}`` nodes, Erdos-Renyi p = 0.5, node
  attributes ``U{0,1,2}``); a graph is an SBM of 5 communities of sizes ``U{5..34}`` (p = 0.5,
  q = 0.35) joined with its instance's pattern (each cross pair with probability 0.5), shuffled;
  label 1 on the pattern's nodes. 10,000 / 2,000 / 2,000 graphs.
- CLUSTER (6 classes): an SBM of 6 communities (p = 0.55, q = 0.25), shuffled; one random node
  per community gets input ``1 + label``, the others 0. 10,000 / 1,000 / 1,000 graphs.

Layout: OGB-like gzip CSVs (:mod:`preprocessing.ogb_layout`); the same ``(name, graphs, seed)`` gives
byte-identical files."""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from preprocessing.config import SPLITS
from preprocessing.ogb_layout import (OGB_DIR, atomic_dataset_dir, check_out_dir, write_gz_array, write_mapping,
                                      write_splits)

_GZIP_LEVEL = 1  # PATTERN's edges are ~290 MB of text


@dataclass(frozen=True)
class SBMRecipe:
    """Parameters of one benchmark (see the module docstring); sizes are ``U{size_low..size_high-1}``
    as the notebooks' ``np.random.randint(size_low, size_high)``."""

    name: str
    communities: int
    p: float  # edge probability inside a community
    q: float  # edge probability across communities
    split_sizes: tuple[int, int, int]  # train, valid, test graphs
    num_classes: int
    node_vocab: int  # node input ids are in [0, node_vocab)
    size_low: int = 5
    size_high: int = 35
    patterns: int = 0  # PATTERN: pattern instances
    pattern_p: float = 0.0  # PATTERN: edge probability inside the pattern
    pattern_q: float = 0.0  # PATTERN: edge probability between a pattern node and an SBM node

    @property
    def graphs(self) -> int:
        return sum(self.split_sizes)


RECIPES = {
    "pattern": SBMRecipe("pattern", communities=5, p=0.5, q=0.35, split_sizes=(10000, 2000, 2000), num_classes=2,
                         node_vocab=3, patterns=100, pattern_p=0.5, pattern_q=0.5),
    "cluster": SBMRecipe("cluster", communities=6, p=0.55, q=0.25, split_sizes=(10000, 1000, 1000), num_classes=6,
                         node_vocab=7),
}
NUM_CLASSES = {name: r.num_classes for name, r in RECIPES.items()}
NODE_VOCAB = {name: r.node_vocab for name, r in RECIPES.items()}
#: Chen et al. (ICML 2022), appendix dataset table (PyG's ``GNNBenchmarkDataset`` statistics);
#: ``edges`` count both directions.
PAPER_TABLE = {
    "pattern": {"graphs": 14000, "splits": [10000, 2000, 2000], "nodes": 118.9, "edges": 6098.9},
    "cluster": {"graphs": 12000, "splits": [10000, 1000, 1000], "nodes": 117.2, "edges": 4303.9},
}


@dataclass
class SBMGraph:
    """One generated graph: ``edges`` [E, 2] int32 (u < v, sorted), ``x`` [N] and ``y`` [N] int8."""

    edges: np.ndarray
    x: np.ndarray
    y: np.ndarray


# ----------------------------------------------------------------------------- one graph
@functools.lru_cache(maxsize=512)
def _upper_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """All pairs ``i < j`` of ``n`` nodes (the upper triangle the notebooks' loops visit)."""
    return np.triu_indices(n, 1)


def _block_edges(rng: np.random.Generator, block: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """Each pair ``i < j`` linked with probability ``prob[block[i], block[j]]``: edges [E, 2]."""
    i, j = _upper_pairs(block.size)
    keep = rng.random(i.size) < prob[block[i], block[j]]
    return np.stack([i[keep], j[keep]], axis=1)


def _community_sizes(rng: np.random.Generator, recipe: SBMRecipe) -> np.ndarray:
    return rng.integers(recipe.size_low, recipe.size_high, size=recipe.communities)


def _shuffled(rng: np.random.Generator, edges: np.ndarray, *node_arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The notebooks' ``schuffle``: new node ``k`` is old node ``perm[k]``; edges renumbered, then
    stored as ``u < v`` in sorted order. Returns ``(edges, *node_arrays)`` in the new order."""
    n = node_arrays[0].size
    perm = rng.permutation(n)
    new_id = np.empty(n, dtype=np.int64)
    new_id[perm] = np.arange(n)
    a, b = new_id[edges[:, 0]], new_id[edges[:, 1]]
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    order = np.argsort(lo * n + hi, kind="stable")
    out = np.stack([lo[order], hi[order]], axis=1).astype(np.int32)
    return (out, *(arr[perm] for arr in node_arrays))


def draw_pattern(rng: np.random.Generator, recipe: SBMRecipe) -> tuple[np.ndarray, np.ndarray]:
    """A PATTERN instance: ``n0 ~ U{5..34}`` nodes, Erdos-Renyi edges (``pattern_p``): ``(edges [E0, 2],
    attributes [n0])``."""
    n0 = int(rng.integers(recipe.size_low, recipe.size_high))
    edges = _block_edges(rng, np.zeros(n0, dtype=np.int64), np.array([[recipe.pattern_p]]))
    return edges, rng.integers(0, recipe.node_vocab, size=n0)


def pattern_graph(rng: np.random.Generator, recipe: SBMRecipe, pattern: tuple[np.ndarray, np.ndarray]) -> SBMGraph:
    """One PATTERN graph: SBM + the planted ``pattern`` (see the module docstring)."""
    sizes = _community_sizes(rng, recipe)
    n, k = int(sizes.sum()), recipe.communities
    pattern_edges, attributes = pattern
    n0 = attributes.size
    block = np.concatenate([np.repeat(np.arange(k), sizes), np.full(n0, k)])  # the pattern is block k
    prob = np.full((k + 1, k + 1), recipe.q)
    np.fill_diagonal(prob, recipe.p)
    prob[k, :] = prob[:, k] = recipe.pattern_q
    prob[k, k] = 0.0  # the pattern's own edges are the instance's, fixed
    edges = np.concatenate([_block_edges(rng, block, prob), pattern_edges + n])
    x = np.concatenate([rng.integers(0, recipe.node_vocab, size=n), attributes]).astype(np.int8)
    y = (block == k).astype(np.int8)
    edges, x, y = _shuffled(rng, edges, x, y)
    return SBMGraph(edges, x, y)


def cluster_graph(rng: np.random.Generator, recipe: SBMRecipe) -> SBMGraph:
    """One CLUSTER graph: SBM, shuffled, one input-labelled seed per community."""
    sizes = _community_sizes(rng, recipe)
    k = recipe.communities
    block = np.repeat(np.arange(k), sizes)
    prob = np.full((k, k), recipe.q)
    np.fill_diagonal(prob, recipe.p)
    edges, y = _shuffled(rng, _block_edges(rng, block, prob), block.astype(np.int8))
    members = np.argsort(y, kind="stable")  # nodes grouped by community, in node order
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    seeds = members[starts + np.floor(rng.random(k) * sizes).astype(np.int64)]
    x = np.zeros(y.size, dtype=np.int8)
    x[seeds] = np.arange(1, k + 1)
    return SBMGraph(edges, x, y)


# ----------------------------------------------------------------------------- a dataset
def split_sizes(recipe: SBMRecipe, graphs: int | None = None) -> tuple[int, int, int]:
    """The benchmark's split sizes, or ``graphs`` split in the same proportions (each >= 1)."""
    if graphs is None:
        return recipe.split_sizes
    if graphs < 3:
        raise ValueError(f"--graphs: expected at least 3 graphs (one per split), got {graphs}")
    total = recipe.graphs
    valid = max(1, round(graphs * recipe.split_sizes[1] / total))
    test = max(1, round(graphs * recipe.split_sizes[2] / total))
    return graphs - valid - test, valid, test


def pattern_instances(recipe: SBMRecipe, graphs: int) -> int:
    """Pattern instances for ``graphs`` graphs: 100 at full size, about 140 graphs each."""
    return max(1, round(recipe.patterns * graphs / recipe.graphs))


def generate(name: str, graphs: int | None = None, seed: int = 0) -> tuple[list[SBMGraph], dict[str, np.ndarray], np.ndarray | None]:
    """All graphs of a benchmark (train, then valid, then test): ``(graphs, split ids, pattern instance
    per graph or None)``. PATTERN: graph ``i`` of a split of ``S`` uses instance ``floor(i * instances / S)``."""
    recipe = RECIPES[name]
    sizes = split_sizes(recipe, graphs)
    rng = np.random.default_rng(seed)
    patterns = [draw_pattern(rng, recipe) for _ in range(pattern_instances(recipe, sum(sizes)))] if recipe.patterns else []
    out: list[SBMGraph] = []
    instance_of: list[np.ndarray] = []
    for size in sizes:
        if patterns:
            owner = np.arange(size) * len(patterns) // size
            instance_of.append(owner)
            out.extend(pattern_graph(rng, recipe, patterns[i]) for i in owner.tolist())
        else:
            out.extend(cluster_graph(rng, recipe) for _ in range(size))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    split_ids = {s: np.arange(bounds[k], bounds[k + 1]) for k, s in enumerate(SPLITS)}
    return out, split_ids, (np.concatenate(instance_of) if patterns else None)


def statistics(name: str, graphs: list[SBMGraph], split_ids: dict[str, np.ndarray],
               instance_of: np.ndarray | None) -> dict:
    """Per-graph averages (``edges``: both directions, as the paper's table), class shares and the
    paper's table."""
    recipe = RECIPES[name]
    nodes = np.array([g.y.size for g in graphs])
    undirected = np.array([g.edges.shape[0] for g in graphs])
    labels = np.concatenate([g.y for g in graphs])
    shares = np.bincount(labels, minlength=recipe.num_classes) / labels.size
    pattern_sizes = np.array([int(g.y.sum()) for g in graphs]) if instance_of is not None else None
    stats = {
        "graphs": len(graphs),
        "splits": {s: int(v.size) for s, v in split_ids.items()},
        "nodes": float(nodes.mean()),
        "nodes_min": int(nodes.min()),
        "nodes_max": int(nodes.max()),
        "edges": float(2 * undirected.mean()),
        "edges_undirected": float(undirected.mean()),
        "class_shares": [round(float(s), 6) for s in shares],
        "paper": PAPER_TABLE[name],
    }
    if pattern_sizes is not None:
        stats["pattern_instances"] = int(instance_of.max()) + 1
        stats["pattern_size_mean"] = float(pattern_sizes.mean())
        stats["pattern_size_expected"] = (recipe.size_low + recipe.size_high - 1) / 2
    return stats


def build_sbm(out: str | Path, name: str, graphs: int | None = None, seed: int = 0, force: bool = False) -> dict:
    """Generate a benchmark into ``out/sbm_<name>``; ``graphs``: a quick run's total (None: full size).
    Returns :func:`statistics` with ``name``, ``seed`` and ``folder``."""
    if name not in RECIPES:
        raise ValueError(f"unknown SBM benchmark {name!r}; expected one of {sorted(RECIPES)}")
    split_sizes(RECIPES[name], graphs)  # bad --graphs, and a bad --out below, fail before generating
    check_out_dir(Path(out), name, force)
    made, split_ids, instance_of = generate(name, graphs, seed)
    stats = statistics(name, made, split_ids, instance_of)
    with atomic_dataset_dir(Path(out), name, force=force) as folder:
        raw = folder / "raw"
        write_gz_array(raw / "num-node-list.csv.gz", np.array([g.y.size for g in made]), compresslevel=_GZIP_LEVEL)
        write_gz_array(raw / "num-edge-list.csv.gz", np.array([g.edges.shape[0] for g in made]), compresslevel=_GZIP_LEVEL)
        write_gz_array(raw / "edge.csv.gz", np.concatenate([g.edges for g in made]), compresslevel=_GZIP_LEVEL)
        write_gz_array(raw / "node-feat.csv.gz", np.concatenate([g.x for g in made]), compresslevel=_GZIP_LEVEL)
        write_gz_array(raw / "node-label.csv.gz", np.concatenate([g.y for g in made]), compresslevel=_GZIP_LEVEL)
        write_splits(folder, name, split_ids)
        if instance_of is not None:
            write_mapping(folder / "mapping" / "graphidx2pattern.csv.gz", ("graph idx", "pattern idx"),
                          instance_of.tolist(), _GZIP_LEVEL)
        record = {"name": name, "seed": seed, "recipe": asdict(RECIPES[name]), "statistics": stats,
                  "source": "Dwivedi et al., Benchmarking GNNs: data/SBMs/generate_SBM_*.ipynb (recipe re-implemented)"}
        (folder / "sbm.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return {"name": name, "seed": seed, "folder": str(Path(out) / OGB_DIR[name]), **stats}


def format_statistics(summary: dict) -> str:
    """The statistics of :func:`build_sbm` as a table against the paper's (printed by ``satp data``)."""
    paper = summary["paper"]

    def row(*cells: str) -> str:
        return "{:30s}{:>20s}{:>20s}{:>9s}".format(*cells).rstrip()

    def diff(key: str) -> str:
        return f"{100 * (summary[key] / paper[key] - 1):+.2f}%"

    lines = [
        f"{summary['name'].upper()} (seed {summary['seed']}) -> {summary['folder']}",
        row("", "generated", "paper", "diff"),
        row("graphs", f"{summary['graphs']:,}", f"{paper['graphs']:,}", ""),
        row("train/valid/test", "/".join(f"{summary['splits'][s]:,}" for s in SPLITS),
            "/".join(f"{v:,}" for v in paper["splits"]), ""),
        row("avg nodes", f"{summary['nodes']:,.1f}", f"{paper['nodes']:,.1f}", diff("nodes")),
        row("avg edges (both directions)", f"{summary['edges']:,.1f}", f"{paper['edges']:,.1f}", diff("edges")),
        row("avg undirected edges", f"{summary['edges_undirected']:,.1f}", "", ""),
        row("nodes min..max", f"{summary['nodes_min']}..{summary['nodes_max']}", "", ""),
        "class shares: " + ", ".join(f"{c}: {s:.3f}" for c, s in enumerate(summary["class_shares"])),
    ]
    if "pattern_size_mean" in summary:
        lines.append(f"{summary['pattern_instances']} pattern instances, mean pattern size "
                     f"{summary['pattern_size_mean']:.2f} (recipe {summary['pattern_size_expected']:.1f})")
    if "seconds" in summary:
        lines.append(f"generated and written in {summary['seconds']:.1f} s")
    return "\n".join(lines)
