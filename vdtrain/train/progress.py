"""Progress a person can read wherever the output goes: a plain log line every N steps and at every
validation (a SLURM log or a redirected file gets no progress bar), and, on a terminal, a bar that counts
optimizer steps out of ``max_steps`` (the training stream has no epochs of known length)."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer, TQDMProgressBar

from vdtrain.durations import duration

log = logging.getLogger("vdtrain.fit")


LINES_PER_RUN = 10
DEFAULT_EVERY = 25
# a line at least once a minute while training or validating, whatever the step count: checked after each
# step or batch, so the limit leaves a loaded machine's step room (at 60, gaps of 61-67 s: issue 58)
MAX_SILENCE_S = 45.0


def progress_interval(every: int | None, max_steps: int) -> int:
    """``trainer.progress_every_n_steps``, or for null one that gives at least ``LINES_PER_RUN`` lines
    (never sparser than every ``DEFAULT_EVERY`` steps). Its range is checked with the other settings'
    (``vdtrain.preflight.FIT_MINIMUMS``)."""
    if every is not None:
        return every
    return max(1, min(DEFAULT_EVERY, max_steps // LINES_PER_RUN))


class ProgressLog(L.Callback):
    """``step 120/400 | loss 0.512 | top-1 0.731 | 14.3 samples/s | ETA 5m12s`` every ``every`` optimizer
    steps (rank 0), and the validation metrics after each validation; a slow step or validation gets a
    line at least every ``MAX_SILENCE_S`` (a loaded CPU can take minutes for ``every`` steps).

    Pace and ETA count training time only: validation and the after-epoch evaluation (which runs
    between ``on_train_epoch_end`` and the next epoch's start) are left out, and the line says how long
    they took so far."""

    def __init__(self, every: int, samples_per_step: int) -> None:
        self.every, self.samples_per_step = every, samples_per_step
        self._mark: tuple[float, int] | None = None  # (training seconds, step) at the last line
        self._start: tuple[float, int] | None = None
        self._started_at = 0.0
        self._paused = 0.0  # seconds spent outside training (validation, evaluation)
        self._pause_from: float | None = None
        self._last_line = time.monotonic()
        self._validating_since = 0.0

    @property
    def first_step(self) -> int:
        """The step this launch's training began at (a resumed run's checkpoint step; 0 before training)."""
        return self._start[1] if self._start is not None else 0

    def training_seconds(self, now: float) -> float:
        pausing = now - self._pause_from if self._pause_from is not None else 0.0
        return now - self._started_at - self._paused - pausing

    def _log(self, message: str, *args: Any) -> None:
        log.info(message, *args)
        self._last_line = time.monotonic()

    def _quiet_too_long(self) -> bool:
        return time.monotonic() - self._last_line >= MAX_SILENCE_S

    def _pause(self, *_: Any) -> None:
        if self._pause_from is None:
            self._pause_from = time.monotonic()

    def _resume(self, *_: Any) -> None:
        if self._pause_from is not None:
            self._paused += time.monotonic() - self._pause_from
            self._pause_from = None

    on_train_epoch_end = _pause
    on_train_epoch_start = _resume

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started_at, self._paused, self._pause_from = time.monotonic(), 0.0, None
        self._start = self._mark = (0.0, trainer.global_step)
        if trainer.is_global_zero:  # loading and the sanity check are behind: the first step can be a while
            self._log("training from step %d (a line every %d steps)", trainer.global_step, self.every)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or self._mark is None or step == self._mark[1]:
            return
        if step % self.every and not self._quiet_too_long():
            return
        now = self.training_seconds(time.monotonic())
        samples = (step - self._mark[1]) * self.samples_per_step * trainer.world_size
        rate = samples / max(1e-9, now - self._mark[0])
        self._mark = (now, step)
        self._log("%s", self.line(trainer, step, rate, now))

    def line(self, trainer: L.Trainer, step: int, rate: float, now: float) -> str:
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}" if trainer.max_steps > 0 else f"step {step}"]
        for name, label in (("train/total", "loss"), ("train/top1", "top-1")):
            if name in metrics:
                parts.append(f"{label} {float(metrics[name]):.4g}")
        parts.append(f"{rate:.1f} samples/s")
        eta = self.eta(trainer, step, now)
        if eta is not None:
            parts.append(f"ETA {duration(eta)} of training")
        if self._paused >= 1:
            parts.append(f"validation and evaluation so far {duration(self._paused)}")
        return " | ".join(parts)

    def eta(self, trainer: L.Trainer, step: int, now: float) -> float | None:
        """Seconds of training left at the run's mean training pace (``now``: training seconds so far):
        to ``max_steps`` or ``max_time``, whichever is sooner."""
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

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause()
        self._validating_since = time.monotonic()

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        *_: Any,
    ) -> None:
        if trainer.is_global_zero and self._quiet_too_long():
            batches = sum(
                trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
            )
            elapsed = duration(time.monotonic() - self._validating_since)
            step = self._step(trainer)
            self._log("validation at step %s: batch %d/%d, %s so far", step, batch_idx + 1, batches, elapsed)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resume()
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        shown = [f"{k} {float(v):.4g}" for k, v in sorted(metrics.items()) if k.startswith("val/")]
        shown = [s for s in shown if "depth" not in s]  # per-depth top-1 stays in the logger
        self._log("validation at step %s: %s", self._step(trainer), ", ".join(shown))

    @staticmethod
    def _step(trainer: L.Trainer) -> str:
        return (
            f"{trainer.global_step}/{trainer.max_steps}"
            if trainer.max_steps > 0
            else str(trainer.global_step)
        )


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
