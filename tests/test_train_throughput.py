"""``benchmarks/train_throughput.py`` runs ``fit``'s step on a CPU and accounts for its parts (no timing is
asserted: speed claims live in the benchmark's output)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.train_throughput import build, main, step_flops


def test_a_small_cpu_run_reports_every_column(tmp_path, capsys):
    out = tmp_path / "train.json"
    (row,) = main(["--steps", "1", "--warmup", "0", "--batch", "1", "--out", str(out)])
    assert row.step_ms > row.target_ms > 0 and row.drafter_ms > 0
    assert 0 < row.drafter_share < 1 and row.mfu is None  # no known peak on a CPU
    assert row.tokens_per_s == pytest.approx(256 * row.samples_per_s)  # 16 × 16 image tokens a sample
    assert json.loads(out.read_text())["rows"][0]["mode"] == "eager"
    assert "| small | eagle1 | eager | fp32 | 1 |" in capsys.readouterr().out


def test_the_flop_count_grows_with_the_batch_and_counts_the_target_pass():
    target, drafter = build("small", torch.device("cpu"), "fp32", seed=0)
    one, two = step_flops(target, drafter, 1), step_flops(target, drafter, 2)
    assert two == pytest.approx(2 * one)
    layers = sum(p.numel() for n, p in target.gpt.named_parameters() if "layers" in n)
    assert one > 2 * layers * (target.prefix_length + target.num_image_tokens)


def test_eagle3_rows_unroll_and_count_every_pass(capsys):
    (one, three) = main(
        [
            "--steps",
            "1",
            "--warmup",
            "0",
            "--batch",
            "1",
            "--drafters",
            "eagle1",
            "eagle3",
            "--ttt-steps",
            "3",
        ]
    )
    assert (one.drafter, three.drafter) == ("eagle1", "eagle3 k=3")
    assert "| small | eagle3 k=3 | eager | fp32 | 1 |" in capsys.readouterr().out
    target, drafter = build("small", torch.device("cpu"), "fp32", seed=0, kind="eagle3")
    assert drafter.taps == target.default_feature_layers()
    once, thrice = step_flops(target, drafter, 1, 1), step_flops(target, drafter, 1, 3)
    assert thrice > 2.5 * (once - step_flops(target, drafter, 1, 0))  # each pass counted, attention growing
