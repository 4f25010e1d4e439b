"""The 7B-class random targets of ``benchmarks.step_cost`` (issue #46): Lumina-mGPT-7B's and Janus-Pro-7B's
layouts build with their real vocabularies and image grids, and AR, eagle2 and sjd each run steps in bf16
with CFG. On the CPU the decoder is one narrow layer (a 7B model is 28 GB in fp32, and its width makes a
step take seconds here); ``gpu_check.sh``'s ``big`` step runs the full shapes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.step_cost import conditions, random_chameleon, random_janus, run_steps
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.targets import cast_for_inference

pytestmark = pytest.mark.usefixtures("one_thread")

NARROW = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}
# name → (builder, the text vocabulary, the head's image tokens, the image grid): Lumina-mGPT's 8 192 codes
# and end of row (32 × 32 codes and an end-of-row column), Janus-Pro's 16 384 codes (24 × 24)
SHAPES = {
    "chameleon-7b": (random_chameleon, 65536, 8193, (32, 33)),
    "janus-pro-7b": (random_janus, 102400, 16384, (24, 24)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_7b_layout_builds_and_each_method_runs_steps(name, tmp_path):
    build, words, image_tokens, grid = SHAPES[name]
    target, drafter = build(name, torch.device("cpu"), 0, {**NARROW, "num_key_value_heads": 2})
    target = cast_for_inference(target, "bf16")
    drafter = drafter.to(target.dtype)
    head = target.head(torch.zeros(1, 64, dtype=target.dtype))
    assert (target.transformer.embed_tokens.num_embeddings, head.shape[-1], target.grid) == (
        words,
        image_tokens,
        grid,
    )
    assert target.dtype == torch.bfloat16 and target.sampling_defaults.uses_cfg
    cond = conditions(target, name, 1, 1, 0)[0]
    with torch.no_grad():
        for preset in ("ar", "eagle2", "sjd"):
            config = load_preset(preset, {"acceptance": {"cache_dir": str(tmp_path)}})
            method = build_method(
                config, target, drafter if config.needs_drafter else None, target.sampling_defaults
            )
            gens = [torch.Generator().manual_seed(0)]
            assert run_steps(method, cond, gens, None, steps=3) is None  # cut after its third step
