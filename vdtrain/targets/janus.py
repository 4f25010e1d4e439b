"""Janus-Pro text-to-image as a target: its Llama decoder with the image-generation embeddings and head.

The condition prefix is the prompt's ids, embedded by the LM and left-padded to ``prefix_length`` rows:
``[bos] + "<|User|>: {caption}\\n\\n<|Assistant|>:" + [<begin_of_image>]`` (the released chat format, then
the image start token). Image token ``i`` is fed as ``generation_aligner(generation_embeddings(i))``,
which this adapter tabulates once (``token_embedding``); logits come from ``generation_head``.

CFG's null stream is the prompt with every token but ``bos`` and ``<begin_of_image>`` replaced by the pad
token, all of them attended (DeepSeek's ``generation_inference.py`` and transformers' ``generate`` with
``generation_mode="image"``), so it has its prompt's length and mask.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from vdtrain.checkpoint_io import CheckpointError, load_strict
from vdtrain.models.chameleon_io import read_hf_config, read_hf_weights, text_tokenizer
from vdtrain.models.janus import JanusGenerator
from vdtrain.models.janus_io import generator_state, janus_config, vq_state
from vdtrain.models.vq import VQModel
from vdtrain.sampling_config import SamplingConfig
from vdtrain.targets.base import (
    Condition,
    Target,
    TargetIdentity,
    fingerprint,
)
from vdtrain.targets.chameleon import ChameleonDraftLayer
from vdtrain.targets.llamagen import VQTokenizer
from vdtrain.targets.token_prompts import check_caption_overflow, fit_text, left_padded

FAMILY = "janus_pro"
BOS, PAD, BOI = "<｜begin▁of▁sentence｜>", "<｜▁pad▁｜>", "<begin_of_image>"
PROMPT = "<|User|>: {text}\n\n<|Assistant|>:"
# DeepSeek's generation_inference.py and the converted generation_config.json: CFG 5, plain sampling.
SAMPLING = {"cfg_scale": 5.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@dataclass(frozen=True)
class JanusTokens:
    """The special ids the prompt and its null stream use."""

    bos: int
    pad: int
    boi: int

    @classmethod
    def from_vocabulary(cls, vocab: Mapping[str, int]) -> JanusTokens:
        missing = [name for name in (BOS, PAD, BOI) if name not in vocab]
        if missing:
            raise CheckpointError(f"the Janus text tokenizer has no {missing}")
        return cls(int(vocab[BOS]), int(vocab[PAD]), int(vocab[BOI]))


class JanusDraftLayer(ChameleonDraftLayer):
    """Janus-Pro's Llama decoder layer (a Chameleon layer without q/k norms or swin norm, 1D RoPE)."""

    settings_fields = (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "attention_bias",
        "mlp_bias",
    )
    LLAMA: ClassVar[dict[str, bool]] = {"swin_norm": False, "qk_norm": False}

    def __init__(
        self, hidden_size: int, prefix_length: int, grid: tuple[int, int], settings: Mapping[str, Any]
    ) -> None:
        super().__init__(hidden_size, prefix_length, grid, {**settings, **self.LLAMA})

    @classmethod
    def check(cls, hidden_size: int, grid: tuple[int, int], settings: Mapping[str, Any]) -> None:
        super().check(hidden_size, grid, {k: v for k, v in settings.items() if k not in cls.LLAMA})

    def describe(self) -> str:
        c = self.config
        return (
            f"Llama decoder layer (Janus-Pro): {c.num_attention_heads} heads ({c.num_key_value_heads} KV "
            f"heads), FFN {c.intermediate_size}, RoPE theta {c.rope_theta:g}"
        )


class JanusTarget(Target):
    def __init__(
        self,
        generator: JanusGenerator,
        tokenizer: VQTokenizer,
        tokens: JanusTokens,
        encode_text: Callable[[str], list[int]] | None,
        *,
        name: str,
        prefix_length: int,
        sampling_defaults: SamplingConfig,
        caption_overflow: str = "error",
    ) -> None:
        super().__init__()
        side = generator.config.grid
        if tokenizer.grid != (side, side):
            raise ValueError(f"VQ grid {tokenizer.grid} != the model's {side}x{side} image tokens")
        check_caption_overflow(caption_overflow)
        if prefix_length < 3:
            raise ValueError(f"prefix_length {prefix_length} < 3, the shortest prompt (bos, a token, boi)")
        self.generator = generator.eval().requires_grad_(False)
        self.tokenizer = tokenizer.eval().requires_grad_(False)
        self.tokens = tokens
        self.encode_text = encode_text
        self.name = name
        self.sampling_defaults = sampling_defaults
        self.caption_overflow = caption_overflow
        self._prefix_length = prefix_length
        codes = generator.config.codebook_size
        # The aligner is a fixed function of the token id: tabulated, it is an embedding like any other.
        device = generator.generation_embeddings.weight.device  # meta (the memory plan's): no data to copy
        width = generator.config.lm.hidden_size
        self.image_embedding = nn.Embedding(codes, width, device=device).requires_grad_(False)
        with torch.no_grad():
            table = generator.embed_image_tokens(torch.arange(codes, device=device))
            self.image_embedding.weight.copy_(table)
        self.to(device)
        self._identity: TargetIdentity | None = None

    # --- shape ------------------------------------------------------------------------------------
    @property
    def identity(self) -> TargetIdentity:
        if self._identity is None:
            side = self.generator.config.grid
            self._identity = TargetIdentity(
                family=FAMILY,
                name=self.name,
                hidden_size=self.generator.config.lm.hidden_size,
                vocab_size=self.generator.config.codebook_size,
                grid=(side, side),
                prefix_length=self._prefix_length,
                head_fingerprint=fingerprint(self.generator.generation_head.vision_head.weight),
                num_layers=len(self.generator.language_model.layers),
            )
        return self._identity

    @property
    def transformer(self) -> nn.Module:
        return self.generator.language_model

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.image_embedding

    @property
    def head(self) -> nn.Module:
        return self.generator.generation_head

    def use_dtype(self, dtype: torch.dtype) -> JanusTarget:
        """Run the decoder, image-token table and generation head in ``dtype``; logits stay fp32, RoPE
        angles are computed in fp32, the VQ is left alone, and the identity is the fp32 weights'."""
        _ = self.identity
        for module in (self.generator, self.image_embedding):
            module.to(dtype=dtype)
        return self

    # --- conditioning -----------------------------------------------------------------------------
    def prompt_ids(self, caption: str) -> list[int]:
        """``[bos] + chat-formatted caption + [<begin_of_image>]``, as the released pipelines build it."""
        if self.encode_text is None:
            raise RuntimeError(f"target {self.name!r} was built without a text tokenizer")
        text = self.encode_text(PROMPT.format(text=caption.strip()))
        text = fit_text(text, self._prefix_length - 2, self.caption_overflow, self._prefix_length, caption)
        return [self.tokens.bos, *text, self.tokens.boi]

    def _embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        embed = self.generator.language_model.embed_tokens
        return embed(ids) * mask[..., None].to(embed.weight.dtype)

    def condition_from_ids(
        self, prompts: Sequence[Sequence[int]], captions: list[str] | None = None
    ) -> Condition:
        """Left-padded, embedded prompts (zero rows and a False mask where padded)."""
        ids, mask = left_padded(prompts, self._prefix_length, self.device, shortest=2)
        return Condition(self._embed(ids, mask), mask, captions)

    def encode_captions(self, captions: list[str]) -> Condition:
        return self.condition_from_ids([self.prompt_ids(c) for c in captions], list(captions))

    def null_condition(self, cond: Condition) -> Condition:
        """Each prompt as ``[bos, pad, …, pad, boi]`` of its own length, under its own mask."""
        mask = cond.mask.to(self.device).bool()
        ids = torch.full(mask.shape, self.tokens.pad, dtype=torch.long, device=self.device)
        first = mask.shape[1] - mask.sum(1)
        ids[torch.arange(len(ids), device=self.device), first] = self.tokens.bos
        ids[:, -1] = self.tokens.boi
        return Condition(self._embed(ids, mask).to(cond.features.dtype), mask)


# --- building from files ----------------------------------------------------------------------------


@dataclass
class JanusSpec:
    """A Janus-Pro target from local files (mirrors ``conf/target/janus_pro.yaml``)."""

    name: str
    model_dir: str  # transformers' layout: config.json + model.safetensors (or shards with an index)
    tokenizer_file: str | None = None  # tokenizer.json; default: the one in model_dir
    prefix_length: int = 128
    caption_overflow: str = "error"
    sampling: dict[str, float] = field(default_factory=dict)


def build_janus_target(spec: JanusSpec, device: str | torch.device = "cpu") -> JanusTarget:
    config = janus_config(read_hf_config(spec.model_dir))
    state = read_hf_weights(spec.model_dir)
    generator = JanusGenerator(config)
    load_strict(generator, generator_state(state), f"Janus decoder and generation modules ({spec.model_dir})")
    vq = VQModel(config.vq)
    load_strict(vq, vq_state(state), f"Janus VQ ({spec.model_dir})")
    del state
    tok_path = spec.tokenizer_file or os.path.join(spec.model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"text tokenizer not found: {tok_path!r} (set tokenizer_file)")
    from tokenizers import Tokenizer

    tokens = JanusTokens.from_vocabulary(Tokenizer.from_file(tok_path).get_vocab())
    target = JanusTarget(
        generator,
        VQTokenizer(vq.eval(), config.image_size),
        tokens,
        text_tokenizer(tok_path),
        name=spec.name,
        prefix_length=spec.prefix_length,
        sampling_defaults=SamplingConfig(**{**SAMPLING, **spec.sampling}),
        caption_overflow=spec.caption_overflow,
    )
    return target.to(device)
