"""Chameleon-family targets (Anole, Lumina-mGPT): one decoder, two token layouts and guidance rules.

The condition prefix is the prompt's BPE ids, embedded and left-padded to ``prefix_length`` rows:
``[bos] + text + image prefix``, where the image prefix is ``[boi]`` (Anole) or ``[boi, size_h, size_w]``
(Lumina-mGPT). Padded rows are hidden from every query, and since RoPE is relative, a left-padded prompt
gives the logits of the unpadded one.

The target's token space is not the BPE vocabulary: index ``c < codebook size`` is VQGAN code ``c`` (BPE id
from the token *name*, ``IMGIMG…Z``), and Lumina-mGPT adds one more index for its end-of-row token. Its
image sequence is ``h`` rows of ``w`` codes, each followed by that token, so the target grid is
``(h, w + 1)``; the tokenizer adds and strips the column. Forced tokens are part of the target's logits:
a row whose next token is forced holds 0 for that token and ``FORCED_LOGIT`` elsewhere, and rows that
must not emit the end-of-row token hold ``FORCED_LOGIT`` for it, in every guidance stream. Any guidance
combination of such rows is the same row (no inf − inf): a forced token gets probability exactly 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM, DecoderLayer, rope_cos_sin
from vdtrain.models.chameleon_io import (
    chameleon_config,
    load_chameleon_lm,
    load_vqgan_hf,
    load_vqgan_meta,
    read_hf_config,
    read_hf_weights,
    text_tokenizer,
    vocabulary_map,
)
from vdtrain.models.chameleon_vocab import image_token_ids, token_id
from vdtrain.models.chameleon_vqgan import ChameleonVQGAN
from vdtrain.models.kv_cache import KVCache
from vdtrain.sampling_config import SamplingConfig
from vdtrain.targets.base import (
    Condition,
    DraftLayer,
    ImageTokenizer,
    Target,
    TargetIdentity,
    fingerprint,
)
from vdtrain.targets.token_prompts import check_caption_overflow, fit_text, left_padded

FAMILIES = ("anole", "lumina_mgpt")
FORCED_LOGIT = -1e9  # finite, so u + s·(c − u) of two forced rows is that row, never NaN
BOS, BOI = "<s>", "<racm3:break>"
LUMINA_NEWLINE = "<reserved08799>"
LUMINA_END_OF_TURN = "<reserved08706>"  # Lumina-mGPT's conversation separator after the human turn
LUMINA_PROMPT = "Generate an image of {width}x{height} according to the following prompt:\n{text}"
LUMINA_SIZE_PATCH = 32  # size tokens count 32-pixel patches: <reserved{8800 + n}>


def lumina_size_token(pixels: int) -> str:
    if pixels % LUMINA_SIZE_PATCH:
        raise ValueError(f"Lumina-mGPT image sides are multiples of {LUMINA_SIZE_PATCH} pixels, got {pixels}")
    return f"<reserved{8800 + pixels // LUMINA_SIZE_PATCH:05d}>"


@dataclass(frozen=True)
class Guidance:
    """How a family combines its guidance streams' raw logits; the text scale is the sampling config's
    ``cfg_scale`` (its one home), ``image_scales`` are the family's further ones.

    Streams ``s_0`` (the full prompt) … ``s_n`` (the null prompt) give
    ``s_n + Σ_k scales[k]·(s_k − s_{k+1})`` with ``scales = (cfg_scale, *image_scales)``.
    Lumina-mGPT and Emu3: no image scale, ``u + s(c − u)``. Anole: Meta's instruct CFG over (full,
    image-only, null) with image scale 1.2: ``u + 1.2(i − u) + s(f − i)`` (Meta's s is 3.0).
    """

    image_scales: tuple[float, ...] = ()

    def combine(self, streams: Sequence[torch.Tensor], cfg_scale: float) -> torch.Tensor:
        scales = (cfg_scale, *self.image_scales)
        if len(streams) != len(scales) + 1:
            raise ValueError(f"guidance with {len(scales)} scales takes {len(scales) + 1} streams")
        out = streams[-1]
        for scale, hi, lo in zip(scales, streams[:-1], streams[1:], strict=True):
            out = out + scale * (hi - lo)
        return out


@dataclass(frozen=True)
class ChameleonLayout:
    """Where a family puts its prompt, image and special tokens (BPE ids)."""

    family: str
    latent: tuple[int, int]  # VQ code grid (h, w)
    bos: int
    image_prefix: tuple[int, ...]  # closes the prompt: (boi,) or (boi, size_h, size_w)
    null_prompt: tuple[int, ...]  # the unconditional stream's whole context
    newline: int | None  # Lumina-mGPT's end-of-row token, forced after every w codes
    prompt_template: str  # {text}, {width}, {height}
    guidance: Guidance

    @property
    def grid(self) -> tuple[int, int]:
        h, w = self.latent
        return (h, w + 1) if self.newline is not None else (h, w)


def chameleon_layout(family: str, vocab: dict[str, int], image_size: int, downsample: int) -> ChameleonLayout:
    if family not in FAMILIES:
        raise ValueError(f"unknown Chameleon family {family!r}; use one of {FAMILIES}")
    if image_size % downsample:
        raise ValueError(
            f"image_size {image_size} is not a multiple of the VQGAN's downsampling {downsample}"
        )
    side = image_size // downsample
    bos, boi = token_id(vocab, BOS), token_id(vocab, BOI)
    if family == "anole":
        # Meta's image generation: [bos] + prompt + [boi]; its image-only and null streams are [bos, boi].
        return ChameleonLayout(
            family, (side, side), bos, (boi,), (bos, boi), None, "{text}", Guidance((1.2,))
        )
    size = token_id(vocab, lumina_size_token(image_size))
    prefix = (boi, size, size)  # height, then width
    template = LUMINA_PROMPT + LUMINA_END_OF_TURN
    # Lumina-mGPT's unbatched CFG: the null context starts at the image start token, without text.
    return ChameleonLayout(
        family, (side, side), bos, prefix, prefix, token_id(vocab, LUMINA_NEWLINE), template, Guidance()
    )


class ChameleonTokenizer(ImageTokenizer):
    """The Chameleon VQGAN in the target's token space (with Lumina-mGPT's end-of-row column)."""

    def __init__(self, vqgan: ChameleonVQGAN, image_size: int, newline_column: bool) -> None:
        super().__init__()
        down = vqgan.config.downsample
        if image_size % down:
            raise ValueError(f"image_size {image_size} is not a multiple of the VQGAN's downsampling {down}")
        self.vqgan = vqgan
        self.image_size = image_size
        self.latent = (image_size // down, image_size // down)
        self.newline_column = newline_column
        self.codebook_size = vqgan.config.num_embeddings
        self.grid = (self.latent[0], self.latent[1] + int(newline_column))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        codes = self.vqgan.encode(images)
        if self.newline_column:
            codes = torch.cat([codes, torch.full_like(codes[..., :1], self.codebook_size)], dim=-1)
        return codes.flatten(1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        grid = tokens.view(-1, *self.grid)
        if self.newline_column:
            grid = grid[..., :-1]
        bad = (grid < 0) | (grid >= self.codebook_size)
        if bad.any():
            raise ValueError(
                f"{int(bad.sum())} image positions hold non-code tokens (e.g. {int(grid[bad][0])}); "
                f"codes are 0..{self.codebook_size - 1}"
            )
        return self.vqgan.decode(grid).clamp(-1, 1)

    def codebook(self) -> torch.Tensor:
        codes = self.vqgan.quantize.embedding.weight.detach()
        if not self.newline_column:
            return codes
        # The end-of-row token has no code vector; put it far from every code so it is nobody's neighbour.
        far = codes.abs().max() * 1e3 + 1.0
        return torch.cat([codes, torch.full_like(codes[:1], float(far))])


class ChameleonDraftLayer(DraftLayer, DecoderLayer):
    """A Chameleon decoder layer (q/k head norms, SwiGLU, 1D RoPE over slots) for the drafter."""

    settings_fields = (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "swin_norm",
        "attention_bias",
        "mlp_bias",
    )

    def __init__(
        self, hidden_size: int, prefix_length: int, grid: tuple[int, int], settings: Mapping[str, Any]
    ) -> None:
        self.check(hidden_size, grid, settings)
        config = ChameleonConfig(hidden_size=hidden_size, num_hidden_layers=1, **settings)
        super().__init__(config)
        self.config = config

    @classmethod
    def check(cls, hidden_size: int, grid: tuple[int, int], settings: Mapping[str, Any]) -> None:
        super().check(hidden_size, grid, settings)
        ChameleonConfig(hidden_size=hidden_size, num_hidden_layers=1, **settings)  # its own checks

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, ref = self.config, self.input_layernorm.weight
        return KVCache(1, batch, c.num_key_value_heads, max_len, c.head_dim, ref.dtype, ref.device)

    def describe(self) -> str:
        c = self.config
        return (
            f"Chameleon decoder layer: {c.num_attention_heads} heads ({c.num_key_value_heads} KV heads), "
            f"FFN {c.intermediate_size}, q/k head norms, RoPE theta {c.rope_theta:g}"
        )


class ChameleonTarget(Target):
    def __init__(
        self,
        lm: ChameleonLM,
        tokenizer: ChameleonTokenizer,
        layout: ChameleonLayout,
        image_ids: torch.Tensor,
        encode_text: Callable[[str], list[int]] | None,
        *,
        name: str,
        prefix_length: int,
        sampling_defaults: SamplingConfig,
        caption_overflow: str = "error",
    ) -> None:
        super().__init__()
        if tokenizer.grid != layout.grid:
            raise ValueError(f"tokenizer grid {tokenizer.grid} != the {layout.family} layout's {layout.grid}")
        check_caption_overflow(caption_overflow)
        # the null prompt, or bos + one text token + the image prefix
        frame = max(len(layout.null_prompt), 2 + len(layout.image_prefix))
        if prefix_length < frame:
            raise ValueError(f"prefix_length {prefix_length} < {frame}, the shortest {layout.family} prompt")
        self.lm = lm.eval().requires_grad_(False)
        self.tokenizer = tokenizer.eval().requires_grad_(False)
        self.layout = layout
        self.encode_text = encode_text
        self.name = name
        self.sampling_defaults = sampling_defaults
        self.caption_overflow = caption_overflow
        self._prefix_length = prefix_length
        # Target index → BPE id: the codes by name, then Lumina-mGPT's end-of-row token.
        extra = [] if layout.newline is None else [layout.newline]
        vocab_ids = torch.cat([image_ids, torch.tensor(extra, dtype=torch.long)]).to(lm.lm_head.weight.device)
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)
        dim = lm.config.hidden_size
        device = lm.lm_head.weight.device  # made there: a meta decoder (the memory plan's) has no data
        self.image_embedding = nn.Embedding(len(vocab_ids), dim, device=device).requires_grad_(False)
        self.image_head = nn.Linear(dim, len(vocab_ids), bias=False, device=device).requires_grad_(False)
        with torch.no_grad():
            self.image_embedding.weight.copy_(lm.model.embed_tokens.weight[vocab_ids])
            self.image_head.weight.copy_(lm.lm_head.weight[vocab_ids])
        self.to(lm.lm_head.weight.device)
        self._identity: TargetIdentity | None = None

    # --- shape ------------------------------------------------------------------------------------
    @property
    def identity(self) -> TargetIdentity:
        if self._identity is None:
            self._identity = TargetIdentity(
                family=self.layout.family,
                name=self.name,
                hidden_size=self.lm.config.hidden_size,
                vocab_size=len(self.vocab_ids),
                grid=self.layout.grid,
                prefix_length=self._prefix_length,
                head_fingerprint=fingerprint(self.image_head.weight),
                num_layers=len(self.lm.model.layers),
            )
        return self._identity

    @property
    def transformer(self) -> nn.Module:
        return self.lm.model  # the decoder; image logits come from ``image_head`` (rows of ``lm_head``)

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.image_embedding

    @property
    def head(self) -> nn.Module:
        return self.image_head

    def use_dtype(self, dtype: torch.dtype) -> ChameleonTarget:
        """Run the decoder and its image-token embedding/head in ``dtype``; logits stay fp32, RoPE angles
        are computed in fp32, the VQGAN is left alone, and the identity is the fp32 weights'."""
        _ = self.identity
        for module in (self.lm, self.image_embedding, self.image_head):
            module.to(dtype=dtype)
        return self

    @property
    def guidance(self) -> Guidance:
        """The family's guidance rule; its text scale is ``sampling_defaults.cfg_scale``."""
        return self.layout.guidance

    def forced_tokens(self, image_index: torch.Tensor) -> torch.Tensor:
        """The token forced at each image index (Lumina-mGPT's end of row), −1 where sampling is free.

        The drafter never needs to propose these, and verification may accept them unconditionally:
        the target's p is one-hot there.
        """
        forced = torch.full_like(image_index, -1)
        if self.layout.newline is None:
            return forced
        w = self.layout.grid[1]
        inside = (image_index >= 0) & (image_index < self.num_image_tokens)
        return forced.masked_fill(inside & (image_index % w == w - 1), len(self.vocab_ids) - 1)

    # --- conditioning -----------------------------------------------------------------------------
    def prompt_ids(self, caption: str) -> list[int]:
        """``[bos] + text + image prefix`` as the official pipeline tokenizes it."""
        if self.encode_text is None:
            raise RuntimeError(f"target {self.name!r} was built without a text tokenizer")
        side = self.tokenizer.image_size
        text = self.encode_text(self.layout.prompt_template.format(text=caption, width=side, height=side))
        room = self._prefix_length - 1 - len(self.layout.image_prefix)
        text = fit_text(text, room, self.caption_overflow, self._prefix_length, caption)
        return [self.layout.bos, *text, *self.layout.image_prefix]

    def condition_from_ids(
        self, prompts: Sequence[Sequence[int]], captions: list[str] | None = None
    ) -> Condition:
        """Left-padded, embedded prompts (zero rows and a False mask where padded)."""
        ids, mask = left_padded(prompts, self._prefix_length, self.device)
        features = self.lm.model.embed_tokens(ids) * mask[..., None].to(self.lm.lm_head.weight.dtype)
        return Condition(features, mask, captions)

    def encode_captions(self, captions: list[str]) -> Condition:
        return self.condition_from_ids([self.prompt_ids(c) for c in captions], list(captions))

    def null_condition(self, cond: Condition) -> Condition:
        return self.condition_from_ids([self.layout.null_prompt] * len(cond))

    def guidance_streams(self, cond: Condition) -> list[Condition]:
        """The conditions ``guidance.combine`` expects, in order.

        Anole's image-only stream keeps a prompt's bos, boi, eoi and image tokens (Meta's
        ``_split_inputs_for_cfg``); for a text prompt that is ``[bos, boi]``, the null stream, so Anole's
        rule equals ``u + s·(f − u)``: plain CFG with ``s = cfg_scale``.
        """
        null = self.null_condition(cond)
        return [cond, null, null] if self.layout.family == "anole" else [cond, null]

    # --- forward passes ---------------------------------------------------------------------------
    def constrain_logits(self, logits: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
        """Rows predicting a forced index hold 0 for its token and ``FORCED_LOGIT`` elsewhere; the others
        hold ``FORCED_LOGIT`` for the end-of-row token (any ``predicts`` outside ``0 .. N-1`` is free)."""
        if self.layout.newline is None:
            return logits
        newline = len(self.vocab_ids) - 1
        logits = logits.clone()
        logits[..., newline] = FORCED_LOGIT
        forced_row = torch.full((newline + 1,), FORCED_LOGIT, dtype=logits.dtype, device=logits.device)
        forced_row[newline:].fill_(0.0)  # ``[newline] = 0.0`` copied a host scalar: a capture refuses it
        forced = (self.forced_tokens(predicts) == newline).expand(logits.shape[:-1])
        return torch.where(forced[..., None], forced_row, logits)


# --- building from files ----------------------------------------------------------------------------


@dataclass
class ChameleonSpec:
    """A Chameleon-family target from local files (mirrors ``conf/target/{anole,lumina_mgpt}.yaml``)."""

    name: str
    family: str  # anole | lumina_mgpt
    model_dir: str  # HF folder: config.json + model.safetensors (or shards with an index)
    tokenizer_file: str | None = None  # tokenizer.json; default: the one in model_dir
    vqgan_ckpt: str | None = None  # Meta's vqgan.ckpt; None: model_dir's model.vqmodel.* (Anole)
    vqgan_config: str | None = None  # Meta's vqgan.yaml, with vqgan_ckpt
    image_size: int = 512
    prefix_length: int = 128
    caption_overflow: str = "error"
    sampling: dict[str, float] = field(default_factory=dict)


def build_chameleon_target(spec: ChameleonSpec, device: str | torch.device = "cpu") -> ChameleonTarget:
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown Chameleon family {spec.family!r}; use one of {FAMILIES}")
    config = read_hf_config(spec.model_dir)
    state = read_hf_weights(spec.model_dir)
    lm_config = chameleon_config(config)
    layout_kind = "per_head" if spec.family == "anole" else "per_shard"
    lm = load_chameleon_lm(lm_config, state, layout_kind, f"{spec.family} decoder ({spec.model_dir})")
    if spec.vqgan_ckpt is not None:
        if spec.vqgan_config is None:
            raise ValueError("vqgan_ckpt needs vqgan_config (Meta's vqgan.yaml)")
        vqgan = load_vqgan_meta(spec.vqgan_ckpt, spec.vqgan_config)
    else:
        vqgan = load_vqgan_hf(config, state, f"{spec.family} VQGAN ({spec.model_dir})")
    del state
    tok_path = spec.tokenizer_file or os.path.join(spec.model_dir, "tokenizer.json")
    has_tokenizer = os.path.isfile(tok_path)
    if spec.tokenizer_file is not None and not has_tokenizer:
        raise CheckpointError(f"text tokenizer not found: {spec.tokenizer_file!r}")
    vocab = vocabulary_map(config, tok_path if has_tokenizer else None)
    layout = chameleon_layout(spec.family, vocab, spec.image_size, vqgan.config.downsample)
    encode = text_tokenizer(tok_path) if has_tokenizer else None
    defaults = {**FAMILY_SAMPLING[spec.family], **spec.sampling}
    target = ChameleonTarget(
        lm,
        ChameleonTokenizer(vqgan, spec.image_size, layout.newline is not None),
        layout,
        image_token_ids(vocab, vqgan.config.num_embeddings),
        encode,
        name=spec.name,
        prefix_length=spec.prefix_length,
        sampling_defaults=SamplingConfig(**defaults),
        caption_overflow=spec.caption_overflow,
    )
    return target.to(device)


# The released sampling settings: Meta's image options (Anole: text CFG scale 3.0) and Lumina-mGPT's
# demo defaults.
FAMILY_SAMPLING: dict[str, dict[str, float]] = {
    "anole": {"cfg_scale": 3.0, "temperature": 0.7, "top_p": 0.9, "top_k": 0},
    "lumina_mgpt": {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0},
}
