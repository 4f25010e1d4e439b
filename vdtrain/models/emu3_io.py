"""Reading Emu3's released files: the decoder's config, its vocabulary, its key layouts and its VQ.

The text model of ``Emu3ForConditionalGeneration`` is Llama (RMSNorm, SwiGLU, half-split 1D RoPE with
theta 1e6, GQA, no q/k norms), which is Chameleon's decoder with ``qk_norm=False``. Image codes live in
the 184k BPE vocabulary as ``<|visual token NNNNNN|>``; the ids come from ``config.json``'s
``vocabulary_map``, by name. Two key layouts are read: the released one that ``save_pretrained`` writes
(``text_model.model.*``, ``text_model.lm_head``, ``vqmodel.*``) and transformers 5's module names
(``model.text_model.*``, ``lm_head``, ``model.vqmodel.*``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from vdtrain.checkpoint_io import CheckpointError, load_strict
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM
from vdtrain.models.chameleon_io import chameleon_config
from vdtrain.models.chameleon_vocab import image_token_ids
from vdtrain.models.emu3 import Emu3VQ

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
    lm = dataclasses.replace(chameleon_config(text), qk_norm=False)
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


def load_vq(config: Mapping[str, object], state: dict[str, torch.Tensor], what: str) -> Emu3VQ:
    if "vq_config" not in config:
        raise CheckpointError(f"{what}: config.json has no vq_config")
    vq = Emu3VQ(config["vq_config"])
    load_strict(vq.model, state, what)
    return vq.eval()
