"""The checks each app runs on its composed configuration before Hydra makes an output folder, before
Lightning is imported and before a target loads (``vdtrain.cli.run_app``): value ranges, the device, the
output folder, the prompts, the run to resume. Each check calls the function that owns the rule; this
module only decides which apply to which app, so a mistake costs a second, not a model load."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import CONF_DIR

# (key, smallest value) for the integer settings that have one; None values are left to the app.
FIT_MINIMUMS = (
    ("trainer.max_steps", 1),
    ("trainer.accumulate_grad_batches", 1),
    ("trainer.log_every_n_steps", 1),
    ("trainer.progress_every_n_steps", 1),
    ("trainer.checkpoint_every_n_steps", 1),
    ("trainer.val_every_n_epochs", 1),
    ("trainer.threads", 1),
    ("data.batch_size", 1),
    ("data.samples_per_epoch", 1),
    ("data.val_samples", 0),
    ("data.num_workers", 0),
    ("drafter.loss_chunks", 1),
    ("eval.num_prompts", 1),
    ("eval.batch_size", 1),
    ("eval.every_n_epochs", 1),
)
DECODE_MINIMUMS = (("num_prompts", 1), ("batch_size", 1), ("threads", 1))


def at_least(cfg: DictConfig, minimums: tuple[tuple[str, int], ...]) -> None:
    for key, least in minimums:
        value = OmegaConf.select(cfg, key)
        if value is not None and value < least:
            raise ValueError(f"{key} must be at least {least}, got {value}")


def creatable(path: str, key: str) -> None:
    """``path`` is a folder or can be made one: its nearest existing ancestor is a writable folder."""
    target = Path(path).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{key}={path!r} cannot be made: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{key}={path!r} cannot be made: {str(existing)!r} is not writable")


def device_available(name: str, key: str = "device") -> None:
    if name not in ("auto", "cpu"):  # only these need no torch to check
        from vdtrain.devices import pick_device

        pick_device(name, key)


def check_fit(cfg: DictConfig) -> None:
    from vdtrain.config import check_known_keys
    from vdtrain.resume import resumed_config

    check_known_keys(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    at_least(cfg, FIT_MINIMUMS)
    if cfg.trainer.max_minutes is not None and cfg.trainer.max_minutes <= 0:
        raise ValueError(f"trainer.max_minutes must be positive (or null), got {cfg.trainer.max_minutes}")
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        from vdtrain.devices import gpu_missing

        why = gpu_missing()
        if why is not None:
            raise ValueError(f"trainer.accelerator={cfg.trainer.accelerator!r}, but {why}: use trainer=cpu")
    run_dir = Path(cfg.hydra.run.dir)
    creatable(str(run_dir), "hydra.run.dir")
    if cfg.resume is not None:
        resumed_config(cfg, list(cfg.hydra.overrides.task), dict(cfg.hydra.runtime.choices), run_dir)
    if cfg.eval.enabled:
        _prompts(cfg.eval)


def check_decoding(cfg: DictConfig) -> None:
    """``generate`` and ``evaluate``."""
    at_least(cfg, DECODE_MINIMUMS)
    if "methods" in cfg:  # evaluate's presets; generate's is a config group Hydra has checked
        known = sorted(p.stem for p in (CONF_DIR / "decode").glob("*.yaml"))
        unknown = [m for m in cfg.methods if m not in known]
        if unknown:
            names = ", ".join(repr(m) for m in unknown)
            raise ValueError(f"unknown method preset {names} in methods=; known: {known}")
    device_available(str(cfg.device))
    creatable(str(cfg.out_dir), "out_dir")
    _prompts(cfg)


def check_export(cfg: DictConfig) -> None:
    from vdtrain.export_format import REPO_ID

    source = str(cfg.source)
    here = (Path(source).expanduser(), CONF_DIR.parent / source)  # as resolve_folder looks
    if not any(p.exists() for p in here) and not REPO_ID.fullmatch(source):
        raise FileNotFoundError(f"source={source!r} does not exist (and is not a Hub repo id owner/name)")
    if cfg.out_dir is not None:
        creatable(str(cfg.out_dir), "out_dir")


def _prompts(cfg: DictConfig) -> None:
    """The prompts are read now (a caption file is small): a bad file or count fails here."""
    from vdtrain.prompts import prompts_for_run

    prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.get("caption_column"))
