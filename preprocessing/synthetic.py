"""A synthetic ogbg-ppa in OGB's raw layout (``satp data synthetic-ppa --out ROOT [--graphs N] [--workers N]``).

Shaped like the real dataset (~243 nodes, average degree ~18, 7 float edge features, 37 classes,
split by species): each graph a degree-corrected SBM whose class sets its structure and edge
features. The bytes depend on ``(graphs, seed)`` only."""
from __future__ import annotations

import sys
import zlib
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from preprocessing.ogb_layout import (assign_groups, atomic_dataset_dir, check_out_dir, format_fixed_csv,
                                      format_int_csv, write_gz_array, write_splits)
from preprocessing.pycode import process_pool, default_workers

NUM_CLASSES = 37
NUM_EDGE_FEATURES = 7
FEATURE_DECIMALS = 4
#: Graphs per block: one task, one random stream and one gzip member per big file (~13 MB of gzip).
BLOCK_GRAPHS = 256
#: The blocks a parent lets its workers compute ahead of the one it writes, per worker.
BLOCKS_AHEAD_PER_WORKER = 2
_PARETO_SHAPE = (4.0, 2.5, 1.8, 1.4)
MEAN_NODES, MEAN_DEGREE = 243.0, 18.0  # the real dataset's


def class_prototypes(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, 1])
    return rng.uniform(0.15, 0.85, size=(NUM_CLASSES, NUM_EDGE_FEATURES))


def synthetic_ppa_graph(rng: np.random.Generator, label: int, prototypes: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """One graph of class ``label``: ``(edges [E, 2] one direction, edge features [E, 7] float32, N)``."""
    n = int(np.clip(round(rng.normal(MEAN_NODES, 50.0)), 60, 600))
    blocks = 1 + label % 4
    within = (0.5, 0.725, 0.95)[(label // 4) % 3]
    weights = rng.pareto(_PARETO_SHAPE[min(label // 12, 3)], size=n) + 1.0
    weights /= weights.sum()
    block_of = np.sort(rng.integers(0, blocks, size=n))
    starts = np.searchsorted(block_of, np.arange(blocks))
    sizes = np.bincount(block_of, minlength=blocks)
    m = int(round(n * MEAN_DEGREE / 2 * 1.08))  # a few duplicates are dropped below
    # m endpoints drawn from the weights, twice, as counts per node; independent pairs once one side is shuffled
    nodes = np.arange(n)
    u = np.repeat(nodes, rng.multinomial(m, weights))
    v_any = rng.permutation(np.repeat(nodes, rng.multinomial(m, weights)))
    b = block_of[u]
    v_in = starts[b] + np.floor(rng.random(m) * sizes[b]).astype(np.int64)  # sizes[b] >= 1: u is in b
    v = np.where(rng.random(m) < within, v_in, v_any)
    lo, hi = np.minimum(u, v), np.maximum(u, v)
    codes = np.sort((lo * n + hi)[lo != hi])  # sorted as the (lo, hi) pairs
    codes = codes[np.concatenate(([True], codes[1:] != codes[:-1]))]  # distinct
    if codes.size == 0:
        codes = np.array([1])  # the edge (0, 1)
    pairs = np.stack([codes // n, codes % n], axis=1)[rng.permutation(codes.size)]
    noise = rng.standard_normal(size=(len(pairs), NUM_EDGE_FEATURES), dtype=np.float32)
    feats = prototypes[label].astype(np.float32) + np.float32(0.15) * noise
    return pairs, np.clip(feats, 0.0, 1.0, out=feats), n


def _gzip_member() -> zlib._Compress:
    """A compressor of one gzip member (mtime 0), Huffman only: the text is mostly random digits."""
    return zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS, zlib.DEF_MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)


def synthetic_block(seed: int, block: int, labels: np.ndarray) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """One block's graphs (random stream ``(seed, 2, block)``) as ``(edge.csv gzip member, edge-feat.csv
    gzip member, nodes per graph, edges per graph)``, compressed graph by graph."""
    rng = np.random.default_rng([seed, 2, block])
    prototypes = class_prototypes(seed)
    edge_gz, feat_gz = _gzip_member(), _gzip_member()
    edge_out, feat_out = [], []
    nodes = np.zeros(len(labels), dtype=np.int64)
    edges = np.zeros(len(labels), dtype=np.int64)
    for i, label in enumerate(labels.tolist()):
        pairs, feats, nodes[i] = synthetic_ppa_graph(rng, label, prototypes)
        edges[i] = len(pairs)
        edge_out.append(edge_gz.compress(format_int_csv(pairs)))
        feat_out.append(feat_gz.compress(format_fixed_csv(feats, FEATURE_DECIMALS)))
    edge_out.append(edge_gz.flush())
    feat_out.append(feat_gz.flush())
    return b"".join(edge_out), b"".join(feat_out), nodes, edges


def _in_order(tasks: Iterable[tuple[int, int, np.ndarray]], workers: int) -> Iterator[tuple]:
    """:func:`synthetic_block` of each task, in order; with ``workers > 1`` in spawned processes, at most
    :data:`BLOCKS_AHEAD_PER_WORKER` results per worker ahead."""
    if workers == 1:
        yield from (synthetic_block(*task) for task in tasks)
        return
    with process_pool(workers) as pool:
        pending: deque = deque()
        try:
            for task in tasks:
                pending.append(pool.submit(synthetic_block, *task))
                if len(pending) > BLOCKS_AHEAD_PER_WORKER * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # an error or an abandoned generator: start no further block
            for future in pending:
                future.cancel()


def _labels_and_splits(graphs: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The class of every graph, and the graph ids of each split (whole species groups)."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(graphs) % NUM_CLASSES)
    n_groups = max(3, graphs // 10)
    groups = rng.integers(0, n_groups, size=graphs)
    groups[:3] = [0, 1, 2]  # every split gets a group
    sizes = {f"{g:05d}": int(c) for g, c in zip(*np.unique(groups, return_counts=True))}
    group_split = assign_groups(sizes, (0.6, 0.2, 0.2))
    split_of = np.array([group_split[f"{g:05d}"] for g in groups])
    return labels, {s: np.flatnonzero(split_of == s) for s in ("train", "valid", "test")}


def build_synthetic_ppa(out: str | Path, graphs: int = 2000, seed: int = 0, force: bool = False,
                        workers: int | None = None) -> dict:
    """Write ``out/ogbg_ppa``; return a summary dict. The bytes do not depend on ``workers``; they do on
    :data:`BLOCK_GRAPHS` (each block has its own random stream)."""
    if graphs < 3:
        raise ValueError(f"--graphs: expected at least 3 graphs, got {graphs}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers: expected at least 1, got {workers}")
    check_out_dir(Path(out), "ogbg-ppa", force)  # before drawing the labels of a size that may be large
    labels, split_ids = _labels_and_splits(graphs, seed)
    starts = range(0, graphs, BLOCK_GRAPHS)
    tasks = ((seed, block, labels[start : start + BLOCK_GRAPHS]) for block, start in enumerate(starts))
    workers = min(workers or default_workers(), len(starts))
    n_nodes, n_edges = [], []
    name = "ogbg-ppa"
    with atomic_dataset_dir(Path(out), name, force=force) as folder:
        raw = folder / "raw"
        raw.mkdir(parents=True)
        with (open(raw / "edge.csv.gz", "wb") as edge_file, open(raw / "edge-feat.csv.gz", "wb") as feat_file,
              tqdm(total=graphs, unit="graph", desc="synthetic-ppa", file=sys.stderr, disable=None) as bar):
            for edge_member, feat_member, nodes, edges in _in_order(tasks, workers):
                edge_file.write(edge_member)
                feat_file.write(feat_member)
                n_nodes.append(nodes)
                n_edges.append(edges)
                bar.update(len(nodes))
        n_nodes, n_edges = np.concatenate(n_nodes), np.concatenate(n_edges)
        write_gz_array(raw / "num-node-list.csv.gz", n_nodes)
        write_gz_array(raw / "num-edge-list.csv.gz", n_edges)
        write_gz_array(raw / "graph-label.csv.gz", labels)
        write_splits(folder, name, split_ids)
    return {
        "graphs": graphs,
        "mean_nodes": float(n_nodes.mean()),
        "mean_degree": float(2 * n_edges.sum() / n_nodes.sum()),
        "splits": {s: int(v.size) for s, v in split_ids.items()},
    }
