"""LlamaGen's VQ image tokenizer (VQ-16 and smaller variants), with the official parameter names.

One implementation serves the released VQ-16 (16× down-sampling, 16384 × 8 L2-normalised codebook)
and the shapes world's small tokenizer (4× down-sampling, a few hundred codes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    ch: int = 128
    ch_mult: tuple[int, ...] = field(default=(1, 1, 2, 2, 4))
    num_res_blocks: int = 2
    z_channels: int = 256
    norm_groups: int = 32
    dropout_p: float = 0.0

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


VQ_PRESETS: dict[str, dict[str, object]] = {
    "VQ-16": {"ch_mult": (1, 1, 2, 2, 4)},
    "VQ-8": {"ch_mult": (1, 2, 2, 4)},
}


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=1e-6)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=1e-6)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions."""

    def __init__(self, ch: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, ch, eps=1e-6)
        self.q = nn.Conv2d(ch, ch, 1)
        self.k = nn.Conv2d(ch, ch, 1)
        self.v = nn.Conv2d(ch, ch, 1)
        self.proj_out = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (proj(y).flatten(2).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding, as in the original


class Upsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(res: list[nn.Module], attn: list[nn.Module]) -> nn.Module:
    level = nn.Module()
    level.res = nn.ModuleList(res)
    level.attn = nn.ModuleList(attn)
    return level


class Encoder(nn.Module):
    def __init__(self, c: VQConfig) -> None:
        super().__init__()
        g, last = c.norm_groups, len(c.ch_mult) - 1
        self.conv_in = nn.Conv2d(3, c.ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        block_in = c.ch
        for i, mult in enumerate(c.ch_mult):
            res, attn = [], []
            for _ in range(c.num_res_blocks):
                res.append(ResnetBlock(block_in, c.ch * mult, g, c.dropout_p))
                block_in = c.ch * mult
                if i == last:
                    attn.append(AttnBlock(block_in, g))
            level = _level(res, attn)
            if i != last:
                level.downsample = Downsample(block_in)
            self.conv_blocks.append(level)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, g, c.dropout_p),
                AttnBlock(block_in, g),
                ResnetBlock(block_in, block_in, g, c.dropout_p),
            ]
        )
        self.norm_out = nn.GroupNorm(g, block_in, eps=1e-6)
        self.conv_out = nn.Conv2d(block_in, c.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            for j, res in enumerate(level.res):
                h = res(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, c: VQConfig) -> None:
        super().__init__()
        g, last = c.norm_groups, len(c.ch_mult) - 1
        block_in = c.ch * c.ch_mult[-1]
        self.conv_in = nn.Conv2d(c.z_channels, block_in, 3, padding=1)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, g, c.dropout_p),
                AttnBlock(block_in, g),
                ResnetBlock(block_in, block_in, g, c.dropout_p),
            ]
        )
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(c.ch_mult))):
            res, attn = [], []
            for _ in range(c.num_res_blocks + 1):
                res.append(ResnetBlock(block_in, c.ch * c.ch_mult[i], g, c.dropout_p))
                block_in = c.ch * c.ch_mult[i]
                if i == last:
                    attn.append(AttnBlock(block_in, g))
            level = _level(res, attn)
            if i != 0:
                level.upsample = Upsample(block_in)
            self.conv_blocks.append(level)
        self.norm_out = nn.GroupNorm(g, block_in, eps=1e-6)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            for j, res in enumerate(level.res):
                h = res(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, c: VQConfig) -> None:
        super().__init__()
        self.l2_norm = c.codebook_l2_norm
        self.embedding = nn.Embedding(c.codebook_size, c.codebook_embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / c.codebook_size, 1.0 / c.codebook_size)
        if c.codebook_show_usage:
            # Bookkeeping buffer of the official trainer; kept so released checkpoints load strictly.
            self.register_buffer("codebook_used", torch.zeros(65536))

    def codebook(self) -> torch.Tensor:
        """The code vectors as the quantiser compares them (L2-normalised when configured)."""
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def nearest(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``z`` [..., dim] → (indices [...], the (normalised) ``z`` that was compared)."""
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        book = self.codebook()
        dist = z.pow(2).sum(-1, keepdim=True) + book.pow(2).sum(-1) - 2 * z @ book.t()
        return dist.argmin(-1), z


class VQModel(nn.Module):
    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    def encode_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], [B, 3, H, W] → pre-quantisation latents [B, h, w, embed_dim]."""
        return self.quant_conv(self.encoder(images)).permute(0, 2, 3, 1)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] → token ids [B, h, w]."""
        indices, _ = self.quantize.nearest(self.encode_latents(images))
        return indices

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Quantised latents [B, h, w, embed_dim] → images in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latents.permute(0, 3, 1, 2)))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [B, h, w] → images in about [-1, 1]."""
        return self.decode_latents(self.quantize.codebook()[tokens])
