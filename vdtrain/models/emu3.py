"""Emu3's released files: its Llama decoder as Chameleon's (``qk_norm=False``), its vocabulary and its VQ.

The text model of ``Emu3ForConditionalGeneration`` is Llama (RMSNorm, SwiGLU, half-split 1D RoPE with
theta 1e6, GQA, no q/k norms; its residual dropout is a no-op in eval), which is Chameleon's decoder with
``qk_norm=False``. Image codes live in the 184k BPE vocabulary as ``<|visual token NNNNNN|>``; the ids
come from ``config.json``'s ``vocabulary_map``, by name.

The VQ (``Emu3VQVAE``, a video tokenizer: an image is repeated over 4 frames and downsampled in time to
one) is transformers' own module, wrapped so ``ChameleonTokenizer`` can drive it: it is not on the
decoding hot path, and transformers is a runtime dependency already.

Two key layouts are read: the released one that ``save_pretrained`` writes (``text_model.model.*``,
``text_model.lm_head``, ``vqmodel.*``) and transformers 5's module names (``model.text_model.*``,
``lm_head``, ``model.vqmodel.*``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from vdtrain.checkpoint_io import CheckpointError, load_strict
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM
from vdtrain.models.chameleon_vocab import image_token_ids

# transformers' Emu3TextConfig defaults, for keys a saved config.json leaves out
TEXT_DEFAULTS: dict[str, object] = {
    "vocab_size": 184622,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
}
VISUAL_TOKEN = re.compile(r"^<\|visual token (\d+)\|>$")
# released names → the names of ``ChameleonLM`` and of the VQ wrapper; the first matching prefix wins
RENAMES = (
    ("text_model.model.", "lm.model."),
    ("text_model.lm_head.", "lm.lm_head."),
    ("model.text_model.", "lm.model."),
    ("lm_head.", "lm.lm_head."),
    ("vqmodel.", "vq."),
    ("model.vqmodel.", "vq."),
)


def text_config(config: Mapping[str, object]) -> ChameleonConfig:
    """The decoder's config from an ``Emu3Config`` ``config.json`` (its ``text_config``)."""
    text = {**TEXT_DEFAULTS, **dict(config.get("text_config") or {})}
    lm = dataclasses.replace(ChameleonConfig.from_hf(text), qk_norm=False)
    if text.get("head_dim") not in (None, lm.head_dim):
        raise CheckpointError(f"text_config.head_dim {text['head_dim']} != hidden_size / heads {lm.head_dim}")
    return lm


def vocabulary(config: Mapping[str, object]) -> dict[str, int]:
    if not config.get("vocabulary_map"):
        raise CheckpointError("the Emu3 config.json has no vocabulary_map")
    return {str(k): int(v) for k, v in config["vocabulary_map"].items()}


def visual_code_of_name(name: str) -> int | None:
    match = VISUAL_TOKEN.match(name)
    return None if match is None else int(match.group(1))


def visual_token_ids(vocab: Mapping[str, int], codebook_size: int) -> torch.Tensor:
    """``ids[c]`` = the BPE id of ``<|visual token c|>`` for every code of the VQ codebook."""
    try:
        return image_token_ids(vocab, codebook_size, visual_code_of_name, "<|visual token {:06d}|>".format)
    except ValueError as error:  # a released checkpoint's vocabulary, not a caller's argument
        raise CheckpointError(str(error)) from error


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(decoder, VQ) entries of a released state dict under ``ChameleonLM``'s and ``Emu3VQVAE``'s names."""
    parts: dict[str, dict[str, torch.Tensor]] = {"lm": {}, "vq": {}}
    for key, value in state.items():
        for old, new in RENAMES:
            if key.startswith(old):
                part, _, rest = (new + key[len(old) :]).partition(".")
                parts[part][rest] = value
                break
    return parts["lm"], parts["vq"]


def load_decoder(config: ChameleonConfig, state: dict[str, torch.Tensor], what: str) -> ChameleonLM:
    lm = ChameleonLM(config)
    load_strict(lm, state, what)
    return lm.eval()


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


def load_vq(config: Mapping[str, object], state: dict[str, torch.Tensor], what: str) -> Emu3VQ:
    if "vq_config" not in config:
        raise CheckpointError(f"{what}: config.json has no vq_config")
    vq = Emu3VQ(config["vq_config"])
    load_strict(vq.model, state, what)
    return vq.eval()
