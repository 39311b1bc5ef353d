"""Batch capacities chosen from the data (pipeline.train.capacity): mean + k standard deviations of the
first epoch's batches, at most their largest, one more node and subgraph entry for the padding row."""
from __future__ import annotations

import numpy as np

from pipeline.train.batching import NodeBudgetSampler
from pipeline.train.capacity import batch_totals, bound, capacity_for, describe, share_over


def test_bound_is_mean_plus_sigmas_at_most_the_largest():
    values = np.array([10, 12, 14, 100])
    assert bound(values, 0.0) == 34  # ceil(mean 34)
    assert bound(values, 1.0) == int(np.ceil(values.mean() + values.std()))
    assert bound(values, 5.0) == 100  # mean + 5 sd is past the largest: the largest


def test_capacity_of_a_sampler_epoch():
    rng = np.random.default_rng(0)
    nodes = rng.integers(5, 60, size=400)
    sizes = {"num_nodes": nodes, "edge_index": 3 * nodes, "subgraph_node_index": 7 * nodes,
             "subgraph_edge_index": 11 * nodes}
    sampler = NodeBudgetSampler(nodes, 600, seed=3, bucket_size=64)
    batches = sampler.global_batches(0)
    totals = batch_totals(batches, sizes)
    assert totals["nodes"].tolist() == [int(nodes[b].sum()) for b in batches]
    assert totals["graph_nodes"].tolist() == [int(nodes[b].max()) for b in batches]
    assert totals["subgraph_edges"].tolist() == [11 * int(nodes[b].sum()) for b in batches]
    wide = capacity_for(totals, sigmas=5.0)
    assert wide.nodes == totals["nodes"].max() + 1 and wide.subgraph_entries == totals["subgraph_entries"].max() + 1
    assert wide.graphs == totals["graphs"].max() and wide.graph_nodes == nodes.max()
    assert share_over(totals, wide) == 0.0
    tight = capacity_for(totals, sigmas=1.0)  # each quantity's mean + 1 sd: some batches over it
    assert 0.0 < share_over(totals, tight) < 1.0
    assert "subgraph entries" in describe(tight) and describe(None).startswith("none")
