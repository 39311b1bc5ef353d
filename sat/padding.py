"""Fixed-capacity batches: a mini-batch padded to static shapes, with padding that changes nothing.

Static shapes let a step be compiled and captured as a CUDA graph once. :func:`pad_batch` pads a
batch to a :class:`Capacity`; outputs on the real graphs, the loss, every gradient and BatchNorm's
statistics equal the unpadded batch's: padding rows sit in graph slots of their own, padding edges
and subgraph entries join padding rows only (zeroed at every layer's input, so they stay finite),
BatchNorm counts real rows only (:mod:`sat.norm`), and padding targets are :data:`PAD_TARGET`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from .data import SUBGRAPH_KEYS, SATData
from .layout import GraphLayout

PAD_TARGET = -100  # targets of padding rows: torch.nn.functional.cross_entropy's ignore_index

NODE_ROWS = ("x", "rwpe", "lap_pe", "node_depth", "degree")  # one row per node, padded with zeros
EDGE_ROWS = ("edge_attr",)  # one row per edge, padded with zeros
GRAPH_ROWS = ("graph_id",)  # one row per graph, padded with -1


@dataclass(frozen=True)
class Capacity:
    """Static sizes of a padded batch. ``nodes`` includes at least one padding row (padding edges join
    it), ``subgraph_entries`` one padding entry; ``0`` subgraph capacities: no k-subgraph indices."""

    nodes: int
    edges: int
    graphs: int
    graph_nodes: int
    subgraph_entries: int = 0
    subgraph_edges: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            lowest = 0 if f.name.startswith("subgraph") else 1
            if not isinstance(value, (int, np.integer)) or value < lowest:
                raise ValueError(f"Capacity.{f.name}: expected an integer >= {lowest}, got {value!r}")
        if self.nodes < 2:
            raise ValueError(f"Capacity.nodes: expected >= 2 (a node and a padding row), got {self.nodes}")

    @property
    def padding_graphs(self) -> int:
        """Graph slots for the padding rows: enough for ``nodes`` rows of at most ``graph_nodes`` each."""
        return math.ceil(self.nodes / self.graph_nodes)

    def shortfall(self, graphs: int, nodes: int, graph_nodes: int, edges: int = 0, subgraph_entries: int = 0,
                  subgraph_edges: int = 0) -> list[str]:
        """What of a batch with these counts does not fit (one phrase each; empty: it fits)."""
        checks = (("graphs", graphs, self.graphs), ("nodes", nodes, self.nodes - 1),
                  ("largest graph", graph_nodes, self.graph_nodes), ("edges", edges, self.edges),
                  ("subgraph entries", subgraph_entries, max(self.subgraph_entries - 1, 0)),
                  ("subgraph edges", subgraph_edges, self.subgraph_edges))
        return [f"{name} {value} > {limit}" for name, value, limit in checks if value > limit]

    def to_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Capacity":
        return cls(**{k: int(v) for k, v in values.items()})


@dataclass(frozen=True)
class Padding:
    """What a padded batch holds for real: its first ``graphs`` graph slots and ``nodes`` node rows
    (host integers, read by the training loop for its metrics; never by the model)."""

    graphs: int
    nodes: int


def batch_counts(batch: Any, subgraphs: bool = True) -> dict[str, int]:
    """A PyG batch's sizes, as :meth:`Capacity.shortfall` takes them (from tensor shapes and ``ptr``);
    ``subgraphs=False``: its k-subgraph indices left out (0)."""
    sizes = torch.diff(batch.ptr)
    entries = getattr(batch, "subgraph_node_index", None) if subgraphs else None
    sub_edges = getattr(batch, "subgraph_edge_index", None) if subgraphs else None
    return {
        "graphs": int(sizes.numel()),
        "nodes": int(sizes.sum()),
        "graph_nodes": int(sizes.max()) if sizes.numel() else 0,
        "edges": int(batch.edge_index.size(1)),
        "subgraph_entries": 0 if entries is None else int(entries.numel()),
        "subgraph_edges": 0 if sub_edges is None else int(sub_edges.size(1)),
    }


def fits(batch: Any, capacity: Capacity) -> bool:
    """Whether :func:`pad_batch` can pad ``batch`` to ``capacity``."""
    return not capacity.shortfall(**batch_counts(batch, subgraphs=capacity.subgraph_entries > 0))


def padding_of(batch: Any) -> Optional[Padding]:
    """The :class:`Padding` of a padded batch, ``None`` for any other batch."""
    padding = getattr(batch, "padding", None)
    return padding if isinstance(padding, Padding) else None


def _pad_rows(value: Tensor, rows: int, fill) -> Tensor:
    """``value`` followed by rows of ``fill`` up to ``rows`` (the caller checked the capacity)."""
    out = value.new_full((rows, *value.shape[1:]), fill)
    out[: value.size(0)] = value
    return out


def _pad_ids(value: Tensor, rows: int, start: int, stop: int) -> Tensor:
    """``value`` (ids, along its last axis) followed by ids cycling over ``start .. stop - 1`` up to
    ``rows`` ids (every row of a ``[2, E]`` index gets the same ones: padding self-loops)."""
    missing = rows - value.size(-1)
    fill = torch.arange(missing, dtype=value.dtype) % (stop - start) + start
    return torch.cat([value, fill.expand(*value.shape[:-1], missing)], dim=-1)


def pad_batch(batch: Any, capacity: Capacity, node_targets: bool = False, cls_token: bool = False) -> Any:
    """``batch`` (a CPU PyG ``Batch`` of :class:`~sat.data.SATData`) padded to ``capacity``;
    ``node_targets``: ``y`` per node; ``cls_token``: the model reads out through [CLS] nodes. A
    capacity without subgraph entries drops the k-subgraph indices. Raises ``ValueError`` when the
    batch exceeds the capacity (:func:`fits` says beforehand) or holds an attribute with no padding rule."""
    from torch_geometric.data import Batch

    subgraphs = capacity.subgraph_entries > 0
    counts = batch_counts(batch, subgraphs)
    problems = capacity.shortfall(**counts)
    if problems:
        raise ValueError(f"pad_batch: the batch exceeds its capacity ({'; '.join(problems)})")
    sizes = torch.diff(batch.ptr)
    layout = GraphLayout.padded(sizes, capacity, cls_token=cls_token)
    graphs, nodes, entries = counts["graphs"], counts["nodes"], counts["subgraph_entries"]
    slots = layout.num_graphs
    # padding edges join padding rows, entries sit on padding rows, subgraph edges join padding entries
    out = Batch(_base_cls=SATData)
    for key, value in batch:
        if key in ("batch", "ptr", "graph_layout", "padding") or (key in SUBGRAPH_KEYS and not subgraphs):
            continue
        if not isinstance(value, Tensor):  # host lists (y_tokens) stay as they are: one item per real graph
            out[key] = value
        elif key in NODE_ROWS:
            out[key] = _pad_rows(value, capacity.nodes, 0)
        elif key in EDGE_ROWS:
            out[key] = _pad_rows(value, capacity.edges, 0)
        elif key in GRAPH_ROWS:
            out[key] = _pad_rows(value, slots, -1)
        elif key == "y":
            out[key] = _pad_rows(value if node_targets else value.view(graphs, -1).squeeze(-1),
                                 capacity.nodes if node_targets else slots, PAD_TARGET)
        elif key == "edge_index":
            out[key] = _pad_ids(value, capacity.edges, nodes, capacity.nodes)
        elif key in ("subgraph_node_index", "subgraph_indicator"):
            out[key] = _pad_ids(value, capacity.subgraph_entries, nodes, capacity.nodes)
        elif key == "subgraph_edge_index":
            out[key] = _pad_ids(value, capacity.subgraph_edges, entries, capacity.subgraph_entries)
        elif key == "subgraph_edge_id":  # any edge will do: its message only reaches a padding entry
            out[key] = _pad_ids(value, capacity.subgraph_edges, 0, 1)
        else:
            raise ValueError(f"pad_batch: batch attribute {key!r} has no padding rule (known: node rows {NODE_ROWS}, "
                             f"edge rows {EDGE_ROWS}, graph rows {GRAPH_ROWS}, y, and the index attributes)")
    input_sizes = layout.sizes - int(cls_token)
    out.batch = torch.repeat_interleave(torch.arange(slots), torch.from_numpy(input_sizes))
    out.ptr = torch.from_numpy(np.concatenate([[0], np.cumsum(input_sizes)]))
    out.num_nodes = capacity.nodes
    out._num_graphs = slots
    out.graph_layout = layout
    out.padding = Padding(graphs=graphs, nodes=nodes)
    return out
