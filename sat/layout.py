"""Node layout of a mini-batch of graphs, shared by every layer's attention (Chen et al., ICML 2022,
Sec. 4.1: every node attends to every node of its own graph).

:class:`GraphLayout` holds ``ptr`` / ``cu_seqlens`` ``[B + 1]``, ``batch`` and ``local_index``
``[N]``, ``max_nodes`` and the dense blocks (graphs of sizes within ``bucket_ratio`` padded into
``[G, L]``). With ``cls=True`` a [CLS] node precedes every graph (``real_index [N_in]``,
``cls_index [B]``). A fixed-capacity layout (:meth:`GraphLayout.padded`) has the same shapes for
every batch and a ``node_mask [N]`` of the real rows. Built from node counts on the host
(:meth:`GraphLayout.from_sizes`, e.g. in a DataLoader worker) and moved with :meth:`to`."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from .padding import Capacity

DenseGroup = tuple[Tensor, Tensor, int, int]  # (node ids [n], flat positions [n], G, L)


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every pair (vectorised), int64."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + offsets


def _host_sizes(sizes: Union[Sequence[int], np.ndarray, Tensor]) -> np.ndarray:
    if isinstance(sizes, Tensor):
        sizes = sizes.detach().cpu().numpy()
    return np.asarray(sizes, dtype=np.int64).reshape(-1)


def _size_runs(sizes: np.ndarray, bucket_ratio: float) -> list[np.ndarray]:
    """Non-empty graphs, largest first, cut into runs whose sizes differ by at most ``bucket_ratio``."""
    order = np.argsort(-sizes, kind="stable")
    order = order[sizes[order] > 0]
    runs: list[list[int]] = []
    for g in order.tolist():
        if runs and sizes[g] * bucket_ratio >= sizes[runs[-1][0]]:
            runs[-1].append(g)
        else:
            runs.append([g])
    return [np.asarray(run, dtype=np.int64) for run in runs]


class GraphLayout:
    """Index bookkeeping of a mini-batch of graphs (the module docstring), built by :meth:`from_sizes`
    or :meth:`padded`. ``bucket_ratio``: dense attention pads graphs of sizes within this factor into
    one block; ``None``: one block."""

    @classmethod
    def from_sizes(
        cls, sizes: Union[Sequence[int], np.ndarray, Tensor], bucket_ratio: Optional[float] = 1.5, cls_token: bool = False
    ) -> "GraphLayout":
        """The layout of graphs of ``sizes[g]`` nodes, on the CPU; ``cls_token``: a [CLS] node before each."""
        layout = cls.__new__(cls)
        layout._build(_host_sizes(sizes), bucket_ratio, cls=cls_token)
        return layout

    @classmethod
    def padded(
        cls, sizes: Union[Sequence[int], np.ndarray, Tensor], capacity: "Capacity", cls_token: bool = False
    ) -> "GraphLayout":
        """The fixed-capacity layout of graphs of ``sizes[g]`` nodes (:func:`sat.padding.pad_batch`): slots
        ``0..B-1`` hold the graphs, the rest are empty or padding (at most ``capacity.graph_nodes`` rows
        each); every shape depends on ``capacity`` alone."""
        real = _host_sizes(sizes)  # that they fit the capacity is pad_batch's check
        longest = capacity.graph_nodes
        full, rest = divmod(capacity.nodes - int(real.sum()), longest)
        padding = np.zeros(capacity.padding_graphs, dtype=np.int64)
        padding[:full] = longest
        padding[full] = rest if full < padding.size else 0
        slots = np.concatenate([real, np.zeros(capacity.graphs - real.size, dtype=np.int64), padding])
        layout = cls.__new__(cls)
        layout._build(slots, None, cls=cls_token)
        layout.max_nodes = longest + int(cls_token)
        layout.node_mask = layout.batch < real.size
        L = layout.max_nodes
        layout._groups = [(torch.arange(layout.num_nodes), layout.batch * L + layout.local_index, slots.size, L)]
        return layout

    def _build(self, real_sizes: np.ndarray, bucket_ratio: Optional[float], cls: bool) -> None:
        if (real_sizes < 0).any():
            raise ValueError("graph sizes must be non-negative")
        sizes = real_sizes + 1 if cls else real_sizes
        B = sizes.size
        ptr = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(sizes, out=ptr[1:])
        N = int(ptr[-1])
        batch = np.repeat(np.arange(B, dtype=np.int64), sizes)
        local = np.arange(N, dtype=np.int64) - ptr[:-1][batch]
        self.num_graphs = int(B)
        self.num_nodes = N
        self.num_input_nodes = int(real_sizes.sum())  # the batch's node rows: every node but the [CLS] ones
        self.node_mask: Optional[Tensor] = None  # padded layouts: the rows of the batch's graphs (see padded)
        self.has_cls = bool(cls)
        self.sizes = sizes  # host copy: node count of every graph in this layout
        self.max_nodes = int(sizes.max()) if B else 0
        self.bucket_ratio = bucket_ratio
        self.batch = torch.from_numpy(batch)
        self.ptr = torch.from_numpy(ptr)
        self.cu_seqlens = torch.from_numpy(ptr.astype(np.int32))
        self.local_index = torch.from_numpy(local)
        if cls:
            is_cls = local == 0
            self.cls_index: Optional[Tensor] = torch.from_numpy(np.flatnonzero(is_cls))
            self.real_index: Optional[Tensor] = torch.from_numpy(np.flatnonzero(~is_cls))
        else:
            self.cls_index = self.real_index = None
        self._groups: list[DenseGroup] = self._bucketed_groups(ptr, local) if bucket_ratio is not None else []
        self._full_group: Optional[DenseGroup] = None

    def _bucketed_groups(self, ptr: np.ndarray, local: np.ndarray) -> list[DenseGroup]:
        runs = _size_runs(self.sizes, float(self.bucket_ratio))
        if len(runs) <= 1 and all(len(r) == self.num_graphs for r in runs):
            return []  # one block holding every graph: the unbucketed block, in node order
        groups = []
        for run in runs:
            nodes = concat_ranges(ptr[:-1][run], self.sizes[run])
            L = int(self.sizes[run[0]])
            slot = np.repeat(np.arange(run.size, dtype=np.int64), self.sizes[run])
            groups.append((torch.from_numpy(nodes), torch.from_numpy(slot * L + local[nodes]), int(run.size), L))
        return groups

    # ------------------------------------------------------------------ devices
    @property
    def device(self) -> torch.device:
        return self.ptr.device

    _TENSORS = ("batch", "ptr", "cu_seqlens", "local_index", "cls_index", "real_index", "node_mask")

    def tensors(self) -> list[Tensor]:
        """Every index tensor of this layout, in a fixed order: two fixed-capacity layouts of one
        capacity give tensors of the same shapes, position by position (what a captured step copies
        a new batch's layout into, :mod:`pipeline.train.cuda_graphs`)."""
        out = [t for t in (getattr(self, name) for name in self._TENSORS) if t is not None]
        return out + [t for nodes, flat, _G, _L in self._groups for t in (nodes, flat)]

    def _map(self, fn) -> "GraphLayout":
        out = copy.copy(self)
        for name in self._TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, fn(value))
        out._groups = [(fn(nodes), fn(flat), G, L) for nodes, flat, G, L in self._groups]
        out._full_group = None
        return out

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "GraphLayout":
        """This layout with its index tensors on ``device`` (``self`` when they are there already)."""
        device = torch.device(device)
        if self.ptr.device == device:
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def matches(self, num_input_nodes: int, cls: bool, num_graphs: Optional[int] = None) -> bool:
        """Whether this layout describes a batch of ``num_input_nodes`` node rows (and, when given,
        ``num_graphs`` graph slots), with or without [CLS] nodes."""
        return (self.num_input_nodes == num_input_nodes and self.has_cls == cls
                and (num_graphs is None or self.num_graphs == num_graphs))

    # ------------------------------------------------------------------ dense blocks
    def dense_groups(self, bucketed: bool = True) -> list[DenseGroup]:
        """Padded blocks for dense attention, ``(nodes, flat, G, L)`` each: the ids of the block's nodes
        ``[n]``, their position ``graph_slot * L + local_index`` in the block ``[G, L]``, ``G`` and ``L``;
        unbucketed, one block whose slot of graph ``g`` is ``g``."""
        if (bucketed or self.node_mask is not None) and self._groups:
            return self._groups
        if self._full_group is None:
            L = self.max_nodes
            nodes = torch.arange(self.num_nodes, device=self.device)
            self._full_group = (nodes, self.batch * L + self.local_index, self.num_graphs, L)
        return [self._full_group]
