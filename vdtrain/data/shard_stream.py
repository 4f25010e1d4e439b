"""Training streams over webdataset shard sets (``data.source=shards``).

Epoch ``e`` visits the shards in an order shuffled by ``e`` and passes their samples through a
seeded shuffle buffer; rank ``r`` of ``w`` takes every ``w``-th sample. The order is therefore a pure
function of the epoch, and resuming skips the samples this rank already consumed in the epoch (they
are read again, not trained on). A sample skipped as corrupt (``on_corrupt=skip``) shortens the epoch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from vdtrain.config import DataConfig
from vdtrain.data.shards import ShardReader
from vdtrain.data.streams import ResumableStream
from vdtrain.targets.base import TargetIdentity

FIELDS = ("tokens", "caption", "cond_mask", "feats")  # what training reads; the rest stays on disk


def _training_fields(sample: dict) -> dict:
    return {k: sample[k] for k in FIELDS if k in sample}


class ShardStream(ResumableStream):
    def __init__(
        self, config: DataConfig, rank: int, world: int, target_identity: TargetIdentity | None = None
    ) -> None:
        if not config.shards:
            raise ValueError("data.source=shards needs data.shards (a folder with manifest.json)")
        self.reader = ShardReader(
            config.shards, on_corrupt=config.on_corrupt, target_identity=target_identity
        )
        if config.features == "offline" and "feats" not in self.reader.manifest.get("fields", []):
            raise ValueError(
                f"data.features=offline but {config.shards} has no feats.npy: "
                "run `python -m data_prep.features`"
            )
        super().__init__(len(self.reader), seed=0, rank=rank, world=world, multiple_of=config.batch_size)
        self.buffer_size = max(1, config.shuffle_buffer)

    def _epoch_order(self, epoch: int) -> Iterator[dict]:
        rng = random.Random(epoch)
        shards = list(self.reader.shards)
        rng.shuffle(shards)
        buffer: list[dict] = []
        for name in shards:
            for sample in self.reader.iter_shard(name):
                buffer.append(sample)
                if len(buffer) >= self.buffer_size:
                    yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[dict]:
        epoch, offset = divmod(self.consumed, self.per_rank_epoch)
        mine = 0
        for i, sample in enumerate(self._epoch_order(epoch)):
            if i % self.world != self.rank:
                continue
            if mine >= self.per_rank_epoch:
                break
            mine += 1
            if mine <= offset:
                continue
            self.consumed += 1
            yield _training_fields(sample)


def read_all(folder: str, on_corrupt: str = "error") -> list[dict]:
    """Every sample of a (small, held-out) shard set, for validation."""
    return [_training_fields(s) for s in ShardReader(folder, on_corrupt=on_corrupt)]
