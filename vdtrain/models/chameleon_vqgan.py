"""Chameleon's VQGAN (encoder and decoder) in Meta's key layout, for encoding and decoding images.

transformers' ``ChameleonVQVAE`` has only the encoder, so it cannot turn generated tokens back into an
image. The released decoders come in two layouts with the same module tree: Meta's ``vqgan.ckpt``
(``encoder.*``, ``decoder.*``, ``quantize.embedding.weight``, ``quant_conv``, ``post_quant_conv``, under
``state_dict``; Lumina-mGPT uses it) and Anole's HF checkpoint, which carries the same keys under
``model.vqmodel.`` (``vqmodel.decoder.*`` included). Images are in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ChameleonVQConfig:
    embed_dim: int = 256
    num_embeddings: int = 8192
    latent_channels: int = 256
    base_channels: int = 128
    channel_multiplier: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = field(default_factory=tuple)
    resolution: int = 512
    in_channels: int = 3
    out_channels: int = 3

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.channel_multiplier) - 1)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1, 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, height, width = x.shape
        q, k, v = (m(h).reshape(b, c, height * width).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q kᵀ / sqrt(c)) v
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, height, width))


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 2, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # the original's asymmetric padding


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _middle(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels)
    mid.attn_1 = AttnBlock(channels)
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


class Encoder(nn.Module):
    def __init__(self, c: ChameleonVQConfig) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(c.in_channels, c.base_channels, 3, 1, 1)
        mults = (1, *c.channel_multiplier)
        res, self.down = c.resolution, nn.ModuleList()
        for level, mult in enumerate(c.channel_multiplier):
            stage, block_in = nn.Module(), c.base_channels * mults[level]
            stage.block, stage.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(c.num_res_blocks):
                stage.block.append(ResnetBlock(block_in, c.base_channels * mult))
                block_in = c.base_channels * mult
                if res in c.attn_resolutions:
                    stage.attn.append(AttnBlock(block_in))
            if level != len(c.channel_multiplier) - 1:
                stage.downsample = Downsample(block_in)
                res //= 2
            self.down.append(stage)
        self.mid = _middle(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.latent_channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.down:
            for i, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, c: ChameleonVQConfig) -> None:
        super().__init__()
        levels = len(c.channel_multiplier)
        block_in = c.base_channels * c.channel_multiplier[-1]
        res = c.resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(c.latent_channels, block_in, 3, 1, 1)
        self.mid = _middle(block_in)
        up: list[nn.Module] = []
        for level in reversed(range(levels)):
            stage, block_out = nn.Module(), c.base_channels * c.channel_multiplier[level]
            stage.block, stage.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(c.num_res_blocks + 1):
                stage.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if res in c.attn_resolutions:
                    stage.attn.append(AttnBlock(block_in))
            if level != 0:
                stage.upsample = Upsample(block_in)
                res *= 2
            up.insert(0, stage)  # indexed by level, as in the checkpoint
        self.up = nn.ModuleList(up)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.out_channels, 3, 1, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for stage in reversed(self.up):
            for i, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Quantizer(nn.Module):
    def __init__(self, c: ChameleonVQConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c.num_embeddings, c.embed_dim)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Codebook indices [B, h, w] of latents ``z`` [B, d, h, w] (squared distance, as released)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        codes = self.embedding.weight
        dist = flat.pow(2).sum(1, keepdim=True) + codes.pow(2).sum(1) - 2 * flat @ codes.t()
        return dist.argmin(1).view(z.shape[0], z.shape[2], z.shape[3])


class ChameleonVQGAN(nn.Module):
    def __init__(self, config: ChameleonVQConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = Quantizer(config)
        self.quant_conv = nn.Conv2d(config.latent_channels, config.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.latent_channels, 1)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] → codebook indices [B, H/16, W/16]."""
        return self.quantize.nearest(self.quant_conv(self.encoder(images)))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codebook indices [B, h, w] → images [B, 3, 16h, 16w] (unclamped)."""
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))
