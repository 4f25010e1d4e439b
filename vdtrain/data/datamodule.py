"""The DataModule: picks the batch stream, splits it over ranks and workers, and keeps the data position.

The position is the number of samples this rank has consumed (batches the fit loop processed × batch
size). It is saved in every Lightning checkpoint (``state_dict``) and handed to the stream at every
``iter()`` of the training loader, so each epoch, on any number of workers, starts where the last ended
and a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import lightning as L
from torch.utils.data import DataLoader

from vdtrain.config import DataConfig
from vdtrain.data.streams import ResumableStream, ShapesStream, collate
from vdtrain.shapes.scene import HELDOUT_SEED, TRAIN_SEED, generate
from vdtrain.targets.base import TargetIdentity


def _ignore_ctrl_c(worker_id: int) -> None:
    """A terminal's Ctrl-C reaches every process of its group: the workers leave it to the main process,
    which stops training at a step boundary and then stops them (``vdtrain.train.checkpointing.CtrlC``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class PositionedLoader(DataLoader):
    """A loader of a stream's whole batches that sets the stream's start before each iteration: workers
    copy the stream when iteration starts, so this is the one place the position can reach them."""

    def __init__(self, stream: ResumableStream, position: Callable[[], int], num_workers: int) -> None:
        super().__init__(stream, batch_size=None, num_workers=num_workers, worker_init_fn=_ignore_ctrl_c)
        self.position = position

    def __iter__(self) -> Iterator:
        self.dataset.start_at(self.position())
        return super().__iter__()


class DrafterDataModule(L.LightningDataModule):
    def __init__(
        self,
        config: DataConfig,
        target_identity: TargetIdentity | None = None,
        world: str | None = None,
        taps: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if config.source not in ("shapes", "shards"):
            raise ValueError(f"data.source must be 'shapes' or 'shards', got {config.source!r}")
        if config.source == "shapes" and config.features == "offline":
            raise ValueError("data.features=offline needs source=shards with feats.npy (data_prep.features)")
        self.config = config
        self.target_identity = target_identity  # shard sets are checked against it
        self.world = world or "shapes"  # source=shapes renders the target's embedded world
        self.taps = taps  # offline shards must store the layers the drafter reads
        self.train_stream: ResumableStream | None = None
        self._resume_consumed = 0

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def setup(self, stage: str | None = None) -> None:
        if self.train_stream is not None:
            return
        rank, world = self._rank_world()
        c = self.config
        if c.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {c.num_workers}")
        if c.source == "shapes":
            self.train_stream = ShapesStream(
                c.samples_per_epoch, TRAIN_SEED, rank, world, c.batch_size, self.world
            )
        else:
            from vdtrain.data.shard_stream import ShardStream

            self.train_stream = ShardStream(c, rank, world, self.target_identity, self.taps)

    def train_dataloader(self) -> DataLoader:
        return PositionedLoader(self.train_stream, self.consumed, self.config.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        c = self.config
        if c.val_samples == 0:
            return []
        if c.source == "shapes":
            samples = [
                {"caption": s.caption, "image": s.image}
                for s in generate(c.val_samples, HELDOUT_SEED, world=self.world)
            ]
        elif c.val_shards:
            from vdtrain.data.shard_stream import read_all

            samples = read_all(c.val_shards, c.on_corrupt)[: c.val_samples]
        else:
            return []
        # Not split here: under DDP Lightning gives this map-style loader a DistributedSampler, which
        # splits it over the ranks in equal parts (each rank must run as many steps as the others).
        return DataLoader(samples, batch_size=c.batch_size, collate_fn=collate)

    def consumed(self) -> int:
        """Positions this rank has consumed: the batches the fit loop has processed, times the batch size
        (a sample skipped as corrupt consumes its position too).

        ``processed``, not ``completed``: step checkpoints are saved in ``on_train_batch_end``, before the
        loop marks that batch completed, and Lightning counts it as done when it resumes from them."""
        trainer = self.trainer
        if trainer is None:
            return self._resume_consumed
        done = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        return done * self.config.batch_size

    def state_dict(self) -> dict:
        return {"consumed": self.consumed()}

    def load_state_dict(self, state: dict) -> None:
        self._resume_consumed = int(state["consumed"])
