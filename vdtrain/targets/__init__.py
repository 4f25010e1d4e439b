"""Targets: the visual AR models vdtrain accelerates, behind one interface (``base.Target``); the kinds a
config may name are in ``registry``."""

from vdtrain.targets.base import (
    Condition,
    DraftLayer,
    ImageTokenizer,
    Target,
    TargetIdentity,
    TargetOutput,
)
from vdtrain.targets.llamagen import LlamaGenSpec, LlamaGenTarget, build_llamagen_target
from vdtrain.targets.registry import (
    TARGET_KINDS,
    TargetKind,
    cast_for_inference,
    draft_layer_class,
    draft_layers,
    inference_dtype,
    kind_config,
    load_target,
    pick_device,
    target_for_run,
)
from vdtrain.targets.shapes import load_target_folder

__all__ = [
    "TARGET_KINDS",
    "Condition",
    "DraftLayer",
    "ImageTokenizer",
    "LlamaGenSpec",
    "LlamaGenTarget",
    "Target",
    "TargetIdentity",
    "TargetKind",
    "TargetOutput",
    "build_llamagen_target",
    "cast_for_inference",
    "draft_layer_class",
    "draft_layers",
    "inference_dtype",
    "kind_config",
    "load_target",
    "load_target_folder",
    "pick_device",
    "target_for_run",
]
