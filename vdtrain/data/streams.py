"""Resumable batch streams for drafter training.

A stream is an ``IterableDataset`` of whole batches whose order depends only on (epoch, rank). Rank ``r``
of ``w`` owns every ``w``-th position of an epoch's ordering; its share is cut into batches of
``batch_size`` consecutive positions, and batch ``j`` is made by DataLoader worker ``j mod workers``
(counted from the first batch of the iteration). The DataLoader hands batches on round-robin over its
workers, so the batches arrive in the same order for any number of workers, and each sample is made once.

The stream keeps no position of its own while iterating (workers hold copies of it): before each
``iter()`` its owner says how many positions this rank has consumed (``start_at``), and the iteration
runs from there to the end of that epoch. Lightning's epoch boundaries therefore fall where they would
have without an interruption, and a resumed run sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from vdtrain.shapes.scene import generate_one


class ResumableStream(IterableDataset):
    """Batches of every ``world``-th position of a per-epoch ordering, starting from ``rank``."""

    def __init__(self, samples_per_epoch: int, rank: int = 0, world: int = 1, batch_size: int = 1) -> None:
        if samples_per_epoch < world * batch_size:
            raise ValueError(
                f"samples_per_epoch={samples_per_epoch} is less than one batch of {batch_size} "
                f"on each of {world} processes"
            )
        self.samples_per_epoch = samples_per_epoch
        self.rank, self.world, self.batch_size = rank, world, batch_size
        # Whole batches only, the same number on every rank (DDP needs equal step counts).
        self.batches_per_epoch = samples_per_epoch // (world * batch_size)
        self.per_rank_epoch = self.batches_per_epoch * batch_size
        self.consumed = 0  # positions this rank has consumed, over all epochs

    def start_at(self, consumed: int) -> None:
        if consumed < 0 or consumed % self.batch_size:
            raise ValueError(
                f"a stream restarts at a whole batch of {self.batch_size}, got position {consumed}"
            )
        self.consumed = consumed

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_and_batches(self) -> tuple[int, range]:
        """(the epoch ``start_at`` points into, the batch indices this worker makes of its rest)."""
        epoch, offset = divmod(self.consumed, self.per_rank_epoch)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return epoch, range(offset // self.batch_size + worker, self.batches_per_epoch, workers)

    def batch_indices(self, batch: int) -> list[int]:
        """Indices into the epoch's ordering of the samples of this rank's batch ``batch``."""
        start = batch * self.batch_size
        return [k * self.world + self.rank for k in range(start, start + self.batch_size)]

    def __iter__(self) -> Iterator[dict]:
        epoch, batches = self.epoch_and_batches()
        for j in batches:
            yield collate([self.sample(epoch, i) for i in self.batch_indices(j)])

    def sample(self, epoch: int, index: int) -> dict:
        raise NotImplementedError


class ShapesStream(ResumableStream):
    """Fresh procedural shapes-world pairs: epoch ``e`` holds samples ``e·n .. (e+1)·n - 1`` of the
    training seed stream, so no pair is ever repeated."""

    def __init__(
        self,
        samples_per_epoch: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        batch_size: int = 1,
        scene_world: str = "shapes",
    ) -> None:
        super().__init__(samples_per_epoch, rank, world, batch_size)
        self.seed = seed
        self.scene_world = scene_world  # the embedded world rendered (``world`` is the process count)

    def sample(self, epoch: int, index: int) -> dict:
        s = generate_one(self.seed, epoch * self.samples_per_epoch + index, self.scene_world)
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
