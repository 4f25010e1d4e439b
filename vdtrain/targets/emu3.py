"""Emu3-Gen text-to-image as a target: a ``ChameleonTarget`` over Emu3's token layout.

Emu3 lays an image out as Lumina-mGPT does, so the Chameleon adapter serves it unchanged: the prompt is
``[bos] + text + [<|image start|>] + "{h}*{w}" + [<|image token|>]`` (the size in tokens, as BPE text),
then ``h`` rows of ``w`` visual tokens each followed by the end-of-row token ``<|extra_200|>`` (forced,
as Lumina-mGPT's newline), then ``<|extra_201|>`` (end of frame), ``<|image end|>`` and eos outside the
image sequence. The target's token space is the ``w × h`` codes plus that end-of-row token; its grid is
``(h, w + 1)``.

CFG is unbatched in the release (``UnbatchedClassifierFreeGuidanceLogitsProcessor``): a second context
``[bos] + negative prompt + image prefix`` of its own length; RoPE is relative, so as a left-padded
prefix it gives the same logits. The release combines log-softmaxes over the whole vocabulary, which
differ from the raw logits by one constant per row: ``u + s·(c − u)`` on raw logits, restricted to the
image tokens, is the same distribution.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from vdtrain.models.chameleon_io import read_hf_config, read_hf_weights, text_tokenizer
from vdtrain.models.chameleon_vocab import token_id
from vdtrain.models.emu3_io import (
    load_decoder,
    load_vq,
    split_state,
    text_config,
    visual_token_ids,
    vocabulary,
)
from vdtrain.sampling_config import SamplingConfig
from vdtrain.targets.chameleon import ChameleonLayout, ChameleonTarget, ChameleonTokenizer, Guidance
from vdtrain.targets.janus import JanusDraftLayer

FAMILY = "emu3"
BOS, BOI, IMAGE_WRAPPER, END_OF_ROW = "<|extra_203|>", "<|image start|>", "<|image token|>", "<|extra_200|>"
SIZE = "{h}*{w}"  # the size text between <|image start|> and <|image token|>, in tokens per side
# BAAI's image_generation.py: the prompt suffix and the negative prompt of the unconditional context.
POSITIVE_SUFFIX = " masterpiece, film grained, best quality."
NEGATIVE_PROMPT = (
    "lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
    "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry."
)
# ... and its sampling: CFG 3.0, top-k 2048, temperature 1.
SAMPLING = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 2048, "top_p": 1.0}


class Emu3DraftLayer(JanusDraftLayer):
    """Emu3's Llama decoder layer: a Chameleon layer without q/k norms or swin norm, 1D RoPE."""

    def describe(self) -> str:
        c = self.config
        return (
            f"Llama decoder layer (Emu3): {c.num_attention_heads} heads ({c.num_key_value_heads} KV "
            f"heads), FFN {c.intermediate_size}, RoPE theta {c.rope_theta:g}"
        )


def emu3_layout(
    vocab: Mapping[str, int],
    encode_text,
    latent: tuple[int, int],
    prompt_suffix: str,
    negative_prompt: str,
) -> ChameleonLayout:
    h, w = latent
    bos = token_id(vocab, BOS)
    prefix = (token_id(vocab, BOI), *encode_text(SIZE.format(h=h, w=w)), token_id(vocab, IMAGE_WRAPPER))
    null = (bos, *encode_text(negative_prompt), *prefix)
    template = "{text}" + prompt_suffix.replace("{", "{{").replace("}", "}}")
    newline = token_id(vocab, END_OF_ROW)
    return ChameleonLayout(FAMILY, latent, bos, prefix, null, newline, template, Guidance())


@dataclass
class Emu3Spec:
    """An Emu3 target from local files (mirrors ``conf/target/emu3.yaml``)."""

    name: str
    model_dir: str  # transformers' layout: config.json (with vocabulary_map) + safetensors, tokenizer.json
    tokenizer_file: str | None = None  # tokenizer.json; default: the one in model_dir
    image_size: int = 720  # pixels per side; codes per side = image_size / the VQ's 8x downsampling
    prefix_length: int = 128
    caption_overflow: str = "error"
    prompt_suffix: str | None = None  # None: the release's " masterpiece, film grained, best quality."
    negative_prompt: str | None = None  # None: the release's negative prompt
    sampling: dict[str, float] = field(default_factory=dict)


def build_emu3_target(spec: Emu3Spec, device: str | torch.device = "cpu") -> ChameleonTarget:
    config = read_hf_config(spec.model_dir)
    lm_state, vq_state = split_state(read_hf_weights(spec.model_dir))
    lm = load_decoder(text_config(config), lm_state, f"Emu3 decoder ({spec.model_dir})")
    vq = load_vq(config, vq_state, f"Emu3 VQ ({spec.model_dir})")
    del lm_state, vq_state
    down = vq.config.downsample
    if spec.image_size % down:
        raise ValueError(f"image_size {spec.image_size} is not a multiple of the VQ's downsampling {down}")
    tok_path = spec.tokenizer_file or os.path.join(spec.model_dir, "tokenizer.json")
    encode = text_tokenizer(tok_path)
    vocab = vocabulary(config)
    sampling = SamplingConfig(**{**SAMPLING, **spec.sampling})
    side = spec.image_size // down
    layout = emu3_layout(
        vocab,
        encode,
        (side, side),
        POSITIVE_SUFFIX if spec.prompt_suffix is None else spec.prompt_suffix,
        NEGATIVE_PROMPT if spec.negative_prompt is None else spec.negative_prompt,
    )
    target = ChameleonTarget(
        lm,
        ChameleonTokenizer(vq, spec.image_size, newline_column=True),
        layout,
        visual_token_ids(vocab, vq.config.num_embeddings),
        encode,
        name=spec.name,
        prefix_length=spec.prefix_length,
        sampling_defaults=sampling,
        caption_overflow=spec.caption_overflow,
    )
    return target.to(device)
