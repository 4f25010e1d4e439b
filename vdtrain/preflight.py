"""The checks each app runs on its composed configuration before Hydra makes an output folder, before
Lightning is imported and before a target loads (``vdtrain.cli.run_app``): value ranges, the device, the
output folder, the prompts, the run to resume. Each check calls the function that owns the rule; this
module only decides which apply to which app, so a mistake costs a second, not a model load."""

from __future__ import annotations

import ast
import difflib
import json
import os
import tempfile
import warnings
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import NothingToDo
from vdtrain.config import DECODE_PRESETS, as_list, preset_node, presets_except

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
    ("eval.speed_repeats", 0),
    ("optim.warmup_steps", 0),
)
DECODE_MINIMUMS = (("num_prompts", 1), ("batch_size", 1), ("threads", 1), ("speed_repeats", 0))
# (key, low, high, whether low itself is allowed) for the real-valued settings; high None: no bound.
FIT_RANGES = (
    ("optim.lr", 0.0, None, True),  # 0: the drafter stays as it starts (tests compare runs with it)
    ("optim.weight_decay", 0.0, None, True),
    ("optim.grad_clip", 0.0, None, True),
    ("trainer.device_memory_gib", 0.0, None, False),
    ("optim.min_lr_ratio", 0.0, 1.0, True),
    ("data.p_null", 0.0, 1.0, True),
)


def at_least(cfg: DictConfig, minimums: tuple[tuple[str, int], ...]) -> None:
    for key, least in minimums:
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):  # an untyped config keeps 'abc' a string
            raise ValueError(f"{key} must be a whole number, got {value!r}")
        if value < least:
            raise ValueError(f"{key} must be at least {least}, got {value}")


def within(cfg: DictConfig, ranges: tuple[tuple[str, float, float | None, bool], ...]) -> None:
    for key, low, high, low_allowed in ranges:
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if value < low or (value == low and not low_allowed) or (high is not None and value > high):
            lowest = f"at least {low:g}" if low_allowed else f"above {low:g}"
            raise ValueError(
                f"{key} must be {lowest}{'' if high is None else f' and at most {high:g}'}, got {value}"
            )


def creatable(path: str, key: str) -> None:
    """``path`` is a folder or can be made one: its nearest existing ancestor is a folder where a folder
    can be made (tried: permissions alone do not tell, e.g. under /proc or a read-only mount)."""
    target = Path(path).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{key}={path!r} cannot be made: {str(existing)!r} is a file")
    if existing == target:  # an existing folder (a run to resume) is written to, not into
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{key}={path!r} is not writable")
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vdtrain-check-", dir=existing))
    except OSError as err:
        raise PermissionError(
            f"{key}={path!r} cannot be made: no folder can be made in {str(existing)!r} ({err.strerror})"
        ) from None


def device_available(name: str, key: str = "device") -> None:
    if name not in ("auto", "cpu"):  # only these need no torch to check
        from vdtrain.devices import pick_device

        pick_device(name, key)


def check_fit(cfg: DictConfig) -> None:
    from vdtrain.config import check_known_keys
    from vdtrain.resume import auto, checkpoint, finished, resumed_config

    check_known_keys(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    at_least(cfg, FIT_MINIMUMS)
    within(cfg, FIT_RANGES)
    target_exists(cfg.target)
    kind_known(str(cfg.drafter.kind))
    if cfg.trainer.max_minutes is not None and cfg.trainer.max_minutes <= 0:
        raise ValueError(f"trainer.max_minutes must be positive (or null), got {cfg.trainer.max_minutes}")
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        from vdtrain.devices import gpu_missing

        why = gpu_missing()
        if why is not None:
            raise ValueError(f"trainer.accelerator={cfg.trainer.accelerator!r}, but {why}: use trainer=cpu")
    run_dir, key = run_folder(cfg)
    creatable(str(run_dir), key)
    resume = auto(cfg.resume, run_dir)
    if resume is not None:
        named = run_dir.is_dir() or any(o.startswith(f"{key}=") for o in cfg.hydra.overrides.hydra)
        checkpoint(resume, run_dir, named)
        effective = resumed_config(
            cfg, list(cfg.hydra.overrides.task), dict(cfg.hydra.runtime.choices), run_dir
        )
        why = finished(run_dir, effective) if resume == "last" else None
        if why is not None:
            raise NothingToDo(why)
    if cfg.eval.enabled:
        presets_known(list(cfg.eval.methods), "eval.methods")
        presets_known([cfg.eval.acceptance.method], "eval.acceptance.method")
        trained_serves(cfg)
        _prompts(cfg.eval)
    memory_fits(cfg)


def memory_fits(cfg: DictConfig) -> None:
    """``plan=true``: print the memory plan and stop. Otherwise, where a device's memory is known
    (``trainer.device_memory_gib``, or the GPU's), refuse a run whose planned peak exceeds it. The plan
    builds the models on the meta device (seconds, no weights read into memory)."""
    on_gpu = cfg.trainer.accelerator in ("gpu", "cuda")
    if not cfg.plan and cfg.trainer.device_memory_gib is None and not on_gpu:
        return
    from vdtrain.train.fit_parts import frozen_dtype
    from vdtrain.train.memory_plan import (
        GIB,
        PlanUnavailable,
        check_fits,
        describe,
        device_memory,
        plan_for_fit,
    )

    try:
        plan = plan_for_fit(cfg)
    except PlanUnavailable as err:
        if cfg.plan:
            raise
        warnings.warn(f"no memory check: {err}", stacklevel=2)
        return
    limit = device_memory(cfg)
    if cfg.plan:
        room = "" if limit is None else f"; the device has {limit / GIB:.1f} GiB"
        raise NothingToDo(f'memory plan per GPU{room} (docs/training.md, "Memory plan"):\n{describe([plan])}')
    if limit is not None:
        source = "trainer.device_memory_gib" if cfg.trainer.device_memory_gib is not None else "the GPU"
        check_fits(plan, limit, source, frozen_dtype(cfg))


def run_folder(cfg: DictConfig) -> tuple[Path, str]:
    """The folder Hydra will make for this launch and the key that names it: ``hydra.run.dir``, or for a job
    of a sweep (``hydra.mode=MULTIRUN``) ``hydra.sweep.dir`` joined with its ``hydra.sweep.subdir``."""
    if cfg.hydra.mode == RunMode.MULTIRUN:
        return Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir), "hydra.sweep.dir"
    return Path(cfg.hydra.run.dir), "hydra.run.dir"


def drafter_kinds() -> dict[str, bool]:
    """Drafter kind -> whether it drafts blocks, for the kinds vdtrain's kind modules register: read from
    their source (each ``@register("<name>")`` class, and whether it defines ``Drafter.block_slots``), as
    importing them (``vdtrain.drafters.registry.DRAFTERS``) would import torch."""
    kinds: dict[str, bool] = {}
    for file in sorted((Path(__file__).parent / "drafters").glob("*.py")):
        for node in ast.parse(file.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            for name in (_registered_name(d) for d in node.decorator_list):
                if name is not None:
                    kinds[name] = any(
                        isinstance(f, ast.FunctionDef) and f.name == "block_slots" for f in node.body
                    )
    return kinds


def _registered_name(decorator: ast.expr) -> str | None:
    """``"<name>"`` of a ``@register("<name>")`` decorator; None for any other."""
    if (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Name)
        and decorator.func.id == "register"
    ):
        first = decorator.args[0] if decorator.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def kind_known(kind: str) -> None:
    """``drafter.kind`` names a kind (``drafter_class``'s refusal, before torch loads)."""
    kinds = list(drafter_kinds())
    if kind not in kinds:
        close = difflib.get_close_matches(kind, kinds, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"drafter.kind must be one of {kinds}, got {kind!r}{hint}")


# The tree kinds that draft a block per drafter forward (``vdtrain.decode.methods.TREES``' ``drafts_blocks``,
# which tests/test_bad_input.py checks this against): they need a drafter kind that drafts blocks.
BLOCK_TREE_KINDS = ("block",)


def block_methods(names: list[str], target: DictConfig) -> list[str]:
    """The presets among ``names`` whose tree (the target's knobs over the preset) drafts blocks."""
    from vdtrain.target_settings import world_knobs

    knobs = world_knobs(target)
    out = []
    for name in names:
        node = OmegaConf.merge(preset_node(DECODE_PRESETS / f"{name}.yaml"), knobs.get(name) or {})
        if OmegaConf.select(node, "tree.kind") in BLOCK_TREE_KINDS:
            out.append(name)
    return out


def no_blocks(kind: str) -> str:
    """Why a drafter of ``kind`` cannot serve a block tree, known from its kind alone (the builder's own
    check, ``BlockTreeBuilder.check_drafter``, also compares a block drafter's slots with the depth)."""
    return (
        f"a block tree needs a drafter that drafts blocks; this {kind} drafter drafts none "
        "(train one with drafter.kind=block)"
    )


# ``vdtrain.export_format.CONFIG_FILE`` (tests/test_bad_input.py checks they agree): importing that module
# imports huggingface_hub, a second of a check meant to take about one.
DRAFTER_CONFIG = "config.json"


def folder_drafter_kind(source: str) -> str | None:
    """The ``kind`` in the config of drafter folder ``source``; None where that is not known without
    loading it (a ``.ckpt``, a run folder, a Hub repo id, a config without ``kind``)."""
    from vdtrain.paths import repo_path

    config = repo_path(source) / DRAFTER_CONFIG
    if not config.is_file():
        return None
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):  # the load reports a bad config with its own words
        return None
    return kind if isinstance(kind, str) else None


def cannot_serve(given: str, method: str, why: str, serving: str | None) -> ValueError:
    """The refusal of a user's ``drafter=`` for ``method``, naming the target's drafter that would serve
    it (``serving``): the same words from the config-only check here and from ``vdtrain.eval.serving``."""
    instead = (
        f"this target's drafter that would is drafter={serving} (evaluate {method} with it "
        f"separately, or leave drafter= unset so each method takes the one it needs)"
        if serving
        else "no drafter shipped for this target serves it"
    )
    return ValueError(f"drafter={given} cannot decode {method}: {why}; {instead}")


def drafter_serves(cfg: DictConfig) -> None:
    """evaluate's ``drafter=``, where the user gave one, drafts blocks if a requested preset's tree needs
    them, read from its folder's config (``vdtrain.eval.serving`` checks the rest once drafters load)."""
    own = cfg.target.get("drafter")
    if not cfg.drafter or cfg.drafter == own:  # none, or the target's own: each method takes what it needs
        return
    needy = block_methods(as_list(cfg.methods), cfg.target)
    kinds = drafter_kinds()
    kind = folder_drafter_kind(str(cfg.drafter))
    if not needy or kind is None or kinds.get(kind, True):  # an unknown kind: the load refuses it
        return
    shipped = [str(s) for s in [own, *(cfg.target.get("more_drafters") or [])] if s]
    serving = next((s for s in shipped if kinds.get(folder_drafter_kind(s) or "", False)), None)
    raise cannot_serve(str(cfg.drafter), needy[0], no_blocks(kind), serving)


def trained_serves(cfg: DictConfig) -> None:
    """fit's ``eval.methods`` can decode with the drafter kind being trained (``EvalAfterEpoch`` checks the
    built drafter again before the first step)."""
    kind = str(cfg.drafter.kind)
    if drafter_kinds().get(kind, True):
        return
    needy = block_methods(list(cfg.eval.methods), cfg.target)
    if needy:
        raise not_for_trained(needy, kind, no_blocks(kind))


def not_for_trained(methods: list[str], kind: str, why: str) -> ValueError:
    """The refusal of ``eval.methods`` the drafter being trained cannot decode (``why``: the first's)."""
    return ValueError(
        f"eval.methods {sorted(methods)} cannot decode with the {kind} drafter being trained "
        f"({methods[0]}: {why}); leave them out of eval.methods"
    )


def check_decoding(cfg: DictConfig) -> None:
    """``generate`` and ``evaluate``."""
    at_least(cfg, DECODE_MINIMUMS)
    target_exists(cfg.target)
    if "methods" in cfg:  # evaluate's presets; generate's is checked with its overrides (without_method)
        presets_known(as_list(cfg.methods), "methods")
        presets_known([cfg.acceptance.method], "acceptance.method")
        drafter_serves(cfg)
    device_available(str(cfg.device))
    creatable(str(cfg.out_dir), "out_dir")
    _prompts(cfg)


def presets_known(names: list[str], key: str) -> None:
    known = presets_except()
    unknown = [m for m in names if m not in known]
    if unknown:
        shown = ", ".join(repr(m) for m in unknown)
        raise ValueError(f"unknown method preset {shown} in {key}=; known: {known}")


def target_exists(target: DictConfig) -> None:
    """A folder target (the embedded worlds' format) names a folder with its ``config.json``."""
    from vdtrain.paths import repo_path

    if target.get("kind") != "folder" or target.get("folder") is None:
        return
    folder = repo_path(target.folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"target.folder={target.folder!r}: there is no folder {str(folder)!r}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"target.folder={target.folder!r}: {str(folder)!r} holds no target (config.json)"
        )


def check_export(cfg: DictConfig) -> None:
    from vdtrain.export_format import REPO_ID, holds_drafter, no_drafter_here
    from vdtrain.paths import repo_path

    target_exists(cfg.target)
    source = str(cfg.source)
    path = repo_path(source)
    if not path.exists() and not REPO_ID.fullmatch(source):
        raise FileNotFoundError(f"source={source!r} does not exist (and is not a Hub repo id owner/name)")
    if path.is_dir() and not holds_drafter(path):
        raise no_drafter_here(source, path)
    if cfg.out_dir is not None:
        creatable(str(cfg.out_dir), "out_dir")


def _prompts(cfg: DictConfig) -> None:
    """The prompts are read now (a caption file is small): a bad file or count fails here."""
    from vdtrain.prompts import prompts_for_run

    prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.get("caption_column"), note_fewer=False)
