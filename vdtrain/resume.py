"""A resumed run is the run's own: ``resume=last`` (or a ``.ckpt`` of a run) continues with the
configuration the run saved in ``<run>/.hydra/config.yaml``, not with today's defaults.

Only the keys in ``MAY_CHANGE`` may differ on the command line of a resume (they do not change what the
run computes, or extend it); any other override that differs from the saved value is refused with the
saved value named. A resume never rewrites the run's ``.hydra`` record: it records itself under
``resumes/<time>/`` (``vdtrain.config.run_record``). Light imports only: this runs before Lightning
is imported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from vdtrain.config import RECORD, FitConfig
from vdtrain.zero_checkpoint import check_zero_checkpoint, is_checkpoint, is_zero_checkpoint

log = logging.getLogger("vdtrain.fit")
# Keys a resume may change (a prefix covers its sub-keys): how long the run goes on (max_steps only
# upwards), how it logs, checkpoints, evaluates, exports and pushes, how many CPU threads and DataLoader
# workers it uses (batches are the same for any worker count, docs/training.md), how it computes a step
# (compiled or not, the loss's chunks: the same loss to float rounding), and the learning rate and
# clipping a recovery from a non-finite loss lowers (docs/training.md, Faults).
MAY_CHANGE = (
    "resume",
    "run_dir",
    "debug",
    "trainer.max_steps",
    "trainer.max_minutes",
    "trainer.log_every_n_steps",
    "trainer.progress_every_n_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.threads",
    "trainer.compile",
    "drafter.loss_chunks",
    "data.num_workers",
    "logger",
    "eval",
    "push",
    "export_dir",
    "optim.lr",
    "optim.grad_clip",
)


def may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def auto(resume: str | None, run_dir: Path) -> str | None:
    """``resume=auto`` (a requeued SLURM job's one command): ``last`` when ``run_dir`` has a
    ``last.ckpt``, else None, a fresh start; any other value as given."""
    if resume != "auto":
        return resume
    return "last" if is_checkpoint(run_dir / "checkpoints" / "last.ckpt") else None


def checkpoint(resume: str, run_dir: Path, named: bool = True) -> Path:
    """The checkpoint ``resume`` names; a missing one is an error that says what to do: name the run
    (``named`` False: ``run_dir`` is a new time-named folder, not one the user gave), or, for a run that
    stopped before its first checkpoint, start it again."""
    path = run_dir / "checkpoints" / "last.ckpt" if resume == "last" else Path(resume)
    if is_zero_checkpoint(path):  # DeepSpeed's folder: refused now if a rank's files are missing
        check_zero_checkpoint(path)
        return path
    if path.is_file():
        return path
    if resume != "last":
        raise FileNotFoundError(f"resume={resume!r}: no checkpoint at {str(path)!r}")
    runs = recent_runs(run_dir.parent)
    known = f"; runs with a checkpoint, newest first: {', '.join(runs)}" if runs else ""
    if named and run_dir.is_dir():
        raise FileNotFoundError(
            f"resume=last: the run {str(run_dir)!r} has no checkpoint ({str(path)!r}): it stopped before its "
            "first one; start it again without resume=last"
        )
    if named:
        raise FileNotFoundError(
            f"resume=last: no checkpoint at {str(path)!r}: there is no run folder {str(run_dir)!r}{known}"
        )
    raise FileNotFoundError(
        f"resume=last: no checkpoint at {str(path)!r}; name the run to continue with "
        f"hydra.run.dir=<run folder>{known}"
    )


SUMMARY = "summary.json"  # what fit writes when a run ends: it is finished


def finished(run_dir: Path, effective: DictConfig) -> str | None:
    """Why ``resume=last`` of ``run_dir`` with the configuration ``effective`` has nothing to train, or
    None. A run with its summary ended at ``trainer.max_steps`` or at its time (``max_minutes``) or epoch
    limit; the resume goes on only past a higher ``max_steps`` or a changed ``max_minutes``."""
    path = run_dir / SUMMARY
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    steps, trainer = summary["steps"], effective.trainer
    saved = (
        OmegaConf.load(run_dir / RECORD / "config.yaml").trainer if (run_dir / RECORD).is_dir() else trainer
    )
    ended_at_steps = steps >= summary.get("max_steps", saved.max_steps)
    minutes = summary.get("max_minutes", saved.max_minutes)
    if steps < trainer.max_steps and (ended_at_steps or trainer.max_minutes != minutes):
        return None
    if ended_at_steps or steps >= trainer.max_steps:
        limit = f"trainer.max_steps={trainer.max_steps}"
    else:
        limit = f"trainer.max_minutes={minutes}" if minutes is not None else "its trainer.max_epochs"
    return (
        f"the run {str(run_dir)!r} is finished ({steps} steps, {limit}; {SUMMARY}): nothing to resume, "
        "nothing changed; raise trainer.max_steps (or trainer.max_minutes) to train it further"
    )


def recent_runs(folder: Path, count: int = 3) -> list[str]:
    """Up to ``count`` run folders under ``folder`` with a ``last.ckpt``, newest first."""
    ckpts = sorted(folder.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [str(p.parent.parent) for p in ckpts[:count]]


def saved_run(ckpt: Path, resume: str, run_dir: Path) -> Path | None:
    """The run folder whose record configures the resume: ``run_dir`` for ``last``, else the folder the
    checkpoint lies in (``<run>/checkpoints/x.ckpt``); None when it has no record."""
    run = run_dir if resume == "last" else ckpt.resolve().parent.parent
    return run if (run / RECORD / "config.yaml").is_file() else None


def resumed_config(
    cfg: DictConfig, overrides: list[str], choices: dict[str, Any], run_dir: Path
) -> DictConfig:
    """The configuration a resume runs with: the run's saved one, with the command line's ``overrides``
    applied where ``MAY_CHANGE`` allows. ``cfg`` is the composed configuration (``choices`` its config
    group options); a run without a record (one started from Python) resumes with ``cfg`` as given."""
    resume = str(auto(cfg.resume, run_dir))
    ckpt = checkpoint(resume, run_dir)
    run = saved_run(ckpt, resume, run_dir)
    if run is None:
        return cfg
    saved = OmegaConf.load(run / RECORD / "config.yaml")
    saved_choices = OmegaConf.load(run / RECORD / "hydra.yaml").hydra.runtime.choices
    changed, refused = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_hydra_override():
            continue
        key = override.key_or_group
        if key in saved_choices:  # a config group: compare the options chosen
            new, old = choices.get(key), saved_choices.get(key)
        else:
            new, old = _value(cfg, key), _value(saved, key)
        if new == old:
            continue
        if not may_change(key) or (key == "trainer.max_steps" and new < old):
            refused.append(f"{key}={new} (the run has {key}={old})")
        elif key not in saved_choices:
            changed.append(key)
    if refused:
        raise ValueError(
            f"resume: {'; '.join(refused)} would change the run {str(run)!r}; on resume only "
            f"{', '.join(MAY_CHANGE[3:])} may change (max_steps only upwards): docs/training.md, Resuming"
        )
    effective = OmegaConf.merge(OmegaConf.structured(FitConfig), saved)
    for key in ["resume", *changed]:
        OmegaConf.update(effective, key, OmegaConf.select(cfg, key), merge=False)
    kept = f"; changed here: {', '.join(changed)}" if changed else ""
    log.info("resuming %s from %s with the run's saved configuration%s", run, ckpt, kept)
    return effective


def _value(cfg: DictConfig, key: str) -> Any:
    """``key``'s value in ``cfg`` as plain data (None where absent), interpolations left unresolved."""
    node = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    if isinstance(node, DictConfig) or OmegaConf.is_list(node):
        return OmegaConf.to_container(node)
    return node
