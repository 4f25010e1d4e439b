"""The one sampling pipeline: CFG → temperature → top-k → top-p → softmax; greedy at T=0."""

from __future__ import annotations

import pytest
import torch

from vdtrain.decode.sampling import (
    SamplingConfig,
    combine_cfg,
    filter_logits,
    next_tokens,
    probabilities,
    sample_rows,
)


def test_cfg_combination_extrapolates_from_uncond():
    cond, uncond = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    assert torch.equal(combine_cfg(cond, uncond, 3.0), torch.tensor([[4.0, -2.0]]))
    assert combine_cfg(cond, None, 3.0) is cond


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[False, True, True, False, False]]


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.6))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.5))
    assert kept.tolist() == [[True, False, False, False]]


def test_top_p_applies_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    sharp = probabilities(logits, None, SamplingConfig(temperature=0.25, top_p=0.9))
    flat = probabilities(logits, None, SamplingConfig(temperature=4.0, top_p=0.9))
    assert (sharp > 0).sum() == 1 and (flat > 0).sum() == 3


def test_greedy_is_one_hot_of_the_cfg_argmax():
    cond, uncond = torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0]])
    config = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    p = probabilities(cond, uncond, config)  # combined: [4, -1, 0]
    assert p.tolist() == [[1.0, 0.0, 0.0]]
    assert next_tokens(cond, uncond, config, [None]).tolist() == [0]


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, -1)
    config = SamplingConfig(temperature=1.0)
    gens = [torch.Generator().manual_seed(0)] * 20000
    draws = next_tokens(logits, None, config, gens)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.0, 1.0, 2.0]).softmax(0), atol=0.015)


def test_sample_rows_checks_generator_count():
    with pytest.raises(ValueError, match="generators"):
        sample_rows(torch.ones(2, 3) / 3, [None])


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)
