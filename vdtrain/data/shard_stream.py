"""Training batches from shard sets (``data.source=shards``).

The ordering of epoch ``e`` is over the sample *positions* the manifest lists: the shards in an order
shuffled by ``e``, their positions passed through a seeded shuffle buffer. It is computed from the
manifest alone, so every rank and DataLoader worker knows it without reading a byte, and it does not
change when a sample turns out to be unreadable. Each process visits the shards in that order and reads
only the samples of its own batches (``ResumableStream`` splits ranks and workers; the manifest's index
says where they lie).

A sample skipped as corrupt (``data.on_corrupt=skip``) still consumes its position: its batch is one
sample smaller, and every epoch has the same number of batches on every rank, so the data position
(batches × batch size) stays exact and DDP ranks stay in step. A batch whose samples are all
unreadable repeats the worker's previous batch (or its next one, at the start), with a warning.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from vdtrain.config import DataConfig
from vdtrain.data.shards import SampleSpec, ShardError, ShardReader, feature_taps
from vdtrain.data.streams import ResumableStream, collate
from vdtrain.targets.base import TargetIdentity

log = logging.getLogger(__name__)

FIELDS = ("tokens", "caption", "feats", "feats_mask")  # what training reads; the rest stays on disk


def _training_fields(sample: dict, feats_dtype: str) -> dict:
    """What training reads of a sample; bf16 ``feats`` (stored as their bits) as a bfloat16 tensor."""
    fields = {k: sample[k] for k in FIELDS if k in sample}
    if feats_dtype == "bfloat16" and "feats" in fields:
        fields["feats"] = torch.from_numpy(fields["feats"]).view(torch.bfloat16)
    return fields


def epoch_order(counts: Sequence[int], epoch: int, buffer_size: int) -> tuple[list[int], list[int]]:
    """(shard visiting order, the epoch's ordering of global positions) for shards of ``counts`` samples.

    Global position ``offset(shard) + i`` is sample ``i`` of that shard (manifest order). The buffer
    emits a random held position once it holds ``buffer_size``; the rest are shuffled at the end."""
    rng = random.Random(epoch)
    shards = list(range(len(counts)))
    rng.shuffle(shards)
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    buffer: list[int] = []
    order: list[int] = []
    for s in shards:
        for i in range(counts[s]):
            buffer.append(offsets[s] + i)
            if len(buffer) >= buffer_size:
                k = rng.randrange(len(buffer))
                buffer[k], buffer[-1] = buffer[-1], buffer[k]
                order.append(buffer.pop())
    rng.shuffle(buffer)
    return shards, order + buffer


class ShardStream(ResumableStream):
    def __init__(
        self,
        config: DataConfig,
        rank: int,
        world: int,
        target_identity: TargetIdentity | None = None,
        taps: tuple[int, ...] = (),
    ) -> None:
        if not config.shards:
            raise ValueError("data.source=shards needs data.shards (a folder with manifest.json)")
        self.reader = ShardReader(
            config.shards, on_corrupt=config.on_corrupt, target_identity=target_identity
        )
        fields = self.reader.manifest.get("fields", [])
        if config.features == "offline" and "feats" not in fields:
            raise ValueError(
                f"data.features=offline but {config.shards} has no feats.npy: "
                "run `python -m data_prep.features`"
            )
        if config.features == "offline" and "feats_mask" not in fields:
            raise ValueError(
                f"data.features=offline but {config.shards} stores no feats_mask.npy (the condition mask of "
                "its features; sets written before it was kept lack it): run `python -m data_prep.features` "
                "again into a new folder"
            )
        stored = feature_taps(self.reader.manifest)
        if config.features == "offline" and stored != list(taps):
            raise ValueError(
                f"data.features=offline: {config.shards} stores target layers {stored} but the drafter reads "
                f"{list(taps)}: run `python -m data_prep.features feature_layers={list(taps)}`"
            )
        self.feats_dtype = SampleSpec.from_manifest(self.reader.manifest).dtypes["feats"]
        super().__init__(len(self.reader), rank=rank, world=world, batch_size=config.batch_size)
        self.buffer_size = max(1, config.shuffle_buffer)
        recorded = {s["name"]: s["samples"] for s in self.reader.manifest["shards"]}
        self.counts = [recorded[name] for name in self.reader.shards]
        self.offsets = [0]
        for n in self.counts:
            self.offsets.append(self.offsets[-1] + n)

    def _shard_of(self, position: int) -> int:
        return bisect.bisect_right(self.offsets, position) - 1

    def __iter__(self) -> Iterator[dict]:
        epoch, batches = self.epoch_and_batches()
        shards, order = epoch_order(self.counts, epoch, self.buffer_size)
        visit = {s: k for k, s in enumerate(shards)}  # shard -> when it is read
        pending: deque[tuple[int, list[int], int]] = deque()  # (batch, positions, shard read last)
        wanted: dict[int, set[int]] = {}  # shard -> positions in it this process decodes
        for j in batches:
            positions = [order[i] for i in self.batch_indices(j)]
            last = 0
            for g in positions:
                s = self._shard_of(g)
                wanted.setdefault(s, set()).add(g - self.offsets[s])
                last = max(last, visit[s])
            pending.append((j, positions, last))
        samples: dict[int, dict] = {}
        filler = _Filler(epoch, self.rank)
        for done, s in enumerate(shards):
            if s in wanted:
                name = self.reader.shards[s]
                for i, sample in self.reader.iter_slots(name, wanted[s]):
                    if sample is not None:
                        samples[self.offsets[s] + i] = _training_fields(sample, self.feats_dtype)
            while pending and pending[0][2] <= done:
                j, positions, _ = pending.popleft()
                found = [samples.pop(g) for g in positions if g in samples]
                yield from filler.batches(j, collate(found) if found else None)
        filler.finish()


class _Filler:
    """Stands in for a batch whose samples were all unreadable, so the batch count stays exact."""

    def __init__(self, epoch: int, rank: int) -> None:
        self.epoch, self.rank = epoch, rank
        self.previous: dict | None = None
        self.owed: list[int] = []  # empty batches seen before any readable one

    def batches(self, index: int, batch: dict | None) -> Iterator[dict]:
        if batch is None:
            log.warning(
                "epoch %d, rank %d, batch %d: every sample was unreadable (data.on_corrupt=skip); "
                "training on a neighbouring batch in its place",
                self.epoch,
                self.rank,
                index,
            )
            if self.previous is None:
                self.owed.append(index)
                return
            batch = self.previous
        for _ in self.owed:
            yield batch
        self.owed.clear()
        self.previous = batch
        yield batch

    def finish(self) -> None:
        if self.owed:
            raise ShardError(
                f"epoch {self.epoch}, rank {self.rank}: every sample of batches {self.owed} was unreadable "
                "and no readable batch was left to stand in; check the set: `python -m data_prep.validate`"
            )


def read_all(folder: str, on_corrupt: str = "error") -> list[dict]:
    """Every sample of a (small, held-out) shard set, for validation."""
    reader = ShardReader(folder, on_corrupt=on_corrupt)
    feats_dtype = SampleSpec.from_manifest(reader.manifest).dtypes["feats"]
    return [_training_fields(s, feats_dtype) for s in reader]
