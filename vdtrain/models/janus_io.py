"""Reading Janus-Pro's released files: its ``config.json`` and its state dict under vdtrain's names.

The VQ is LlamaGen's VQ-16 under other names: ``vq_state`` renames transformers' keys to
``vdtrain.models.vq``'s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.models.chameleon_io import chameleon_config
from vdtrain.models.janus import JanusConfig
from vdtrain.models.vq import VQConfig

# transformers' defaults, for keys a saved config.json leaves out
LLAMA_DEFAULTS: dict[str, object] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
VQ_DEFAULTS: dict[str, object] = {
    "embed_dim": 8,
    "num_embeddings": 16384,
    "double_latent": False,
    "latent_channels": 256,
    "in_channels": 3,
    "out_channels": 3,
    "base_channels": 128,
    "channel_multiplier": [1, 1, 2, 2, 4],
    "num_res_blocks": 2,
    "projection_dim": 2048,
    "num_hidden_layers": 2,
    "hidden_act": "gelu",
    "image_token_embed_dim": 2048,
}
VISION_DEFAULTS: dict[str, object] = {"image_size": 384, "patch_size": 16, "num_image_tokens": 576}
PREFIX = "model."
GENERATION_MODULES = ("language_model.", "generation_embeddings.", "generation_aligner.", "generation_head.")
VQ_PREFIX = "model.vqmodel."
# transformers' VQ names → LlamaGen's (the reverse of convert_janus_weights_to_hf's VQ mapping)
VQ_RENAMES = (
    (r"^encoder\.down\.", "encoder.conv_blocks."),
    (r"^decoder\.up\.", "decoder.conv_blocks."),
    (r"(conv_blocks\.\d+)\.block\.", r"\1.res."),
    (r"\.mid\.block_1\.", ".mid.0."),
    (r"\.mid\.attn_1\.", ".mid.1."),
    (r"\.mid\.block_2\.", ".mid.2."),
)


def janus_config(config: Mapping[str, object]) -> JanusConfig:
    """What image generation needs from a released ``JanusConfig`` ``config.json``."""
    text = {**LLAMA_DEFAULTS, **dict(config.get("text_config") or {})}
    vq = {**VQ_DEFAULTS, **dict(config.get("vq_config") or {})}
    vision = {**VISION_DEFAULTS, **dict(config.get("vision_config") or {})}
    lm = dataclasses.replace(chameleon_config(text), qk_norm=False)
    problems = []
    if text.get("head_dim") not in (None, lm.head_dim):
        problems.append(f"text_config.head_dim {text['head_dim']} != hidden_size / heads = {lm.head_dim}")
    if vq["hidden_act"] != "gelu":
        problems.append(f"vq_config.hidden_act {vq['hidden_act']!r} (the release uses 'gelu')")
    if vq["double_latent"] or (vq["in_channels"], vq["out_channels"]) != (3, 3):
        problems.append("a VQ with double_latent or non-RGB channels")
    width = lm.hidden_size
    if (vq["projection_dim"], vq["image_token_embed_dim"]) != (width, width):
        problems.append(
            f"vq_config projection_dim {vq['projection_dim']} and image_token_embed_dim "
            f"{vq['image_token_embed_dim']} must both be the LM width {width}"
        )
    grid = int(vision["image_size"]) // int(vision["patch_size"])
    if int(vision["num_image_tokens"]) != grid * grid:
        problems.append(f"vision_config.num_image_tokens {vision['num_image_tokens']} != ({grid} per side)^2")
    if problems:
        raise CheckpointError("unsupported Janus config: " + "; ".join(problems))
    vq_config = VQConfig(
        codebook_size=int(vq["num_embeddings"]),
        codebook_embed_dim=int(vq["embed_dim"]),
        codebook_l2_norm=True,
        codebook_show_usage=False,
        ch=int(vq["base_channels"]),
        ch_mult=tuple(int(m) for m in vq["channel_multiplier"]),
        num_res_blocks=int(vq["num_res_blocks"]),
        z_channels=int(vq["latent_channels"]),
    )
    return JanusConfig(
        lm=lm,
        codebook_size=vq_config.codebook_size,
        code_dim=vq_config.codebook_embed_dim,
        aligner_depth=int(vq["num_hidden_layers"]),
        head_width=int(vq["projection_dim"]),
        grid=grid,
        vq=vq_config,
    )


def generator_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image-generation entries of a released state dict, under ``JanusGenerator``'s names."""
    return {
        k[len(PREFIX) :]: v
        for k, v in state.items()
        if k.startswith(PREFIX) and k[len(PREFIX) :].startswith(GENERATION_MODULES)
    }


def vq_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.vqmodel.*`` renamed to ``vdtrain.models.vq.VQModel``'s (LlamaGen's) parameter names."""
    out = {}
    for key, value in state.items():
        if not key.startswith(VQ_PREFIX):
            continue
        name = key[len(VQ_PREFIX) :]
        for pattern, repl in VQ_RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = value
    return out
