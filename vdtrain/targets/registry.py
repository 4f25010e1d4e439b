"""The target kinds a ``conf/target/*.yaml`` names, each with the spec of its keys (its config schema),
what builds it, and the drafter layer of each family it makes; and loading a target for a run.

A new target kind is one line in ``TARGET_KINDS`` (docs/extending.md, "Adding a target").
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vdtrain.config import TargetConfig, UnknownConfigKeyError
from vdtrain.devices import pick_device
from vdtrain.targets.base import DraftLayer, Target
from vdtrain.targets.chameleon import FAMILIES as CHAMELEON_FAMILIES
from vdtrain.targets.chameleon import ChameleonDraftLayer, ChameleonSpec, build_chameleon_target
from vdtrain.targets.emu3 import FAMILY as EMU3_FAMILY
from vdtrain.targets.emu3 import Emu3DraftLayer, Emu3Spec, build_emu3_target
from vdtrain.targets.janus import FAMILY as JANUS_FAMILY
from vdtrain.targets.janus import JanusDraftLayer, JanusSpec, build_janus_target
from vdtrain.targets.llamagen import LlamaGenDraftLayer, LlamaGenSpec, build_llamagen_target
from vdtrain.targets.shapes import FolderSpec, build_folder_target


@dataclasses.dataclass(frozen=True)
class TargetKind:
    """One ``kind``: ``spec`` is the dataclass of the keys its config may set besides ``TargetConfig``'s,
    ``build`` makes the fp32 target from a ``spec``, ``draft_layers`` maps each family it makes
    (``TargetIdentity.family``) to the drafter's decoder layer."""

    spec: type
    build: Callable[[Any, torch.device | str], Target]
    draft_layers: Mapping[str, type[DraftLayer]]


TARGET_KINDS: dict[str, TargetKind] = {
    "folder": TargetKind(FolderSpec, build_folder_target, {}),  # the shapes world's format (llamagen)
    "llamagen": TargetKind(LlamaGenSpec, build_llamagen_target, {"llamagen": LlamaGenDraftLayer}),
    "chameleon": TargetKind(  # Anole, Lumina-mGPT
        ChameleonSpec, build_chameleon_target, dict.fromkeys(CHAMELEON_FAMILIES, ChameleonDraftLayer)
    ),
    "janus": TargetKind(JanusSpec, build_janus_target, {JANUS_FAMILY: JanusDraftLayer}),  # Janus-Pro
    "emu3": TargetKind(Emu3Spec, build_emu3_target, {EMU3_FAMILY: Emu3DraftLayer}),  # Emu3-Gen
}

SHARED_KEYS = tuple(f.name for f in dataclasses.fields(TargetConfig))


def draft_layers() -> dict[str, type[DraftLayer]]:
    """The drafter's decoder layer per target family (``TargetIdentity.family``), over every kind."""
    return {family: layer for kind in TARGET_KINDS.values() for family, layer in kind.draft_layers.items()}


def draft_layer_class(family: str) -> type[DraftLayer]:
    """The drafter layer of target family ``family``; a clear error for a family without one."""
    layers = draft_layers()
    if family not in layers:
        raise ValueError(f"no drafter layer for target family {family!r}; known: {sorted(layers)}")
    return layers[family]


def target_kind(config: Mapping[str, object]) -> tuple[str, TargetKind]:
    kind = str(config.get("kind", TargetConfig.kind))
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {kind!r}; use one of {sorted(TARGET_KINDS)}")
    return kind, TARGET_KINDS[kind]


def kind_config(config: Mapping[str, object]) -> dict[str, object]:
    """The ``kind`` of target ``config`` and the keys its spec reads: what a model card's snippet repeats.

    A drafter exported before targets owned their config recorded every kind's keys at their defaults;
    those belong to no spec of this kind and are left out."""
    kind, entry = target_kind(config)
    names = {f.name for f in dataclasses.fields(entry.spec)}
    return {"kind": kind, **{k: v for k, v in config.items() if k in names}}


def parse_target_config(config: Mapping[str, object]) -> tuple[TargetConfig, TargetKind, Any]:
    """The shared keys, the kind and its spec of a ``conf/target/*.yaml``; a key that neither
    ``TargetConfig`` nor the kind's spec declares is an ``UnknownConfigKeyError`` naming the kind."""
    kind, entry = target_kind(config)
    names = [f.name for f in dataclasses.fields(entry.spec)]
    unknown = [k for k in config if k not in SHARED_KEYS and k not in names]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), [*names, *SHARED_KEYS], n=3, cutoff=0.6)
            hints.append(f"target.{key}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise UnknownConfigKeyError(
            f"unknown key(s) for a target of kind {kind!r}: {'; '.join(hints)}; a {kind!r} target takes "
            f"{', '.join(names)} and the shared {', '.join(SHARED_KEYS)}"
        )
    shared = TargetConfig(**{k: v for k, v in config.items() if k in SHARED_KEYS})
    spec = entry.spec(**{k: v for k, v in config.items() if k in names})
    return shared, entry, spec


def load_target(config: Mapping[str, object], device: str | torch.device = "cpu") -> Target:
    """Build the fp32 target a ``conf/target/*.yaml`` describes (``kind`` one of ``TARGET_KINDS``).

    Its ``dtype`` is checked here but applied by ``cast_for_inference`` (fit: ``trainer.target_dtype`` or it).
    """
    shared, entry, spec = parse_target_config(config)
    inference_dtype(shared.dtype)
    return entry.build(spec, device)


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

    ``apply_dtype`` casts it to ``target.dtype`` (generate, evaluate, data_prep.features); export keeps the
    checkpoint's fp32 (it writes the drafter, whose card records the target's fp32 identity).
    """
    from omegaconf import OmegaConf

    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    target = load_target(OmegaConf.to_container(cfg.target), pick_device(cfg.get("device", "auto")))
    return cast_for_inference(target, cfg.target.get("dtype", "fp32")) if apply_dtype else target
