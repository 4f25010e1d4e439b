"""``target.dtype``: bf16 / fp16 inference for the target and its drafter, fp32 kept for training."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TINY_FOLDER_TOKENS, tiny_condition
from hydra import compose, initialize_config_dir

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.generate import run
from vdtrain.targets import cast_for_inference, inference_dtype, load_target
from vdtrain.targets.llamagen import LlamaGenTarget

CONF = Path(__file__).resolve().parents[1] / "conf"


def bf16(target: LlamaGenTarget) -> LlamaGenTarget:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cast_for_inference(target, "bf16")


def random_drafter(target: LlamaGenTarget, folder: Path) -> Path:
    """A drafter with random weights saved for ``target``, as decoding apps load one."""
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return drafter.save_pretrained(folder)


@pytest.mark.parametrize("name", ["int8", "bfloat", "fp64"])
def test_an_unknown_dtype_is_refused_by_name(name, tiny_folder):
    with pytest.raises(ValueError, match=f"unknown target.dtype '{name}'.*fp32, bf16 or fp16"):
        inference_dtype(name)
    with pytest.raises(ValueError, match=f"unknown target.dtype '{name}'"):
        load_target({"kind": "folder", "folder": str(tiny_folder), "dtype": name})


def test_load_target_keeps_fp32_for_training(tiny_folder):
    target = load_target({"kind": "folder", "folder": str(tiny_folder), "dtype": "bf16"})
    assert target.dtype == torch.float32


def test_bf16_casts_the_transformer_and_its_cache_and_keeps_logits_fp32(tiny_target):
    identity = tiny_target.identity
    cond = tiny_condition()
    fp32 = tiny_target.prefill(cond, tiny_target.new_cache(2)).logits
    with pytest.warns(UserWarning, match="target.dtype=bf16 on the CPU"):
        target = cast_for_inference(tiny_target, "bf16")
    assert target.dtype == torch.bfloat16
    assert {p.dtype for p in target.gpt.parameters()} == {torch.bfloat16}
    assert target.gpt.rope.dtype == torch.float32  # the RoPE table is not rounded
    assert {p.dtype for p in target.tokenizer.parameters()} == {torch.float32}
    assert target.identity == identity  # a drafter trained on the fp32 target still matches
    cache = target.new_cache(2, extra_slots=3)
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16
    out = target.prefill(cond, cache)  # fp32 caption features are accepted
    assert out.hidden.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
    assert cache.v[:, :, :, : target.prefix_length].abs().sum() > 0  # written in bf16
    scale = fp32.abs().max()
    assert (out.logits - fp32).abs().max() < 0.05 * scale
    assert not torch.equal(out.logits, fp32)  # it really ran in bf16


def test_fp32_is_a_no_op_without_a_warning(tiny_target):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cast_for_inference(tiny_target, "fp32") is tiny_target
    assert tiny_target.dtype == torch.float32


def test_a_drafter_loaded_for_a_bf16_target_runs_in_bf16(tiny_target, tmp_path):
    folder = random_drafter(tiny_target, tmp_path / "drafter")
    drafter = Drafter.from_pretrained(folder, bf16(tiny_target))
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}
    assert drafter.layer.rope.dtype == torch.float32
    assert drafter.new_cache(2).k.dtype == torch.bfloat16


def test_bf16_speculative_decoding_runs_end_to_end_and_agrees_with_fp32(tiny_target, tmp_path):
    folder = random_drafter(tiny_target, tmp_path / "drafter")
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    reference = generate_ar(tiny_target, cond, sampling, [None, None])
    target = bf16(tiny_target)
    drafter = Drafter.from_pretrained(folder, target)
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16))
    result = SpeculativeEngine(target, drafter, builder, sampling).generate(cond, [None, None])
    assert result.tokens.shape == reference.shape and result.tokens.max() < target.vocab_size
    assert result.stats[0].target_forwards < target.num_image_tokens  # drafts were accepted
    # bf16 flips an argmax now and then, and a flip changes the rest of that image: most agree.
    assert (result.tokens == reference).float().mean() >= 0.5


def test_generate_applies_target_dtype(tiny_folder, tmp_path):
    """AR: the drafter's cast is tested above, and bf16 trees cost minutes on a CPU."""
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(
            "generate",
            overrides=[
                f"target.folder={tiny_folder}",
                f"out_dir={tmp_path / 'run'}",
                "num_prompts=2",
                "decode=ar",
                "target.dtype=bf16",
                "sampling.temperature=0",
            ],
        )
    with pytest.warns(UserWarning, match="bf16 on the CPU"):
        summary = run(cfg)
    assert summary["dtype"] == "bfloat16" and summary["num_samples"] == 2
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert all(len(s["tokens"]) == TINY_FOLDER_TOKENS for s in stats["samples"])
