"""Data loading of a worker: shard splits, node-budget batches collated on the CPU, device transfer.

Everything the model would otherwise compute from a batch on the accelerator, with values read
back to the host, is computed here, in the DataLoader's worker processes, from what the CPU
already knows (:class:`BatchCollator`):

* PyG collation (:meth:`torch_geometric.data.Batch.from_data_list`);
* the value checks of :func:`sat.validation.validate_batch` (the step then runs the model with
  ``validate=False``);
* the :class:`sat.layout.GraphLayout` (graph offsets, ``cu_seqlens``, largest graph, dense
  blocks, [CLS] positions) from the graphs' node counts, attached as ``batch.graph_layout``.

With ``pin_memory`` the loader page-locks each batch (its layout included) and
:func:`to_device` copies it with ``non_blocking=True``, so the copy overlaps the previous step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from sat.config import SATConfig


def open_split(shard_dir: str | Path, split: str):
    """A split of a shard directory (:class:`preprocessing.reader.ShardDataset`)."""
    from preprocessing.reader import ShardDataset

    return ShardDataset(shard_dir, split)


class BatchCollator:
    """``collate_fn`` of the worker's DataLoaders: a list of ``SATData`` -> a checked ``Batch``
    carrying its ``graph_layout`` for a model of ``config`` (see the module docstring).

    Picklable (DataLoader worker processes receive a copy).
    """

    def __init__(self, config: SATConfig, validate: bool = True, bucket_ratio: Optional[float] = 1.5) -> None:
        self.config = config
        self.validate = validate
        self.bucket_ratio = bucket_ratio

    def __call__(self, items: list) -> Any:
        from torch_geometric.data import Batch

        from sat.layout import GraphLayout
        from sat.validation import validate_batch

        batch = Batch.from_data_list(items)
        if self.validate:
            validate_batch(self.config, batch)
        batch.graph_layout = GraphLayout.from_sizes(
            [item.num_nodes for item in items], self.bucket_ratio, cls_token=self.config.readout == "cls"
        )
        return batch


def make_loader(dataset, batch_sampler, collator: BatchCollator, workers: int, pin_memory: bool):
    """A DataLoader over ``dataset`` with ``batch_sampler`` (its workers persist across epochs)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collator,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers > 0 else None,
    )


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch``'s tensors (and layout) on ``device``, copied without blocking; a no-op on the CPU.

    PyG moves a batch in place: read what is needed from the CPU batch first. Host lists
    (``y_tokens``) are left alone rather than walked item by item.
    """
    if device.type == "cpu":
        return batch
    keys = [key for key, value in batch if not isinstance(value, list)]
    return batch.to(device, *keys, non_blocking=True)
