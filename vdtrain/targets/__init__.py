"""Targets: the visual AR models vdtrain accelerates, behind one interface (``base.Target``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vdtrain.targets.base import Condition, ImageTokenizer, Target, TargetIdentity, TargetOutput
from vdtrain.targets.llamagen import LlamaGenSpec, LlamaGenTarget, build_llamagen_target
from vdtrain.targets.shapes import load_target_folder

__all__ = [
    "Condition",
    "ImageTokenizer",
    "LlamaGenSpec",
    "LlamaGenTarget",
    "Target",
    "TargetIdentity",
    "TargetOutput",
    "build_llamagen_target",
    "load_target",
    "load_target_folder",
    "pick_device",
    "target_for_run",
]


def pick_device(name: str) -> torch.device:
    """``auto`` → the first GPU when there is one, else the CPU; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def target_for_run(cfg) -> Target:
    """The target of a Hydra app's config (keys ``target``, ``device``, ``threads``) on its device."""
    from omegaconf import OmegaConf

    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    return load_target(OmegaConf.to_container(cfg.target), pick_device(cfg.get("device", "auto")))


def load_target(config: Mapping[str, object], device: str | torch.device = "cpu") -> Target:
    """Build the target a ``conf/target/*.yaml`` describes (``kind: folder`` or ``kind: llamagen``)."""
    fields = {k: v for k, v in config.items() if k not in ("kind", "quality")}
    kind = config.get("kind")
    if kind == "folder":
        return load_target_folder(fields.get("folder"), device)
    if kind == "llamagen":
        return build_llamagen_target(LlamaGenSpec(**fields), device)
    raise ValueError(f"unknown target kind {kind!r}; use 'folder' or 'llamagen'")
