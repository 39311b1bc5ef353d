"""The global batch: optimizer steps that are the same at any worker count.

A step is ``train.micro_batches_per_step`` (k) micro-batches taken in order from one sequence per
epoch; micro-batch ``j`` goes to rank ``j % W``, its loss scaled so that DeepSpeed's average over the
ranks is the mean loss over the step's units at every W (:meth:`GlobalBatches.scales`). A run resumed
at another worker count takes the same next global batch (:class:`Position`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from pipeline.train.batching import NodeBudgetSampler

CACHED_EPOCHS = 3  # the loader's sampler may run an epoch ahead of the step that reads the scales


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run is in its sequence: ``step`` steps of ``epoch`` done."""

    epoch: int
    step: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}


def share(micro_batches: int, rank: int, world: int) -> range:
    """The indices (within a step) of the micro-batches rank ``rank`` of ``world`` accumulates."""
    return range(rank, micro_batches, world)


class GlobalBatches:
    """The steps of a run over a shuffled training sampler (see the module docstring). ``per_node``:
    the loss averages over nodes (node tasks), not graphs."""

    def __init__(self, sampler: NodeBudgetSampler, micro_batches_per_step: int, per_node: bool = False) -> None:
        self.sampler = sampler
        self.micro_batches = int(micro_batches_per_step)
        self.per_node = per_node
        self._epochs: dict[int, list[np.ndarray]] = {}
        self.steps_per_epoch = max(1, len(sampler.global_batches(0)) // self.micro_batches)

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The ``steps_per_epoch x k`` micro-batches of ``epoch``, in step order."""
        if epoch not in self._epochs:
            batches = self.sampler.global_batches(epoch)
            need = self.steps_per_epoch * self.micro_batches
            if len(batches) < need:  # repeat a few (random, since shuffled) micro-batches
                batches = (batches * -(-need // len(batches)))
            self._epochs[epoch] = batches[:need]
            while len(self._epochs) > CACHED_EPOCHS:
                del self._epochs[min(self._epochs)]
        return self._epochs[epoch]

    def step(self, epoch: int, step: int) -> list[np.ndarray]:
        """The k micro-batches (graph ids) of step ``step`` of ``epoch``: the global batch."""
        k = self.micro_batches
        return self.epoch(epoch)[step * k : (step + 1) * k]

    def units(self, ids: np.ndarray) -> int:
        """What a micro-batch's loss averages over: its graphs, or its nodes (``per_node``)."""
        return int(self.sampler.sizes[ids].sum()) if self.per_node else len(ids)

    def scales(self, epoch: int, step: int, rank: int, world: int) -> list[float]:
        """The loss scales of rank ``rank``'s micro-batches of a step, in the order it takes them
        (see the module docstring): ``world x units_j / units of the step``."""
        units = [self.units(ids) for ids in self.step(epoch, step)]
        total = max(sum(units), 1)
        return [world * units[j] / total for j in share(self.micro_batches, rank, world)]


class RankStream:
    """Rank ``rank``'s micro-batches of ``batches`` from :attr:`start` on, without end: the sampler of
    the run's training DataLoader, iterated once for the whole run (so its workers prepare the next
    epoch while one is evaluated). A rank with no share never reads one."""

    def __init__(self, batches: GlobalBatches, rank: int, world: int, start: Position = Position(0)) -> None:
        self.batches, self.rank, self.world, self.start = batches, rank, world, start
        self.mine = share(batches.micro_batches, rank, world)

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self.mine:
            raise ValueError(f"rank {self.rank} of {self.world} takes none of a step's "
                             f"{self.batches.micro_batches} micro-batches")
        epoch, step = self.start.epoch, self.start.step
        while True:
            for s in range(step, self.batches.steps_per_epoch):
                micro = self.batches.step(epoch, s)
                for j in self.mine:
                    yield micro[j]
            epoch, step = epoch + 1, 0
