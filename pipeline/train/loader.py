"""Data loading of a worker: shard splits, node-budget batches built on the CPU, device transfer.

A DataLoader worker builds, checks and lays out a whole batch per call (:class:`GraphBatches`,
:class:`BatchCollator`), so the model reads nothing back from the accelerator; it travels as one
pinned buffer (:class:`PackedBatch`) that :func:`to_device` copies without blocking.
"""
from __future__ import annotations

import copy
import io
import math
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from sat.config import SATConfig
from sat.padding import Capacity


def open_split(shard_dir: str | Path, split: str, storage=None):
    """A split of a shard directory (:class:`preprocessing.reader.ShardDataset`; ``storage``: the job's
    :class:`~runtime.storage.StorageSettings`, for shards on a store)."""
    from preprocessing.reader import ShardDataset

    return ShardDataset(shard_dir, split, storage)


class BatchCollator:
    """A ``Batch`` (or a list of ``SATData``) -> the batch, checked and carrying its ``graph_layout``
    for a model of ``config``, padded to ``capacity`` when given and when it fits (``node_targets``:
    node tasks); see the module docstring."""

    def __init__(self, config: SATConfig, capacity: Optional[Capacity] = None, node_targets: bool = False) -> None:
        self.config = config
        self.capacity = capacity
        self.node_targets = node_targets

    def __call__(self, batch: Any) -> Any:
        from torch_geometric.data import Batch

        from sat.layout import GraphLayout
        from sat.padding import fits, pad_batch
        from sat.validation import validate_batch

        if not isinstance(batch, Batch):
            batch = Batch.from_data_list(batch)
        validate_batch(self.config, batch)
        cls_token = self.config.readout == "cls"
        if self.capacity is not None and fits(batch, self.capacity):
            return pad_batch(batch, self.capacity, self.node_targets, cls_token)
        batch.graph_layout = GraphLayout.from_sizes(torch.diff(batch.ptr), cls_token=cls_token)
        return batch


class GraphBatches(torch.utils.data.Dataset):
    """``dataset`` indexed by whole batches: ``GraphBatches(ds, collator)[ids]`` is the finished batch of
    the graphs ``ids`` (:meth:`~preprocessing.reader.ShardDataset.batch`, or the list of those graphs
    for a dataset without that method, then ``collator``): a DataLoader worker builds a batch in one call."""

    def __init__(self, dataset, collator: BatchCollator) -> None:
        self.dataset = dataset
        self.collator = collator

    def __getitem__(self, ids) -> Any:
        batch_of = getattr(self.dataset, "batch", None)
        return self.collator(batch_of(ids) if batch_of else [self.dataset[int(i)] for i in ids])


_ALIGN = 64  # bytes: every tensor of a packed batch starts at a multiple (any dtype may view it)


class _TensorsOut(pickle.Pickler):
    """Pickles an object with its tensors left out, by reference to ``tensors`` (in order)."""

    def __init__(self, file, tensors: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Optional[int]:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _TensorsIn(pickle.Unpickler):
    """Unpickles what :class:`_TensorsOut` wrote, the references resolved to ``tensors``."""

    def __init__(self, file, tensors: list) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: int) -> torch.Tensor:
        return self.tensors[pid]


class PackedBatch:
    """A finished batch in transit from a DataLoader worker process: the bytes of all its tensors in
    one buffer (each at a multiple of 64 bytes), everything else pickled. Sent as it is, each of a
    batch's ~40 tensors would be a shared-memory segment of its own; packed, it is one, pinned as one
    buffer, and :meth:`unpack` rebuilds the batch from views of it. The loader's ``collate_fn``."""

    def __init__(self, batch: Any) -> None:
        tensors: list[torch.Tensor] = []
        stream = io.BytesIO()
        _TensorsOut(stream, tensors).dump(batch)
        self.structure = stream.getvalue()
        self.spans: list[tuple[int, torch.dtype, tuple[int, ...]]] = []
        size = 0
        for t in tensors:
            self.spans.append((size, t.dtype, tuple(t.shape)))
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.buffer = _buffer(size)
        for t, span in zip(tensors, self.spans):
            self._view(*span).copy_(t)

    def _view(self, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.buffer[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def pin_memory(self) -> "PackedBatch":
        """This batch with its buffer page-locked (the DataLoader's pin-memory thread calls it)."""
        pinned = copy.copy(self)
        pinned.buffer = self.buffer.pin_memory()
        return pinned

    def unpack(self) -> Any:
        """The batch, its tensors views of the buffer."""
        views = [self._view(*span) for span in self.spans]
        return _TensorsIn(io.BytesIO(self.structure), views).load()


def _buffer(nbytes: int) -> torch.Tensor:
    """A byte buffer; in a DataLoader worker process in shared memory, where sending it copies nothing."""
    if nbytes == 0 or torch.utils.data.get_worker_info() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


class BatchLoader:
    """The finished batches of a DataLoader that yields them packed (:class:`PackedBatch`), unpacked."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return (packed.unpack() for packed in self.loader)


def make_loader(dataset, sampler, collator: BatchCollator, workers: int, pin_memory: bool) -> BatchLoader:
    """The finished batches of ``dataset`` whose ids ``sampler`` yields (an array per batch, e.g.
    :class:`pipeline.train.batching.NodeBudgetSampler`), built by ``workers`` processes that persist
    across epochs (none: in this process)."""
    from torch.utils.data import DataLoader

    return BatchLoader(DataLoader(
        GraphBatches(dataset, collator),
        sampler=sampler,
        batch_size=None,
        collate_fn=PackedBatch,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers > 0 else None,
    ))


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch``'s tensors (and layout) on ``device``, copied without blocking (in place: read what
    is needed from the CPU batch first); host lists (``y_tokens``) stay. A no-op on the CPU."""
    if device.type == "cpu":
        return batch
    keys = [key for key, value in batch if not isinstance(value, list)]
    return batch.to(device, *keys, non_blocking=True)
