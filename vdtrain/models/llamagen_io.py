"""Reading LlamaGen's released files: the GPT and VQ checkpoints, with presets and overrides."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

from vdtrain.checkpoint_io import load_strict, read_state_dict
from vdtrain.models.llamagen_gpt import GPT_PRESETS, GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQ_PRESETS, VQConfig, VQModel

C = TypeVar("C", GPTConfig, VQConfig)


def _from_preset(base: C, presets: Mapping[str, Mapping[str, object]], preset: str | None, what: str) -> C:
    if preset is None:
        return base
    if preset not in presets:
        raise ValueError(f"unknown {what} preset {preset!r}; choose one of {sorted(presets)}")
    return replace(base, **presets[preset])


def gpt_config_from(preset: str | None, overrides: dict[str, object]) -> GPTConfig:
    return replace(_from_preset(GPTConfig(), GPT_PRESETS, preset, "GPT"), **overrides)


def vq_config_from(preset: str | None, overrides: dict[str, object]) -> VQConfig:
    overrides = {k: tuple(v) if k == "ch_mult" else v for k, v in overrides.items()}
    return replace(_from_preset(VQConfig(), VQ_PRESETS, preset, "VQ"), **overrides)


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
