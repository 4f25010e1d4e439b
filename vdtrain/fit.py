"""``python -m vdtrain.fit``: train an EAGLE drafter for a target (default: the shapes world on the CPU).

Writes ``<run_dir>/checkpoints/{last,best}.ckpt`` (Lightning), logs under ``<run_dir>/logs``, and the
trained drafter in the Hub export format (``config.json`` + ``model.safetensors`` + a ``README.md`` model
card with the last EvalAfterEpoch table) under ``<run_dir>/drafter``; optionally pushes it to the Hub
(``push.repo_id``, a dry run by default); prints a summary at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import INTERRUPTED_EXIT, run_app, user_errors
from vdtrain.config import FitConfig, check_known_keys, register_configs
from vdtrain.paths import CONF_DIR
from vdtrain.preflight import FIT_MINIMUMS, FIT_RANGES, at_least, check_fit, within
from vdtrain.train.fit_parts import build_drafter, frozen_dtype

if TYPE_CHECKING:  # the training stack is imported when training starts, after the checks
    import lightning as L

    from vdtrain.drafters.base import Drafter

log = logging.getLogger(__name__)

register_configs()

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended
STRATEGIES = ("auto", "ddp", "ddp_cpu", "deepspeed_stage_2", "deepspeed_stage_3")


def build_strategy(cfg: FitConfig):
    """Lightning strategy from ``trainer.strategy``; DeepSpeed gets our extra config entries."""
    name = cfg.trainer.strategy
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy must be one of {STRATEGIES}, got {name!r}")
    if name == "ddp_cpu":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    if name.startswith("deepspeed"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=deepspeed_config(cfg))
    return name


def deepspeed_config(cfg: FitConfig) -> dict[str, Any]:
    """The DeepSpeed config of ``trainer.strategy=deepspeed_stage_N``: the ZeRO stage and the micro-batch
    (``data.batch_size``; Lightning would read it from a batch sampler, which the positioned stream has
    not), deep-merged with ``trainer.deepspeed`` (extra zero_optimization entries keep the stage).
    Gradient accumulation is Lightning's to set, from ``trainer.accumulate_grad_batches``."""
    base = {
        "zero_optimization": {"stage": int(cfg.trainer.strategy[-1])},
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
    }
    extra = cfg.trainer.deepspeed or {}
    if "gradient_accumulation_steps" in extra:
        raise ValueError(
            "trainer.deepspeed.gradient_accumulation_steps: set trainer.accumulate_grad_batches instead "
            "(Lightning hands it to DeepSpeed)"
        )
    return OmegaConf.to_container(OmegaConf.merge(base, extra))


def build_logger(cfg: FitConfig, run_dir: Path):
    kind, name = cfg.logger.kind, cfg.logger.name or run_dir.name
    save_dir = run_dir / "logs"
    if kind == "csv":
        from vdtrain.train.csv_log import AppendingCSVLogger

        return AppendingCSVLogger(save_dir)
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir, name="", version="")
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(
            name=name,
            project=cfg.logger.project,
            save_dir=str(save_dir),
            offline=cfg.logger.offline,
            id=wandb_id(run_dir),
            resume="allow",  # a resume of the folder continues its wandb run
        )
    raise ValueError(f"logger.kind must be csv, tensorboard or wandb, got {kind!r}")


def wandb_id(run_dir: Path) -> str:
    """The run folder's wandb id: its name (wandb's characters only) and a hash of its absolute path, the
    same for every launch of the folder (a resume, a requeued job), different for two folders alike."""
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_dir.name)[:48]}-{digest}"


# Lightning's warnings that the training stream (vdtrain.data.streams) makes false, silenced around fit
# only: it gives each worker and rank its own samples (no duplicates whatever __len__ says), and a resumed
# run continues from the step reached, mid-epoch included (tests/test_fit.py checks both).
STREAM_HANDLES = (
    r"Your `IterableDataset` has `__len__` defined",
    r"You're resuming from a checkpoint that ended before the epoch ended",
    # Lightning's own use of a torch API newer torches deprecate: not the user's to act on
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


# A resume writes into its own run's checkpoint folder: that it is not empty is the point, not a warning.
RESUME_HANDLES = (r"Checkpoint directory .* exists and is not empty",)


@contextmanager
def without_false_warnings(resuming: bool = False) -> Iterator[None]:
    """``STREAM_HANDLES`` (and a resume's ``RESUME_HANDLES``) silenced inside the block only; every other
    warning is kept."""
    with warnings.catch_warnings():
        for message in (*STREAM_HANDLES, *(RESUME_HANDLES if resuming else ())):
            warnings.filterwarnings("ignore", message=message)
        yield


class _NoAdverts(logging.Filter):
    """Lightning's start-up tip for its cloud logger is an advert, not information about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdverts())


def fit(cfg: FitConfig, callbacks: list[L.Callback] | None = None) -> dict:
    """Train; ``callbacks`` are added to the configured ones (tests use them to interrupt a run).

    Raises ``Preempted`` after SIGTERM and ``Interrupted`` after Ctrl-C (``last.ckpt`` then holds the step
    reached; a second Ctrl-C stops at once) and
    ``NonFiniteLossError`` / ``NonFiniteWeightsError`` naming the last checkpoint with finite weights."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from vdtrain.data.datamodule import DrafterDataModule
    from vdtrain.hub import export_drafter, find_results, training_command
    from vdtrain.prompts import prompts_for_run
    from vdtrain.resume import auto, checkpoint
    from vdtrain.targets import load_target
    from vdtrain.targets.registry import cast_for_inference
    from vdtrain.train.checkpointing import (
        AtomicCheckpointIO,
        CtrlC,
        FiniteCheckpoint,
        Interrupted,
        Preempted,
        checkpoint_interval,
    )
    from vdtrain.train.module import DrafterModule, NonFiniteLossError
    from vdtrain.train.progress import ProgressLog, StepProgressBar, progress_interval

    if isinstance(cfg, DictConfig):
        check_known_keys(cfg)
        at_least(cfg, FIT_MINIMUMS)
        within(cfg, FIT_RANGES)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = Path(cfg.run_dir)
    target = cast_for_inference(load_target(OmegaConf.to_container(cfg.target)), frozen_dtype(cfg))
    drafter = build_drafter(cfg, target)
    module = DrafterModule(
        target,
        drafter,
        cfg.drafter,
        cfg.optim,
        features=cfg.data.features,
        p_null=cfg.data.p_null,
        seed=cfg.seed,
        max_steps=cfg.trainer.max_steps,
        max_minutes=cfg.trainer.max_minutes,
        compile=cfg.trainer.compile,
    )
    data = DrafterDataModule(cfg.data, target.identity, target.world, drafter.taps)
    resume = auto(cfg.resume, run_dir)
    ckpt_path = None if resume is None else str(checkpoint(resume, run_dir))
    last = FiniteCheckpoint(
        dirpath=run_dir / "checkpoints",
        filename="step{step}",
        save_last=True,
        every_n_train_steps=checkpoint_interval(cfg.trainer.checkpoint_every_n_steps, cfg.trainer.max_steps),
        save_top_k=0,
        enable_version_counter=False,  # always last.ckpt, even if a resumed run changes the settings
        resumed_from=ckpt_path,
    )
    best_metric = cfg.best_metric or drafter.best_metric
    hooks: list[L.Callback] = [
        LearningRateMonitor(logging_interval="step"),  # lr-<optimizer> beside the losses
        last,
        FiniteCheckpoint(
            dirpath=run_dir / "checkpoints",
            filename="best",
            monitor=best_metric,
            mode=cfg.best_mode,
            save_top_k=1,
            enable_version_counter=False,
            # EvalAfterEpoch measures at the end of the training epoch, after validation has run.
            save_on_train_epoch_end=best_metric.startswith("eval/"),
        ),
    ]
    t = cfg.trainer
    samples_per_step = cfg.data.batch_size * t.accumulate_grad_batches
    progress = ProgressLog(progress_interval(t.progress_every_n_steps, t.max_steps), samples_per_step)
    hooks.append(progress)
    terminal = sys.stderr.isatty()
    if terminal:
        hooks.append(StepProgressBar())
    if cfg.eval.enabled:
        from vdtrain.eval.callback import EvalAfterEpoch  # the eval stack loads only when used
        from vdtrain.target_settings import world_knobs

        eval_cfg = OmegaConf.to_object(cfg.eval) if isinstance(cfg.eval, DictConfig) else cfg.eval
        prompts = prompts_for_run(eval_cfg.prompts, eval_cfg.num_prompts, eval_cfg.caption_column)
        hooks.append(EvalAfterEpoch(eval_cfg, run_dir, prompts, world_knobs(cfg.target)))
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        precision=t.precision,
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        max_time=timedelta(minutes=t.max_minutes) if t.max_minutes else None,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=cfg.optim.grad_clip or None,
        log_every_n_steps=t.log_every_n_steps,
        check_val_every_n_epoch=t.val_every_n_epochs,
        deterministic=t.deterministic,
        logger=build_logger(cfg, run_dir),
        callbacks=[*hooks, *(callbacks or [])],
        default_root_dir=str(run_dir),
        enable_model_summary=False,
        enable_progress_bar=terminal,  # elsewhere (SLURM, a file) ProgressLog's lines say it plainly
        # DeepSpeed writes its own checkpoint folders and takes no CheckpointIO plugin.
        plugins=None if t.strategy.startswith("deepspeed") else [AtomicCheckpointIO()],
    )
    # the resolved configuration as the run's hyperparameters (wandb's config, TensorBoard's hparams)
    trainer.logger.log_hyperparams(OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))
    start = time.monotonic()

    def how_to_go_on() -> str:
        return f"{last.last_finite_hint()}, or resume=last hydra.run.dir={str(run_dir)!r}"

    with CtrlC(trainer) as ctrl_c:
        try:
            with without_false_warnings(resuming=ckpt_path is not None):
                trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
            minutes = (time.monotonic() - start) / 60
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}  # train/* and eval/*
            if data.val_dataloader():  # the summary reports the final drafter, not the last epoch's
                log.info("validating the final drafter at step %d (%d samples)", trainer.global_step,
                         cfg.data.val_samples)  # fmt: skip
                with without_false_warnings():
                    trainer.validate(module, datamodule=data, verbose=False)  # replaces callback_metrics
                metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        except SIGTERMException as stop:
            by, stopped = ("Ctrl-C", Interrupted) if ctrl_c.pressed else ("SIGTERM", Preempted)
            by = "SIGUSR1" if ctrl_c.warned and not ctrl_c.pressed else by
            raise stopped(f"stopped by {by} at step {trainer.global_step}; {how_to_go_on()}") from stop
        except Interrupted as stop:
            raise Interrupted(f"{stop}; {how_to_go_on()}") from None
        except NonFiniteLossError as err:
            raise NonFiniteLossError(f"{err}; {last.last_finite_hint()}") from err
    summary = {
        "run_dir": str(run_dir),
        "steps": trainer.global_step,
        "minutes": minutes,
        # this launch's steps over this launch's minutes (a resumed run's earlier steps took other time)
        "samples_per_s": (trainer.global_step - progress.first_step)
        * t.accumulate_grad_batches
        * cfg.data.batch_size
        * trainer.world_size
        / max(1e-9, minutes * 60),
        "max_steps": t.max_steps,  # the limits it ended under: a resume=last beyond neither has nothing to do
        "max_minutes": t.max_minutes,
        **metrics,
    }
    if t.strategy.startswith("deepspeed"):
        trainer.strategy.barrier()  # every rank's partition of last.ckpt is on disk before rank 0 reads it
    if trainer.is_global_zero:
        export = Path(cfg.export_dir) if cfg.export_dir else run_dir / "drafter"
        export_drafter(
            trained_drafter(module.drafter, t.strategy, last.last_model_path),
            export,
            target=target,
            eval_results=find_results(run_dir / "eval"),
            training_command=training_command(run_dir),
            metadata={"fit": summary, "config": OmegaConf.to_container(cfg)},
        )
        summary["drafter"] = str(export)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.push.repo_id:
            push_at_end(export, cfg)
    return summary


def trained_drafter(drafter: Drafter, strategy: str, last_ckpt: str) -> Drafter:
    """The drafter fit exports: the module's own, or under DeepSpeed the full fp32 drafter gathered from
    ``last.ckpt`` (written at the end of training). ZeRO-3 leaves each rank only its partition of the
    parameters, ZeRO-2 keeps them in bf16 under ``bf16-mixed``: the fp32 master weights, partitioned
    over the ranks' optimizer states, are the trained drafter (the one a run without DeepSpeed exports)."""
    if not strategy.startswith("deepspeed"):
        return drafter
    from vdtrain.drafters.base import Drafter

    return Drafter.from_pretrained(last_ckpt)


def push_at_end(export: Path, cfg: FitConfig) -> None:
    """The end-of-training Hub push. A failure is logged, not raised: the export is on disk and
    ``python -m vdtrain.export source=<run> push.repo_id=... push.dry_run=false`` retries it."""
    from vdtrain.hub import push_to_hub

    try:
        plan = push_to_hub(export, cfg.push.repo_id, private=cfg.push.private, dry_run=cfg.push.dry_run)
    except Exception:
        log.exception("pushing %s to %s failed; the export is kept", export, cfg.push.repo_id)
        return
    log.info("%s", plan.describe())


def resume_run(cfg: DictConfig) -> DictConfig:
    """The configuration ``resume=`` continues with (``vdtrain.resume``), written to this launch's record
    (``resumes/<time>/config.yaml``, or ``.hydra/`` of a new folder resuming another run's checkpoint) in
    place of the composed one it did not run."""
    from hydra.core.hydra_config import HydraConfig

    from vdtrain.resume import resumed_config

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    effective = resumed_config(cfg, list(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices), run_dir)
    if hydra_cfg.output_subdir is not None:  # never the resumed run's own .hydra (run_record)
        OmegaConf.save(effective, run_dir / hydra_cfg.output_subdir / "config.yaml")
    return effective


def _kept(cfg: DictConfig) -> str:
    return f"resume=last hydra.run.dir={cfg.run_dir} goes on from the run's last checkpoint"


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="fit")
@user_errors("vdtrain.fit", _kept)
def _main(cfg: DictConfig) -> None:
    from vdtrain.durations import duration
    from vdtrain.resume import auto, finished
    from vdtrain.train.checkpointing import Interrupted, Preempted

    started = time.monotonic()
    run_dir = Path(cfg.run_dir)
    resume = None if cfg.resume is None else auto(cfg.resume, run_dir)
    if resume is not None:
        cfg = resume_run(cfg)
        # a finished job of a resumed sweep (a single run's ends in run_app's checks): the next job goes on
        done = finished(run_dir, cfg) if resume == "last" else None
        if done is not None:
            print(f"vdtrain.fit: {done}")
            return
    try:
        summary = fit(cfg)
    except Preempted as stop:
        log.error("%s", stop)
        sys.exit(INTERRUPTED_EXIT if isinstance(stop, Interrupted) else PREEMPTED_EXIT_CODE)
    if summary.get("drafter"):
        print(json.dumps(summary, indent=2))
        print(
            f"trained {summary['steps']} steps in {summary['minutes']:.1f} min "
            f"({summary['samples_per_s']:.1f} samples/s): {_learned(summary)} -> {summary['drafter']}"
        )
        print(f"wall time {duration(time.monotonic() - started)} (loading, training, validation, export)")


def _learned(summary: dict[str, Any]) -> str:
    """What the run learned, as its summary has it: validation's numbers, or the last training batch's
    when validation was switched off (``data.val_samples=0``)."""
    if "val/total" in summary:
        return (
            f"val loss {summary['val/total']:.4f}, top-1 {summary['val/top1']:.3f}, "
            f"tau_sim {summary.get('val/tau_sim', float('nan')):.2f}"
        )
    nan = float("nan")
    return (
        f"no validation; last training batch: loss {summary.get('train/total', nan):.4f}, "
        f"top-1 {summary.get('train/top1', nan):.3f}, "
        f"tau_sim (one chain) {summary.get('train/tau_sim_chain1', nan):.2f}"
    )


def main() -> None:
    run_app("vdtrain.fit", "fit", _main, check_fit)


if __name__ == "__main__":
    main()
