"""Emu3's VQ as a module: transformers' ``Emu3VQVAE`` wrapped so ``ChameleonTokenizer`` can drive it.

Emu3's decoder is Llama, which is Chameleon's (``vdtrain.models.chameleon``, ``qk_norm=False``); its
released files are read by ``emu3_io``. The VQ is a video tokenizer (an image is repeated over 4 frames
and downsampled in time to one); it is not on the decoding hot path, and transformers is a runtime
dependency already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class VQShape:
    """What ``ChameleonTokenizer`` reads of a VQ's config."""

    downsample: int
    num_embeddings: int


class Emu3VQ(nn.Module):
    """transformers' ``Emu3VQVAE`` for still images: [B, 3, H, W] in [-1, 1] ↔ codes [B, h, w]."""

    def __init__(self, vq_config: Mapping[str, object]) -> None:
        super().__init__()
        from transformers import Emu3VQVAE, Emu3VQVAEConfig

        self.model = Emu3VQVAE(Emu3VQVAEConfig.from_dict(dict(vq_config))).eval()
        self.config = VQShape(self.model.spatial_scale_factor, self.model.config.codebook_size)

    @property
    def quantize(self) -> nn.Module:
        return self.model.quantize

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        sizes = torch.tensor([images.shape[-2:]] * len(images))
        return torch.stack(self.model.encode(images, sizes).image_tokens)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.decode(codes)
