"""Resumable sample streams for drafter training.

A stream is an ``IterableDataset`` whose order depends only on (seed, epoch, rank): resuming a run
means telling it how many samples this rank has already consumed (``start_at``), and it continues
exactly where the interrupted run would have been. One ``__iter__`` call is one epoch (or the rest of
it after a resume), so Lightning's epoch boundaries fall where they would have without the interruption.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from vdtrain.shapes.scene import generate_one


class ResumableStream(IterableDataset):
    """Every ``world``-th sample of a per-epoch ordering, starting from ``rank``."""

    def __init__(
        self, samples_per_epoch: int, seed: int = 0, rank: int = 0, world: int = 1, multiple_of: int = 1
    ) -> None:
        if samples_per_epoch < world * multiple_of:
            raise ValueError(
                f"samples_per_epoch={samples_per_epoch} is less than one batch of {multiple_of} "
                f"on each of {world} processes"
            )
        self.samples_per_epoch = samples_per_epoch
        self.seed, self.rank, self.world = seed, rank, world
        # Whole batches only, the same number on every rank (DDP needs equal step counts).
        self.per_rank_epoch = samples_per_epoch // (world * multiple_of) * multiple_of
        self.consumed = 0  # samples this rank has taken, over all epochs

    def start_at(self, consumed: int) -> None:
        self.consumed = consumed

    def __len__(self) -> int:
        return self.per_rank_epoch

    def __iter__(self) -> Iterator[dict]:
        epoch, offset = divmod(self.consumed, self.per_rank_epoch)
        for k in range(offset, self.per_rank_epoch):
            self.consumed += 1
            yield self.sample(epoch, k * self.world + self.rank)

    def sample(self, epoch: int, index: int) -> dict:
        raise NotImplementedError


class ShapesStream(ResumableStream):
    """Fresh procedural shapes-world pairs: epoch ``e`` holds samples ``e·n .. (e+1)·n - 1`` of the
    training seed stream, so no pair is ever repeated."""

    def sample(self, epoch: int, index: int) -> dict:
        s = generate_one(self.seed, epoch * self.samples_per_epoch + index)
        return {"caption": s.caption, "image": torch.from_numpy(np.ascontiguousarray(s.image))}


def collate(samples: list[dict]) -> dict:
    """Same keys as the samples: tensors and arrays stacked, everything else (captions, meta) as lists."""
    batch: dict = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(values[0], np.ndarray):
            batch[key] = torch.from_numpy(np.stack(values))
        else:
            batch[key] = values
    return batch
