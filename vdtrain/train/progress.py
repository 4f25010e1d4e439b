"""Progress a person can read wherever the output goes: a plain log line every N steps and at every
validation (a SLURM log or a redirected file gets no progress bar), and, on a terminal, a bar that counts
optimizer steps out of ``max_steps`` (the training stream has no epochs of known length)."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer, TQDMProgressBar

log = logging.getLogger("vdtrain.fit")


def duration(seconds: float) -> str:
    """``1h02m``, ``5m12s``, ``40s``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ProgressLog(L.Callback):
    """``step 120/400 | loss 0.512 | top-1 0.731 | 14.3 samples/s | ETA 5m12s`` every ``every`` optimizer
    steps (rank 0), and the validation metrics after each validation."""

    def __init__(self, every: int, samples_per_step: int) -> None:
        if every < 1:
            raise ValueError(f"trainer.progress_every_n_steps must be >= 1, got {every}")
        self.every, self.samples_per_step = every, samples_per_step
        self._mark: tuple[float, int] | None = None  # (time, step) of the last line
        self._start: tuple[float, int] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = self._mark = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or self._mark is None or step == self._mark[1] or step % self.every:
            return
        now = time.monotonic()
        rate = (step - self._mark[1]) * self.samples_per_step * trainer.world_size / (now - self._mark[0])
        self._mark = (now, step)
        log.info("%s", self.line(trainer, step, rate, now))

    def line(self, trainer: L.Trainer, step: int, rate: float, now: float) -> str:
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}" if trainer.max_steps > 0 else f"step {step}"]
        for name, label in (("train/total", "loss"), ("train/top1", "top-1")):
            if name in metrics:
                parts.append(f"{label} {float(metrics[name]):.4g}")
        parts.append(f"{rate:.1f} samples/s")
        eta = self.eta(trainer, step, now)
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        return " | ".join(parts)

    def eta(self, trainer: L.Trainer, step: int, now: float) -> float | None:
        """Seconds left at the run's mean pace: to ``max_steps`` or ``max_time``, whichever is sooner."""
        started, first = self._start
        if step <= first:
            return None
        left = []
        if trainer.max_steps > 0:
            left.append((trainer.max_steps - step) * (now - started) / (step - first))
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)  # set by max_time
        if timer is not None and timer.time_remaining() is not None:
            left.append(timer.time_remaining())
        return min(left) if left else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        shown = [f"{k} {float(v):.4g}" for k, v in sorted(metrics.items()) if k.startswith("val/")]
        shown = [s for s in shown if "depth" not in s]  # per-depth top-1 stays in the logger
        step = f"{trainer.global_step}/{trainer.max_steps}" if trainer.max_steps > 0 else trainer.global_step
        log.info("validation at step %s: %s", step, ", ".join(shown))


class StepProgressBar(TQDMProgressBar):
    """The terminal bar in optimizer steps out of ``max_steps`` (not "Epoch 3/-2")."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        bar.total = trainer.max_steps if trainer.max_steps > 0 else None
        bar.n = bar.initial = trainer.global_step
        bar.set_description("step")
        bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()
