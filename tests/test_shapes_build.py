"""Training the shapes world's tokenizer and target (``vdtrain.shapes.build``): the learning-rate
schedule, continuing from a checkpoint, periodic checkpoints and the wall-clock budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TINY_VQ

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.shapes.build import (
    OptimConfig,
    _lr_factor,
    load_init_target,
    save_llamagen_checkpoint,
    train_target,
    train_tokenizer,
)

# MiniLM's width and a 16x16 grid: what the real caption encoder and 64 px images give.
SMALL_GPT = GPTConfig(
    dim=32, n_layer=1, n_head=4, multiple_of=16, caption_dim=384, vocab_size=24, cls_token_num=48,
    block_size=256, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0, caption_rope="identity",
)  # fmt: skip
VQ_4X = replace(TINY_VQ, ch_mult=(1, 2, 2))  # 64 px -> 16x16 tokens
OPT = OptimConfig(steps=4, batch_size=2, lr=1e-3, warmup=1)


def test_the_schedule_warms_up_then_decays_by_steps_or_by_the_time_budget():
    opt = OptimConfig(steps=101, batch_size=1, lr=1.0, warmup=10)
    assert _lr_factor(opt, 0) == pytest.approx(0.1) and _lr_factor(opt, 9) == pytest.approx(1.0)
    assert _lr_factor(opt, 10) == pytest.approx(1.0) and _lr_factor(opt, 101) == pytest.approx(0.1)
    assert _lr_factor(opt, 20, progress=1.0) == pytest.approx(0.1)  # the budget ran out first
    assert _lr_factor(opt, 20, progress=0.5) == pytest.approx(0.55)


@pytest.fixture(scope="module")
def vq():
    torch.manual_seed(0)
    return train_tokenizer(VQ_4X, OPT, n_images=4)


def test_target_training_checkpoints_and_continues(vq):
    seen = []
    gpt, info = train_target(
        SMALL_GPT, vq, OPT, n_samples=4, checkpoint_every=2, on_checkpoint=lambda g, i: seen.append(i)
    )
    assert [i["train_steps"] for i in seen] == [2, 4] and info["train_steps"] == 4
    assert not gpt.training and not any(p.requires_grad for p in gpt.parameters())
    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    continued, _ = train_target(SMALL_GPT, vq, OPT, n_samples=4, init=gpt)
    assert continued is gpt and any(not torch.equal(before[k], v) for k, v in gpt.state_dict().items())
    with pytest.raises(ValueError, match="init target has config"):
        other = replace(SMALL_GPT, caption_rope="zero")
        train_target(other, vq, OPT, n_samples=4, init=LlamaGenGPT(SMALL_GPT))


def test_a_spent_time_budget_stops_training_after_the_step_that_spent_it(vq):
    _, info = train_target(SMALL_GPT, vq, replace(OPT, steps=50), n_samples=4, max_minutes=1e-9)
    assert info["train_steps"] == 1
    with pytest.raises(ValueError, match="max_minutes must be positive"):
        train_target(SMALL_GPT, vq, OPT, n_samples=4, max_minutes=0.0)


def test_a_target_continues_with_a_position_table_switched_on(vq, tmp_path):
    plain, _ = train_target(SMALL_GPT, vq, OPT, n_samples=4)
    save_llamagen_checkpoint(plain, tmp_path / "gpt.pt")
    grown = load_init_target(tmp_path / "gpt.pt", replace(SMALL_GPT, learned_pos_embedding=True))
    x, positions = torch.randn(1, 5, SMALL_GPT.dim), torch.arange(40, 45)
    torch.testing.assert_close(grown(x, positions, None), plain(x, positions, None))  # unchanged at start
    assert torch.equal(load_init_target(tmp_path / "gpt.pt", SMALL_GPT).output.weight, plain.output.weight)
    with pytest.raises(CheckpointError, match="missing"):  # anything else must match exactly
        load_init_target(tmp_path / "gpt.pt", replace(SMALL_GPT, n_layer=2))


def test_bf16_autocast_trains_fp32_weights(vq):
    gpt, info = train_target(SMALL_GPT, vq, OPT, n_samples=4, bf16=True)
    assert info["train_steps"] == OPT.steps
    assert all(p.dtype == torch.float32 and p.isfinite().all() for p in gpt.parameters())
