"""``benchmarks/train_throughput.py`` runs ``fit``'s step on a CPU and accounts for its parts (no timing is
asserted: speed claims live in the benchmark's output)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_gpt, random_vq

from benchmarks.train_throughput import build, main, step_flops
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer


def test_a_small_cpu_run_reports_every_column(tmp_path, capsys):
    """With --reference-loss the loss before the chunked head loss (tests/reference_losses.py) is measured
    beside it: it holds the whole [rows, V] logits, so its peak is the larger (batch 1: 255 rows of 16k)."""
    out = tmp_path / "train.json"
    (row,) = main(["--steps", "1", "--warmup", "0", "--batch", "1", "--reference-loss", "--out", str(out)])
    assert row.step_ms > row.target_ms > 0 and row.drafter_ms > 0
    assert 0 < row.drafter_share < 1 and row.mfu is None  # no known peak on a CPU
    # the drafter's phases account for its time (the rest: noise, logging, Python between them)
    phases = row.forward_ms + row.loss_ms + row.backward_ms + row.optimizer_ms
    assert min(row.forward_ms, row.loss_ms, row.backward_ms, row.optimizer_ms) > 0
    assert 0.5 * row.drafter_ms < phases <= row.drafter_ms
    assert row.graph_breaks == 0 and row.reference_loss_peak_mb > 2 * row.loss_peak_mb > 0
    assert row.chunked_loss_ms > 0 and row.reference_loss_ms > 0
    assert row.tokens_per_s == pytest.approx(256 * row.samples_per_s)  # 16 × 16 image tokens a sample
    written = json.loads(out.read_text())["rows"][0]
    assert written["mode"] == "eager" and written["graph_breaks"] == 0 and written["loss_peak_mb"] > 0
    printed = capsys.readouterr().out
    assert "| small | eagle1 | eager | fp32 | 1 |" in printed and "the loss's peak memory" in printed


def test_the_flop_count_grows_with_the_batch_and_counts_the_target_pass():
    target, drafter = build("small", torch.device("cpu"), "fp32", seed=0)
    one, two = step_flops(target, drafter, 1), step_flops(target, drafter, 2)
    assert two == pytest.approx(2 * one)
    layers = sum(p.numel() for n, p in target.gpt.named_parameters() if "layers" in n)
    assert one > 2 * layers * (target.prefix_length + target.num_image_tokens)


def test_eagle3_rows_unroll_and_count_every_pass(capsys):
    args = ["--steps", "1", "--warmup", "0", "--batch", "1", "--drafters", "eagle3", "--ttt-steps", "3"]
    (three,) = main(args)
    assert three.drafter == "eagle3 k=3" and three.graph_breaks == 0
    assert "| small | eagle3 k=3 | eager | fp32 | 1 |" in capsys.readouterr().out
    target, drafter = build("small", torch.device("cpu"), "fp32", seed=0, kind="eagle3")
    assert drafter.taps == target.default_feature_layers()


def test_the_flop_count_equals_a_hand_count_on_a_tiny_shape():
    """TINY_GPT: width 32, 2 layers (FFN 96), caption 12 → 32, L = 5 caption rows, N = 16 image tokens,
    vocabulary 24. Every unrolled step costs one teacher-forced pass: no k(k+1)/2 growth."""
    vq = VQTokenizer(random_vq(), image_size=8)
    target = LlamaGenTarget(random_gpt(), vq, None, "tiny", SamplingConfig())
    layer = 3 * 32 * 32 + 32 * 32 + 3 * 32 * 96  # wqkv, wo, w1 w3 w2
    seq, rows, head = 5 + 16, 5 + 16 - 1, 24 * 32
    target_flops = 2 * 2 * layer * seq + 2 * (12 * 32 + 32 * 32) * 5 + 2 * 4 * 32 * (seq * (seq + 1) // 2)
    # fc and the layer, forward and backward; attention 4·d per causal pair, forward and backward
    drafter = 6 * (2 * 32 * 32 + layer) * rows + 3 * 4 * 32 * (rows * (rows + 1) // 2)
    eagle1 = Drafter.make(DrafterConfig.for_target(target), target)
    hand = target_flops + drafter + 4 * head * 16 + 2 * head * 16
    assert step_flops(target, eagle1, 1) == hand
    assert step_flops(target, eagle1, 3) == 3 * hand
    # eagle3, 3 steps: step j scores rows s >= L - 1 + j of the 16 trained rows 3 .. 18: 15, 14, 13
    eagle3 = Drafter.make(DrafterConfig.for_target(target, kind="eagle3", feature_layers=(0, 1, 2)), target)
    fused = 3 * 32 * 32
    hand3 = target_flops + 3 * drafter + 4 * head * (15 + 14 + 13) + 4 * fused * seq + 2 * head * 16
    assert step_flops(target, eagle3, 1, 3) == hand3


def test_a_7b_class_shape_is_cut_to_few_layers_and_counted():
    """``--targets`` takes step_cost's random targets (here the small Chameleon layout, one layer of its 8)
    with ``--layers``, and the block kind."""
    target, drafter = build("chameleon-small", torch.device("cpu"), "fp32", seed=0, kind="block", layers=1)
    assert target.num_layers == 1 and drafter.config.kind == "block"
    layer = sum(p.numel() for p in target.transformer.layers.parameters() if p.dim() == 2)
    assert step_flops(target, drafter, 1) > 2 * layer * (target.prefix_length + target.num_image_tokens)


@pytest.mark.slow
def test_a_block_row_counts_its_graph_breaks_and_has_no_loss_cost(capsys):
    """The block kind's loss is its own, compiled with the rest (0 breaks, issue #55); it scores rows
    ``score`` does not, so the loss-cost column reads – there."""
    (row,) = main(["--steps", "1", "--warmup", "0", "--batch", "1", "--drafters", "block"])
    assert row.drafter == "block" and row.graph_breaks == 0 and row.loss_peak_mb is None
    assert "| small | block | eager | fp32 | 1 |" in capsys.readouterr().out
