"""What a padded step (``train.step: static`` or ``compiled``) costs on CPU workers, said before they start.

Padding buys fixed shapes, which pay on a GPU (kernel launches); on a CPU, padding every batch to the
capacity can cost several times an eager epoch. :func:`padding_cost` says it in one line.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

#: Above this many times the eager batches' work, a CPU job is told what padding costs.
WORTH_SAYING = 1.5
#: Batches of the first epoch measured (evenly spaced): enough for the ratio, in well under a second.
SAMPLE_BATCHES = 256


def padding_cost(job, model_config, train_ds) -> Optional[str]:
    """One line on what ``train.step`` (``static``/``compiled``) costs CPU workers on the train split
    ``train_ds`` (a :class:`preprocessing.reader.ShardDataset`), or None (eager, GPU workers, or a
    cost within :data:`WORTH_SAYING`)."""
    from pipeline.train.capacity import batch_totals, capacity_for, graph_sizes
    from pipeline.train.step import pads_batches
    from pipeline.train.batching import split_sampler
    from sat.layout import GraphLayout

    step = job.train.step
    if not pads_batches(step) or job.resources.use_gpu:
        return None
    batches = split_sampler(job, train_ds, shuffle=True).global_batches(0)
    sizes = graph_sizes(train_ds, model_config.needs_subgraphs)
    capacity = capacity_for(batch_totals(batches, sizes), job.train.capacity_sigmas)
    picked = [batches[i] for i in np.unique(np.linspace(0, len(batches) - 1, SAMPLE_BATCHES).astype(int))]
    eager_rows = eager_attention = padded_rows = padded_attention = 0
    slots, longest = capacity.graphs + capacity.padding_graphs, capacity.graph_nodes
    for ids in picked:
        counts = sizes["num_nodes"][ids]
        blocks = GraphLayout.from_sizes(counts).dense_groups()
        rows, attention = int(counts.sum()), sum(g * length * length for _, _, g, length in blocks)
        eager_rows, eager_attention = eager_rows + rows, eager_attention + attention
        fits = not capacity.shortfall(graphs=len(ids), nodes=rows, graph_nodes=int(counts.max()))
        padded_rows += capacity.nodes if fits else rows  # a batch over capacity runs eagerly
        padded_attention += slots * longest * longest if fits else attention
    rows_x, attention_x = padded_rows / max(1, eager_rows), padded_attention / max(1, eager_attention)
    if max(rows_x, attention_x) <= WORTH_SAYING:
        return None
    return (f"train.step: {step!r} on CPU workers pads every batch to the capacity ({capacity.nodes} node rows, "
            f"attention over {slots} graph slots of {longest} nodes: mean + {job.train.capacity_sigmas:g} sigma of the "
            f"batches): on these shards that is {rows_x:.1f}x the node rows and {attention_x:.0f}x the attention work of "
            f"the same batches eager, and a CPU has no kernel launches to save: epochs take several times longer, the "
            f"more so the more attention weighs in the step; train.step: eager is the CPU's mode")
