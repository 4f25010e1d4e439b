"""Training checkpoints that a run can always resume from.

- ``AtomicCheckpointIO`` writes each file next to its final name and renames it into place, so a full
  disk or a kill mid-write leaves the previous ``last.ckpt`` whole (Lightning's default stages the file
  in the system temp folder and copies it over when that is another filesystem, truncating the old one).
- ``FiniteCheckpoint`` refuses to write weights that are NaN or infinite, remembers the last file it did
  write (errors name it), and writes ``last.ckpt`` every N steps (``checkpoint_interval``), at the end of
  every epoch and of training, and on SIGTERM (SLURM preemption) or Ctrl-C at the step reached.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("vdtrain.fit")
MOST_STEPS_BETWEEN = 100  # the default cadence's ceiling
CHECKPOINTS_PER_RUN = 10  # the default cadence's floor: a short run still has this many


def checkpoint_interval(every: int | None, max_steps: int) -> int:
    """``trainer.checkpoint_every_n_steps``, or for null every ``max_steps // 10`` steps, at most 100, so a
    60-step run killed at step 42 resumes from step 36, not from nothing."""
    if every is not None:
        return every
    return max(1, min(MOST_STEPS_BETWEEN, max_steps // CHECKPOINTS_PER_RUN))


class NonFiniteWeightsError(FloatingPointError):
    pass


class CheckpointWriteError(OSError):
    pass


class Preempted(RuntimeError):
    """Training stopped by SIGTERM after writing a resumable checkpoint."""


class Interrupted(Preempted):
    """Training stopped by Ctrl-C (SIGINT): after writing a resumable checkpoint, or at once."""


class CtrlC:
    """Ctrl-C during ``trainer.fit`` stops as SIGTERM does: Lightning's own stop flag, read at the end of
    the step (or validation batch, or epoch), so ``FiniteCheckpoint`` writes ``last.ckpt`` at a step
    boundary and the resume is exact. A second Ctrl-C, or one outside training (the final validation,
    the export), raises ``Interrupted`` at once. Installed in the main thread only (where signals
    arrive) and only where SIGINT is not ignored; the previous handler comes back on exit.

    SIGUSR1 (SLURM's ``--signal=USR1@90`` warning before the time limit) stops as SIGTERM does, once:
    ``last.ckpt`` at the step reached, exit 143, and the requeued job's ``resume=auto`` goes on from it.
    Installed first, it also keeps Lightning's own SLURM handler (an ``hpc_ckpt`` that resume does not
    read) off that signal."""

    def __init__(self, trainer: L.Trainer) -> None:
        self.trainer, self.pressed, self.warned = trainer, False, False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> CtrlC:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # nohup, a background job
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        if main and hasattr(signal, "SIGUSR1"):
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_sigusr1)
        return self

    def __exit__(self, *_: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_sigusr1(self, signum: int, frame: object) -> None:
        log.warning("SIGUSR1 (the scheduler's warning): stopping at the end of this step to write last.ckpt")
        self.warned = True
        self.trainer._signal_connector.received_sigterm = True

    def _on_sigint(self, signum: int, frame: object) -> None:
        state = self.trainer.state
        fitting = state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING
        if self.pressed or not fitting:
            raise Interrupted(f"stopped at once by Ctrl-C at step {self.trainer.global_step}")
        self.pressed = True
        log.warning(
            "Ctrl-C: stopping at the end of this step to write last.ckpt (Ctrl-C again stops at once)"
        )
        # Lightning's SIGTERM flag (it has no public setter): every loop checks it at its safe points.
        self.trainer._signal_connector.received_sigterm = True


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")  # same folder: same filesystem
        data = io.BytesIO()  # serialised first: torch.save into a full disk reports no errno
        torch.save(checkpoint, data)
        try:
            with open(tmp, "wb") as f:
                f.write(data.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            if isinstance(err, OSError):
                kept = (
                    f"the previous {final.name} is kept" if final.exists() else f"no {final.name} was written"
                )
                raise CheckpointWriteError(
                    err.errno, f"cannot write checkpoint {str(final)!r} ({err}); {kept}"
                ) from err
            raise
        with contextlib.suppress(OSError):  # make the rename itself durable
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def non_finite(state: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``state`` holding a NaN or an infinity."""
    return [
        name
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all()
    ]


class FiniteCheckpoint(ModelCheckpoint):
    def __init__(self, *args: Any, resumed_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_finite = resumed_from  # the newest checkpoint file known to hold finite weights

    def last_finite_hint(self) -> str:
        if self.last_finite is None:
            return "no checkpoint was written before it"
        return f"the last finite checkpoint is {self.last_finite!r} (resume=<that path>)"

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        bad = non_finite(trainer.lightning_module.state_dict())
        if bad:
            shown = ", ".join(bad[:5]) + (f", … ({len(bad) - 5} more)" if len(bad) > 5 else "")
            raise NonFiniteWeightsError(
                f"step {trainer.global_step}: non-finite weights ({shown}); {filepath!r} not written, "
                f"{self.last_finite_hint()} — lower optim.lr or check the features"
            )
        super()._save_checkpoint(trainer, filepath)
        self.last_finite = filepath

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._save_last_now(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_last_now(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """SIGTERM (or Ctrl-C, which ``CtrlC`` turns into Lightning's SIGTERM stop): write ``last.ckpt`` at
        the step reached."""
        if isinstance(exception, SIGTERMException):
            self._save_last_now(trainer)

    def _save_last_now(self, trainer: L.Trainer) -> None:
        """``last.ckpt`` at the step reached, unless this step's is already written."""
        if not self.save_last or trainer.sanity_checking:
            return
        if self._last_global_step_saved == trainer.global_step and self.last_finite is not None:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
