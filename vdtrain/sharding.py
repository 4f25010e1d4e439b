"""Decoding on every GPU: one process per GPU, prompts split by index, finished work kept on disk.

``vdtrain.evaluate``, ``vdtrain.generate``, ``data_prep.self_generate``, ``data_prep.features`` and the
after-epoch callback share this module. They run under ``torchrun`` / ``launch.sh`` / SLURM with the
variables training uses (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, or
SLURM's), over torch.distributed: gloo on the CPU, NCCL on GPUs.

The work is cut into units that do not depend on the world size (a batch of prompts, a shard of
samples); each rank takes a balanced contiguous run of them (``Ranks.take``). Outputs are assembled in
unit order, so sums over units are the same floats whatever the world size, and a run restarted with
another world size reuses every finished unit. A finished unit is a file written under a temporary name
and renamed into place (``write_atomic``): a file under its final name is complete, a half-written one
is a ``.tmp`` that the next run overwrites.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

# Rank variables as torchrun sets them, then as srun does (launch.sh under SLURM starts tasks with srun).
ENV_NAMES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


@dataclass(frozen=True)
class Ranks:
    """This process's place among the decoding processes."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def take(self, units: Sequence[T]) -> list[T]:
        """This rank's balanced contiguous part of ``units``: sizes differ by at most one, rank order is
        unit order, and the split depends on nothing but the count and the world size."""
        n = len(units)
        return list(units[self.rank * n // self.world : (self.rank + 1) * n // self.world])

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"


def ranks_from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """The ranks a launcher set (torchrun's variables, else srun's); one process when none did."""
    env = os.environ if env is None else env
    for rank, world, local in ENV_NAMES:
        if world in env:
            return Ranks(int(env.get(rank, "0")), int(env[world]), int(env.get(local, "0")))
    return Ranks()


def current_ranks() -> Ranks:
    """The ranks of a process group already started (Lightning's DDP / DeepSpeed), else one process."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Ranks()


@contextmanager
def decoding_processes(device: str = "auto", timeout_minutes: float = 120) -> Iterator[Ranks]:
    """Join the launch's process group for the duration (nothing to join for one process).

    Each rank takes GPU ``LOCAL_RANK`` (``device`` auto or cuda then means that one) and NCCL; on the
    CPU, gloo. The long timeout lets a rank that finished its units wait at the final gather while the
    slowest rank decodes."""
    ranks = ranks_from_env()
    if ranks.world == 1 or dist.is_initialized():
        yield ranks
        return
    if device.startswith("cuda") and device not in ("cuda", f"cuda:{ranks.local_rank}"):
        raise ValueError(f"device={device!r} with {ranks.world} processes: use device=auto or cuda")
    gpu = device != "cpu" and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(ranks.local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        rank=ranks.rank,
        world_size=ranks.world,
        timeout=timedelta(minutes=timeout_minutes),
    )
    log.info("decoding as %s (%s)", ranks.describe(), dist.get_backend())
    try:
        yield ranks
    finally:
        dist.destroy_process_group()


def units_of(n: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``size`` (the last one shorter): the units of ``n`` items."""
    if size < 1:
        raise ValueError(f"unit size must be >= 1, got {size}")
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` at ``path`` all or nothing: written to ``<path>.tmp``, flushed, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class UnitStore:
    """Finished units of one run, one file each under ``folder``: ``load`` gives a finished unit's record
    or None (never there, or unreadable: redone), ``save`` writes one atomically."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.pt"

    def load(self, key: str) -> Any | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:  # a file damaged after it was written: redo the unit
            log.warning("%s is unreadable (%s); redoing that unit", path, error)
            return None

    def check_settings(self, settings: Mapping[str, Any], ranks: Ranks) -> None:
        """Refuse a folder whose units were made with other ``settings`` (JSON-able: what decides the
        outputs); a new folder records them. Rank 0 reads, every rank raises the same error."""
        problem = None
        if ranks.is_main:
            path = self.folder / "settings.json"
            text = json.dumps(settings, sort_keys=True, indent=1) + "\n"
            if not path.is_file():
                write_atomic(path, text.encode())
            elif path.read_text() != text:
                old = json.loads(path.read_text())
                changed = sorted(k for k in {*old, *settings} if old.get(k) != settings.get(k))
                problem = (
                    f"{self.folder} holds units made with other settings (changed: {', '.join(changed)}); "
                    f"use a new out_dir, or delete {self.folder} to start again"
                )
        problem = ranks.broadcast(problem)
        if problem:
            raise ValueError(problem)

    def save(self, key: str, record: Any) -> None:
        buffer = io.BytesIO()
        torch.save(record, buffer)
        write_atomic(self.path(key), buffer.getvalue())
