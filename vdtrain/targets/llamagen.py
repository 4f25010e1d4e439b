"""LlamaGen text-to-image as a target: the GPT, its VQ tokenizer and its caption encoder.

The same adapter serves the released models (flan-t5-xl captions, VQ-16) and the shapes world
(MiniLM captions, a small VQ), so every code path the toy exercises is the one the real model uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vdtrain.models.kv_cache import KVCache
from vdtrain.models.llamagen_gpt import (
    GPTConfig,
    LlamaGenGPT,
    TransformerBlock,
    attention_bias,
    rope_2d_table,
)
from vdtrain.models.llamagen_io import gpt_config_from, load_gpt, load_vq, vq_config_from
from vdtrain.models.text_encoders import HFTextEncoder
from vdtrain.models.vq import VQModel
from vdtrain.sampling_config import SamplingConfig
from vdtrain.targets.base import (
    Condition,
    DraftLayer,
    ImageTokenizer,
    Target,
    TargetIdentity,
    fingerprint,
)

CaptionEncoder = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]


class VQTokenizer(ImageTokenizer):
    def __init__(self, vq: VQModel, image_size: int) -> None:
        super().__init__()
        if image_size % vq.config.downsample:
            raise ValueError(f"image_size {image_size} is not a multiple of {vq.config.downsample}")
        self.vq = vq
        self.image_size = image_size
        side = image_size // vq.config.downsample
        self.grid = (side, side)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.vq.encode(images).flatten(1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens.view(-1, *self.grid)).clamp(-1, 1)

    def codebook(self) -> torch.Tensor:
        return self.vq.quantize.codebook().detach()


def left_pad(features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded caption features → left-padded (real tokens last) with zeroed padding, as LlamaGen
    was trained."""
    length = mask.shape[1]
    n_valid = mask.sum(1, keepdim=True)
    src = (torch.arange(length, device=mask.device)[None] + n_valid) % length
    features = features.gather(1, src[..., None].expand_as(features))
    new_mask = torch.arange(length, device=mask.device)[None] >= (length - n_valid)
    return features * new_mask[..., None].to(features.dtype), new_mask


class LlamaGenDraftLayer(DraftLayer, TransformerBlock):
    """A LlamaGen ``TransformerBlock`` with the target's 2D RoPE table (caption rows as the target's).

    Subclassing keeps the block's parameter names, so saved drafters load unchanged.
    """

    settings_fields = (
        "n_head",
        "n_kv_head",
        "multiple_of",
        "ffn_dim_multiplier",
        "norm_eps",
        "rope_base",
        "caption_rope",
    )

    def __init__(
        self, hidden_size: int, prefix_length: int, grid: tuple[int, int], settings: Mapping[str, Any]
    ) -> None:
        self.check(hidden_size, grid, settings)
        config = self.block_config(hidden_size, prefix_length, grid, settings)
        super().__init__(config)
        self.config = config
        table = rope_2d_table(
            config.grid_size, config.head_dim, config.rope_base, prefix_length, config.caption_rope
        )
        self.register_buffer("rope", table, persistent=False)

    @staticmethod
    def block_config(
        hidden_size: int, prefix_length: int, grid: tuple[int, int], settings: Mapping[str, Any]
    ) -> GPTConfig:
        """A one-layer, dropout-free ``GPTConfig`` of this shape."""
        return GPTConfig(
            dim=hidden_size,
            n_layer=1,
            token_dropout_p=0.0,
            attn_dropout_p=0.0,
            resid_dropout_p=0.0,
            ffn_dropout_p=0.0,
            class_dropout_prob=0.0,
            cls_token_num=prefix_length,
            block_size=grid[0] * grid[1],
            **settings,
        )

    @classmethod
    def check(cls, hidden_size: int, grid: tuple[int, int], settings: Mapping[str, Any]) -> None:
        super().check(hidden_size, grid, settings)
        if grid[0] != grid[1]:
            raise ValueError(f"LlamaGen's 2D RoPE needs a square grid, got {grid}")
        if hidden_size % settings["n_head"]:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by n_head {settings['n_head']}")

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.rope[positions]

    def layer_mask(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return attention_bias(mask, dtype)

    def _apply(self, fn, recurse: bool = True):
        # The RoPE table follows the device but stays fp32: rotations are computed in fp32 (apply_rope).
        table = self.rope
        super()._apply(fn, recurse)
        self.rope = table.to(self.rope.device)
        return self

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, ref = self.config, self.attention_norm.weight
        return KVCache(1, batch, c.kv_heads, max_len, c.head_dim, ref.dtype, ref.device)

    def describe(self) -> str:
        c = self.config
        return (
            f"LlamaGen block: {c.n_head} heads ({c.kv_heads} KV heads), FFN {c.ffn_hidden}, "
            f"2D RoPE base {c.rope_base:g} with {c.caption_rope} caption rows"
        )


class LlamaGenTarget(Target):
    def __init__(
        self,
        gpt: LlamaGenGPT,
        tokenizer: VQTokenizer,
        caption_encoder: CaptionEncoder | None,
        name: str,
        sampling_defaults: SamplingConfig,
    ) -> None:
        super().__init__()
        if tokenizer.grid[0] * tokenizer.grid[1] != gpt.config.block_size:
            raise ValueError(
                f"tokenizer grid {tokenizer.grid} does not give the GPT's "
                f"{gpt.config.block_size} image tokens"
            )
        if gpt.config.vocab_size != tokenizer.vq.config.codebook_size:
            raise ValueError(
                f"GPT vocabulary {gpt.config.vocab_size} != codebook size {tokenizer.vq.config.codebook_size}"
            )
        self.gpt = gpt.eval().requires_grad_(False)
        self.tokenizer = tokenizer.eval().requires_grad_(False)
        self.caption_encoder = caption_encoder
        self.name = name
        self.sampling_defaults = sampling_defaults
        self._identity: TargetIdentity | None = None

    @property
    def identity(self) -> TargetIdentity:
        if self._identity is None:
            c = self.gpt.config
            self._identity = TargetIdentity(
                family="llamagen",
                name=self.name,
                hidden_size=c.dim,
                vocab_size=c.vocab_size,
                grid=self.tokenizer.grid,
                prefix_length=c.cls_token_num,
                head_fingerprint=fingerprint(self.gpt.output.weight),
                num_layers=len(self.gpt.layers),
            )
        return self._identity

    @property
    def transformer(self) -> nn.Module:
        return self.gpt

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.gpt.tok_embeddings

    @property
    def head(self) -> nn.Module:
        return self.gpt.output

    def use_dtype(self, dtype: torch.dtype) -> LlamaGenTarget:
        """Run the GPT (weights, KV cache, hidden states) in ``dtype``; logits stay fp32.

        The identity is fixed first, from the checkpoint's own weights, so a drafter trained against the
        fp32 target still matches. The RoPE table stays fp32 (rotations are computed in fp32 anyway), and
        the VQ tokenizer and caption encoder are left alone: they run once per image, not per step.
        """
        _ = self.identity
        rope = self.gpt.rope
        self.gpt.to(dtype=dtype)
        self.gpt.rope = rope
        return self

    def encode_captions(self, captions: list[str]) -> Condition:
        if self.caption_encoder is None:
            raise RuntimeError(f"target {self.name!r} was built without a caption encoder")
        features, mask = self.caption_encoder(list(captions))
        if features.shape[1] != self.prefix_length:
            raise ValueError(
                f"caption encoder gives {features.shape[1]} rows but the GPT expects {self.prefix_length}"
            )
        features, mask = left_pad(features.to(self.device), mask.to(self.device))
        return Condition(features, mask, list(captions))

    def null_condition(self, cond: Condition) -> Condition:
        # LlamaGen's CFG keeps the caption's mask for its null stream; we follow the released behaviour.
        null = self.gpt.cls_embedding.uncond_embedding.to(cond.features.dtype)
        return Condition(null.expand_as(cond.features).clone(), cond.mask.clone())

    def prefix_inputs(self, cond: Condition) -> torch.Tensor:
        return self.gpt.embed_caption(cond.features.to(self.dtype))


# --- building from files ----------------------------------------------------------------------------


@dataclass
class LlamaGenSpec:
    """Everything needed to assemble a LlamaGen target from local files (mirrors ``conf/target``)."""

    name: str
    gpt_ckpt: str
    vq_ckpt: str
    gpt_preset: str | None = "GPT-XL"
    gpt: dict[str, object] = field(default_factory=dict)  # GPTConfig overrides
    vq_preset: str | None = "VQ-16"
    vq: dict[str, object] = field(default_factory=dict)  # VQConfig overrides
    image_size: int = 256
    text_encoder_path: str | None = None
    text_encoder_kind: str = "t5"
    text_preprocessing: str = "llamagen"  # llamagen (the official caption cleaning) | lowercase | none
    caption_overflow: str = "truncate"
    sampling: dict[str, float] = field(default_factory=dict)


def build_llamagen_target(spec: LlamaGenSpec, device: str | torch.device = "cpu") -> LlamaGenTarget:
    gpt_cfg = gpt_config_from(spec.gpt_preset, dict(spec.gpt))
    gpt = load_gpt(spec.gpt_ckpt, gpt_cfg)
    vq = load_vq(spec.vq_ckpt, vq_config_from(spec.vq_preset, dict(spec.vq)))
    encoder = None
    if spec.text_encoder_path is not None:
        encoder = HFTextEncoder(
            spec.text_encoder_path,
            spec.text_encoder_kind,
            max_length=gpt_cfg.cls_token_num,
            text_preprocessing=spec.text_preprocessing,
            on_overflow=spec.caption_overflow,
        )
        if encoder.dim != gpt_cfg.caption_dim:
            raise ValueError(
                f"text encoder width {encoder.dim} != the GPT's caption_dim {gpt_cfg.caption_dim}"
            )
    target = LlamaGenTarget(
        gpt, VQTokenizer(vq, spec.image_size), encoder, spec.name, SamplingConfig(**spec.sampling)
    )
    return target.to(device)
