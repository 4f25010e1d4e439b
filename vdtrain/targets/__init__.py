"""Targets: the visual AR models vdtrain accelerates, behind one interface (``base.Target``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping

import torch

from vdtrain.config import TargetConfig
from vdtrain.targets.base import (
    Condition,
    DraftLayer,
    ImageTokenizer,
    Target,
    TargetIdentity,
    TargetOutput,
)
from vdtrain.targets.chameleon import FAMILIES as CHAMELEON_FAMILIES
from vdtrain.targets.chameleon import ChameleonDraftLayer, ChameleonSpec, load_chameleon_target
from vdtrain.targets.emu3 import FAMILY as EMU3_FAMILY
from vdtrain.targets.emu3 import Emu3DraftLayer, Emu3Spec, load_emu3_target
from vdtrain.targets.janus import FAMILY as JANUS_FAMILY
from vdtrain.targets.janus import JanusDraftLayer, JanusSpec, load_janus_target
from vdtrain.targets.llamagen import LlamaGenDraftLayer, LlamaGenSpec, LlamaGenTarget, build_llamagen_target
from vdtrain.targets.shapes import load_target_folder

__all__ = [
    "DRAFT_LAYERS",
    "Condition",
    "DraftLayer",
    "ImageTokenizer",
    "LlamaGenSpec",
    "LlamaGenTarget",
    "Target",
    "TargetIdentity",
    "TargetOutput",
    "build_llamagen_target",
    "cast_for_inference",
    "draft_layer_class",
    "inference_dtype",
    "load_target",
    "load_target_folder",
    "pick_device",
    "target_for_run",
]


# The drafter's decoder layer per target family (``TargetIdentity.family``).
DRAFT_LAYERS: dict[str, type[DraftLayer]] = {
    "llamagen": LlamaGenDraftLayer,
    **dict.fromkeys(CHAMELEON_FAMILIES, ChameleonDraftLayer),
    JANUS_FAMILY: JanusDraftLayer,
    EMU3_FAMILY: Emu3DraftLayer,
}


def draft_layer_class(family: str) -> type[DraftLayer]:
    """The drafter layer of target family ``family``; a clear error for a family without one."""
    if family not in DRAFT_LAYERS:
        raise ValueError(f"no drafter layer for target family {family!r}; known: {sorted(DRAFT_LAYERS)}")
    return DRAFT_LAYERS[family]


def pick_device(name: str) -> torch.device:
    """``auto`` → the first GPU when there is one, else the CPU; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ``target.dtype`` spellings: the short names conf/target uses, and torch's own.
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def inference_dtype(name: str) -> torch.dtype:
    """The torch dtype a ``target.dtype`` names; a clear error for anything else."""
    if name not in DTYPES:
        raise ValueError(f"unknown target.dtype {name!r}; use fp32, bf16 or fp16")
    return DTYPES[name]


def cast_for_inference(target: Target, name: str) -> Target:
    """``target`` running in the dtype ``name`` (``target.dtype``) for decoding; fp32 leaves it as it is.

    Half precision on a CPU runs but is usually slower than fp32 (few CPUs have bf16 matrix units), so it
    is allowed with a warning: useful to check bf16 numerics before a GPU run, not to go faster.
    """
    dtype = inference_dtype(name)
    if dtype == target.dtype:
        return target
    if target.token_embedding.weight.device.type == "cpu":
        warnings.warn(
            f"target.dtype={name} on the CPU: it runs, but is usually slower than fp32 there",
            stacklevel=2,
        )
    return target.use_dtype(dtype)


def target_for_run(cfg, *, apply_dtype: bool = False) -> Target:
    """The target of a Hydra app's config (keys ``target``, ``device``, ``threads``) on its device.

    ``apply_dtype`` casts it to ``target.dtype`` (decoding apps: generate, evaluate); the others (data
    preparation, export) keep the checkpoint's fp32, as training does.
    """
    from omegaconf import OmegaConf

    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    target = load_target(OmegaConf.to_container(cfg.target), pick_device(cfg.get("device", "auto")))
    return cast_for_inference(target, cfg.target.get("dtype", "fp32")) if apply_dtype else target


def own_fields(spec: type, fields: dict[str, object]) -> dict[str, object]:
    """``fields`` less the other kinds' keys that fit's typed config (``vdtrain.config.TargetConfig``, one
    schema for every kind) filled in with their defaults; any other key ``spec`` lacks stays, so that the
    spec refuses it."""
    defaults = dataclasses.asdict(TargetConfig())
    names = {f.name for f in dataclasses.fields(spec)}
    return {k: v for k, v in fields.items() if k in names or k not in defaults or v != defaults[k]}


@dataclasses.dataclass(frozen=True)
class FolderSpec:
    """``kind: folder``: a target saved as a folder (the shapes world's format)."""

    folder: str | None = None


# ``kind`` of a conf/target/*.yaml → the spec of the keys it may set, and what builds it from them.
TARGET_KINDS: dict[str, tuple[type, Callable[[dict[str, object], torch.device | str], Target]]] = {
    "folder": (FolderSpec, lambda fields, device: load_target_folder(FolderSpec(**fields).folder, device)),
    "llamagen": (LlamaGenSpec, lambda fields, device: build_llamagen_target(LlamaGenSpec(**fields), device)),
    "chameleon": (ChameleonSpec, load_chameleon_target),  # Anole, Lumina-mGPT
    "janus": (JanusSpec, load_janus_target),  # Janus-Pro
    "emu3": (Emu3Spec, load_emu3_target),  # Emu3-Gen
}


def kind_fields(config: Mapping[str, object]) -> dict[str, object]:
    """The keys of target ``config`` its kind reads (its spec's, plus any other set away from the typed
    default, which the spec then refuses): what a model card's snippet must repeat."""
    kind = config.get("kind")
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {kind!r}; use one of {sorted(TARGET_KINDS)}")
    fields = {k: v for k, v in config.items() if k not in ("kind", "quality", "dtype")}
    return own_fields(TARGET_KINDS[kind][0], fields)


def load_target(config: Mapping[str, object], device: str | torch.device = "cpu") -> Target:
    """Build the fp32 target a ``conf/target/*.yaml`` describes (``kind`` one of ``TARGET_KINDS``).

    Its ``dtype`` is checked here but applied by ``cast_for_inference``: training keeps fp32 weights.
    """
    inference_dtype(str(config.get("dtype", "fp32")))
    fields = kind_fields(config)
    return TARGET_KINDS[str(config["kind"])][1](fields, device)
