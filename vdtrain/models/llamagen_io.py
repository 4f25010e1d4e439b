"""Reading LlamaGen's released files: the GPT and VQ checkpoints, with presets and overrides."""

from __future__ import annotations

import os
from dataclasses import replace

from vdtrain.checkpoint_io import load_strict, read_state_dict
from vdtrain.models.llamagen_gpt import GPT_PRESETS, GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQ_PRESETS, VQConfig, VQModel


def gpt_config_from(preset: str | None, overrides: dict[str, object]) -> GPTConfig:
    base = GPTConfig()
    if preset is not None:
        if preset not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset {preset!r}; choose one of {sorted(GPT_PRESETS)}")
        base = replace(base, **GPT_PRESETS[preset])
    return replace(base, **overrides)


def vq_config_from(preset: str | None, overrides: dict[str, object]) -> VQConfig:
    base = VQConfig()
    if preset is not None:
        if preset not in VQ_PRESETS:
            raise ValueError(f"unknown VQ preset {preset!r}; choose one of {sorted(VQ_PRESETS)}")
        base = replace(base, **VQ_PRESETS[preset])
    overrides = {k: tuple(v) if k == "ch_mult" else v for k, v in overrides.items()}
    return replace(base, **overrides)


def load_gpt(path: str | os.PathLike[str], config: GPTConfig) -> LlamaGenGPT:
    gpt = LlamaGenGPT(config)
    load_strict(gpt, read_state_dict(path), f"LlamaGen GPT ({path})")
    return gpt.eval()


def load_vq(path: str | os.PathLike[str], config: VQConfig) -> VQModel:
    vq = VQModel(config)
    state = read_state_dict(path)
    if not config.codebook_show_usage:
        state = {k: v for k, v in state.items() if k != "quantize.codebook_used"}
    load_strict(vq, state, f"VQ tokenizer ({path})")
    return vq.eval()
