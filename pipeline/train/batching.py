"""Batches built to a node budget with size bucketing.

Dense attention pads every graph of a batch to its largest. Each epoch the split is shuffled with
``seed + epoch``, cut into buckets sorted by size and cut greedily into batches within the budget of
padded node slots, and the batch order shuffled again; a graph over the budget gets a batch of its
own. Evaluation batches are cut from the split sorted by size, nothing dropped.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np


def pack(order: np.ndarray, sizes: np.ndarray, node_budget: int, max_graphs: Optional[int] = None) -> list[np.ndarray]:
    """Cut ``order`` (graph indices, sorted by size, ascending) greedily into batches of at most
    ``node_budget`` padded node slots (graphs x largest graph) and ``max_graphs`` graphs; a graph
    larger than the budget gets a batch of its own. Sorted, a batch is the longest run from its first
    graph whose slots fit: one vectorised test per batch."""
    ordered = np.asarray(sizes, dtype=np.int64)[order]
    if ordered.size > 1 and bool((ordered[1:] < ordered[:-1]).any()):
        raise ValueError("pack needs the graphs sorted by size")
    n = len(order)
    cap = n if max_graphs is None else max(1, int(max_graphs))
    batches: list[np.ndarray] = []
    start = 0
    while start < n:
        # no graph after start is smaller than it: more than budget // size[start] graphs never fit
        stop = min(n, start + cap, start + max(1, node_budget // max(int(ordered[start]), 1)))
        slots = ordered[start:stop] * np.arange(1, stop - start + 1)
        count = max(1, int(np.count_nonzero(slots <= node_budget)))
        batches.append(order[start : start + count])
        start += count
    return batches


class NodeBudgetSampler:
    """Node-budget batches of a split, and one rank's round-robin share of them (the sampler of a
    DataLoader with ``batch_size=None`` over :class:`pipeline.train.loader.GraphBatches`). The batches
    of an epoch are a pure function of ``(seed, epoch)``; training deals them by
    :class:`pipeline.train.global_batch.GlobalBatches`."""

    def __init__(
        self,
        sizes: np.ndarray,
        node_budget: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        bucket_size: int = 2048,
        max_graphs: Optional[int] = None,
        indices: Optional[np.ndarray] = None,
    ) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.indices = np.arange(len(self.sizes)) if indices is None else np.asarray(indices, dtype=np.int64)
        if len(self.indices) == 0:
            raise ValueError("cannot batch an empty split")
        self.node_budget = int(node_budget)
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, int(seed)
        self.bucket_size, self.max_graphs = int(bucket_size), max_graphs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of ``epoch`` before they are dealt: what the fixed batch capacities are
        measured on (:mod:`pipeline.train.capacity`)."""
        sizes = self.sizes
        if not self.shuffle:
            order = self.indices[np.argsort(sizes[self.indices], kind="stable")]
            return pack(order, sizes, self.node_budget, self.max_graphs)
        rng = np.random.default_rng([self.seed, epoch])
        perm = self.indices[rng.permutation(len(self.indices))]
        batches: list[np.ndarray] = []
        for lo in range(0, len(perm), self.bucket_size):
            bucket = perm[lo : lo + self.bucket_size]
            bucket = bucket[np.argsort(sizes[bucket], kind="stable")]
            batches.extend(pack(bucket, sizes, self.node_budget, self.max_graphs))
        return [batches[i] for i in rng.permutation(len(batches))]

    def epoch_batches(self, epoch: Optional[int] = None) -> list[np.ndarray]:
        """This rank's batches for ``epoch`` (default: the current one)."""
        return self.global_batches(self.epoch if epoch is None else epoch)[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[np.ndarray]:
        """This rank's batches of the current epoch: an array of graph ids each."""
        return iter(self.epoch_batches())

    def __len__(self) -> int:
        return len(self.epoch_batches())


def subset_indices(n: int, limit: Optional[int], seed: int) -> Optional[np.ndarray]:
    """The first ``limit`` graphs of a seeded permutation of ``range(n)`` (sorted), or None for all."""
    if limit is None or limit >= n:
        return None
    rng = np.random.default_rng([seed, 7919])
    return np.sort(rng.permutation(n)[:limit])


def split_sampler(job, dataset, shuffle: bool, rank: int = 0, world: int = 1,
                  seed: Optional[int] = None) -> NodeBudgetSampler:
    """The node-budget batches of one rank over a split of ``job``: shuffled per epoch for training (by
    ``train.seed``, or ``seed``), sorted by size for evaluation (``train.eval_node_budget``, else twice)."""
    train = job.train
    return NodeBudgetSampler(
        np.asarray(dataset.num_nodes),
        train.node_budget if shuffle else (train.eval_node_budget or 2 * train.node_budget),
        rank=rank,
        world_size=world,
        shuffle=shuffle,
        seed=train.seed if seed is None else seed,
        bucket_size=train.bucket_size,
        max_graphs=train.max_graphs_per_batch,
        # evaluation subsets do not depend on train.seed: runs of several seeds score the same graphs
        indices=(subset_indices(len(dataset), train.train_subset, train.seed) if shuffle
                 else subset_indices(len(dataset), train.eval_subset, job.data.seed)),
    )
