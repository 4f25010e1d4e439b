"""``EvalAfterEpoch``: decode held-out prompts with the drafter being trained, after every N epochs.

The measured speed of real decoding (S, τ, d̄, TPF, latency vs AR) is what a drafter is for, and it can
disagree with the simulated τ of validation, so every run measures it. Under DDP / DeepSpeed every rank
decodes its part of the prompts with its copy of the drafter (``vdtrain.sharding``; under ZeRO-3 the
gathered weights, ``whole_drafter``); the parts are
gathered into the same numbers one process would measure, which global rank zero broadcasts to every
rank (so they can drive ``best`` checkpoint selection), logs to the configured logger as
``eval/<method>_T<t>/<metric>``, prints the table and writes it under ``<run_dir>/eval/`` (``latest/`` is
the newest, which export puts in the model card).
With ``acceptance.enabled`` it also sets simulated against real acceptance per draft depth
(``vdtrain.eval.acceptance``): ``eval/acceptance/*`` metrics, ``acceptance.{md,json,png}`` in the folder.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from PIL import Image

from vdtrain.config import EvalCallbackConfig
from vdtrain.eval.acceptance import (
    AcceptanceReport,
    acceptance_markdown,
    acceptance_metrics,
    measure,
    write_report,
)
from vdtrain.eval.plots import plot_acceptance, plot_samples
from vdtrain.eval.runner import EvalResult, UnitRecord, evaluate, method_configs
from vdtrain.eval.serving import refusal
from vdtrain.eval.table import EvalRow, to_markdown, write_tables
from vdtrain.preflight import not_for_trained
from vdtrain.sharding import current_ranks
from vdtrain.train.whole_drafter import whole_drafter

log = logging.getLogger(__name__)

SAMPLE_GRID_PROMPTS = 4  # images per row kept in memory for the sample grid (plot_samples' default)
LOGGED = ("S", "tau", "mean_depth", "TPF", "speedup", "skipped_steps", "relaxed_acceptances")


def metric_prefix(row: EvalRow) -> str:
    return f"eval/{row.method}_T{row.temperature:g}"


def row_metrics(rows: list[EvalRow]) -> dict[str, float]:
    """The scalars to log per row; quality values that are not available are left out, not zeroed."""
    out: dict[str, float] = {}
    for row in rows:
        prefix = metric_prefix(row)
        out.update({f"{prefix}/{name}": float(getattr(row, name)) for name in LOGGED})
        out.update({f"{prefix}/quality/{k}": q.value for k, q in row.quality.items() if q.value is not None})
    return out


class EvalAfterEpoch(L.Callback):
    def __init__(
        self,
        cfg: EvalCallbackConfig,
        run_dir: str | Path,
        prompts: list[str],
        decode_overrides: dict[str, Any] | None = None,
    ) -> None:
        """``prompts``: ``vdtrain.prompts.prompts_for_run(cfg.prompts, cfg.num_prompts)`` in ``fit``;
        ``decode_overrides``: the target config's own preset knobs (``target.decode``)."""
        if cfg.every_n_epochs < 1:
            raise ValueError(f"eval.every_n_epochs must be >= 1, got {cfg.every_n_epochs}")
        if not prompts:
            raise ValueError("eval: the prompt set is empty")
        self.cfg, self.run_dir, self.prompts = cfg, Path(run_dir), prompts
        self.decode_overrides = decode_overrides or {}
        self.last_step: int | None = None
        # AR's units (this rank's) per (temperature, first prompt). The target is frozen, so its tokens
        # stay valid, but not its time: AR is decoded again every round at eval's temperatures, so the
        # speedup divides times measured minutes apart, not hours (the machine's load changes); the
        # acceptance report's other temperatures read only its tokens and reuse them.
        self.ar_runs: dict[tuple[float, int], UnitRecord] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every method in ``eval.methods`` can decode with the drafter being trained: a block tree given
        an eagle drafter is refused before the first step, not after the first epoch."""
        refused = {
            c.name: why
            for c in method_configs(list(self.cfg.methods), self.decode_overrides)
            if (why := refusal(c, pl_module.drafter)) is not None
        }
        if refused:
            raise not_for_trained(list(refused), pl_module.drafter.config.kind, next(iter(refused.values())))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (trainer.current_epoch + 1) % self.cfg.every_n_epochs == 0 and not self._final_is_near(trainer):
            self.run(trainer, pl_module, _round_tag(trainer), last=_training_ends(trainer))

    def _final_is_near(self, trainer: L.Trainer) -> bool:
        """The run stops (``max_steps``) within half an epoch and will measure its final drafter then:
        an evaluation now would measure nearly the same drafter."""
        left = trainer.max_steps - trainer.global_step if trainer.max_steps > 0 else None
        per_epoch = trainer.num_training_batches / max(1, trainer.accumulate_grad_batches)
        return self.cfg.at_fit_end and left is not None and 0 < left < per_epoch / 2

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run that stops mid-epoch (max_steps, max_minutes) still gets its final drafter measured."""
        if self.cfg.at_fit_end and self.last_step != trainer.global_step:
            self.run(trainer, pl_module, "final", last=True)

    def run(
        self, trainer: L.Trainer, pl_module: L.LightningModule, tag: str, last: bool = True
    ) -> dict[str, float]:
        """One evaluation round; ``last``: the run's final one, which makes the acceptance report unless
        ``acceptance.every_round`` makes it every round."""
        metrics: dict[str, float] = {}
        started = time.monotonic()
        report = self.cfg.acceptance.enabled and (last or self.cfg.acceptance.every_round)
        result, reports = self._evaluate(pl_module, report)  # every rank: each decodes its part
        if trainer.is_global_zero:
            metrics = row_metrics(result.rows) | acceptance_metrics(reports)
            self._report(trainer, result, reports, metrics, tag, time.monotonic() - started)
        metrics = trainer.strategy.broadcast(metrics, src=0)
        self.last_step = trainer.global_step
        for name, value in metrics.items():
            trainer.callback_metrics[name] = _tensor(value, pl_module)
        return metrics

    def _evaluate(
        self, pl_module: L.LightningModule, report: bool
    ) -> tuple[EvalResult, list[AcceptanceReport]]:
        was_training = pl_module.training
        ranks = current_ranks()
        pl_module.eval()
        timed = {float(t) for t in self.cfg.temperatures}
        self.ar_runs = {key: record for key, record in self.ar_runs.items() if key[0] not in timed}
        try:
            with torch.no_grad(), whole_drafter(pl_module.drafter, pl_module.target) as drafter:
                result = evaluate(
                    pl_module.target,
                    drafter,
                    self.prompts,
                    list(self.cfg.methods),
                    list(self.cfg.temperatures),
                    seed=self.cfg.seed,
                    batch_size=self.cfg.batch_size,
                    progress=False,
                    ar_runs=self.ar_runs,
                    decode_overrides=self.decode_overrides,
                    ranks=ranks,
                    keep_images=SAMPLE_GRID_PROMPTS,
                    speed_repeats=self.cfg.speed_repeats,
                )
                assert result is not None  # no store: every rank merges
                if not report:
                    return result, []
                reports = measure(
                    pl_module.target,
                    drafter,
                    result,
                    self.cfg.acceptance,
                    seed=self.cfg.seed,
                    batch_size=self.cfg.batch_size,
                    ar_runs=self.ar_runs,
                    decode_overrides=self.decode_overrides,
                    ranks=ranks,
                )
                return result, reports
        finally:
            pl_module.train(was_training)

    def _report(
        self,
        trainer: L.Trainer,
        result: EvalResult,
        reports: list[AcceptanceReport],
        metrics: dict[str, float],
        tag: str,
        seconds: float,
    ) -> None:
        table = to_markdown(result.rows)
        stamp = f"{datetime.now():%Y-%m-%d %H:%M:%S}"  # a redirected log's tables say when they were made
        head = f"EvalAfterEpoch ({tag}, step {trainer.global_step}, {len(self.prompts)} prompts)"
        print(f"\n{head} {stamp}\n{table}")
        # seconds: what the evaluation cost the training run (every rank decoding, acceptance included)
        settings: dict[str, Any] = {
            **asdict(self.cfg),
            "step": trainer.global_step,
            "tag": tag,
            "seconds": seconds,
        }
        folder = write_tables(result.rows, self.run_dir / "eval" / tag, settings)
        if reports:
            print(f"Simulated vs real acceptance\n{acceptance_markdown(reports)}")
            write_report(reports, folder)
            plot_acceptance(reports, folder / "acceptance.png")
        grid = _sample_grid(result, folder)
        latest = self.run_dir / "eval" / "latest"
        shutil.rmtree(latest, ignore_errors=True)
        shutil.copytree(folder, latest)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if self.cfg.log_images and grid is not None:
                _log_image(logger, "eval/samples", grid, trainer.global_step)


def _round_tag(trainer: L.Trainer) -> str:
    """``epochNNN`` (Lightning's 0-based epoch, as in ``metrics.csv``) for a whole epoch; ``final`` for the
    part of one that ``max_steps`` cut short (Lightning still ends it as an epoch): the run's final drafter,
    as ``on_train_end`` names it. A 400-step run of 128-step epochs has rounds epoch000, epoch001, final,
    not epoch003 for the 16 steps after the skipped epoch002."""
    whole = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return f"epoch{trainer.current_epoch:03d}" if whole else "final"


def _training_ends(trainer: L.Trainer) -> bool:
    """This epoch's end is the run's end: its step or epoch limit is reached (``max_minutes`` cannot be
    foreseen: ``at_fit_end`` measures that drafter when it stops)."""
    steps_done = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
    epochs_done = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
    return steps_done or epochs_done or trainer.should_stop


def _sample_grid(result: EvalResult, folder: Path) -> np.ndarray | None:
    """AR vs each method for the same seeds at the first temperature, saved as ``samples.png``;
    returned for image loggers."""
    path = plot_samples(result, result.rows[0].temperature, folder / "samples.png")
    return None if path is None else np.asarray(Image.open(path).convert("RGB"))


def _log_image(logger: Any, key: str, image: np.ndarray, step: int) -> None:
    """TensorBoard and wandb take images; CSV has the PNG on disk instead."""
    experiment = getattr(logger, "experiment", None)
    if hasattr(experiment, "add_image"):  # TensorBoard SummaryWriter
        experiment.add_image(key, image, step, dataformats="HWC")
    elif hasattr(logger, "log_image"):  # WandbLogger
        logger.log_image(key=key, images=[image], step=step)


def _tensor(value: float, pl_module: L.LightningModule) -> torch.Tensor:
    return torch.tensor(value, device=pl_module.device)
