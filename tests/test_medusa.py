"""The third drafter kind, Medusa-style heads (docs/extending.md, "Adding a drafter kind"): the tree presets
decode with it AR's tokens at T = 0 (trees deeper than its heads) and AR's distribution at T = 1, and a
head reads only the target's state and the depth (fit, export and reload: tests/test_drafter_kinds.py, as
for every kind). Also: no code outside the kind registry names a drafter kind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_condition
from test_engine import (
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    micro_problem,
    sample_images,
)

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.registry import DRAFTERS

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
REPO = Path(__file__).resolve().parents[1]


def medusa(target, heads: int = 3, std: float = 0.3) -> Drafter:
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="medusa", heads=heads), target)
    torch.manual_seed(0)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter.eval()


@pytest.mark.parametrize("name", ["eagle1", "eagle2", "peanut"])
def test_medusa_drafts_give_ar_tokens_at_t0(name):
    target = make_target()
    cond = tiny_condition()
    result = build_method(load_preset(name), target, medusa(target), GREEDY).generate(cond, [None, None])
    assert torch.equal(result.tokens, generate_ar(target, cond, GREEDY, [None, None]))
    assert max(max(s.depth_per_step) for s in result.stats) > 3  # deeper than its heads: the last reused


def test_medusa_drafts_keep_the_ar_distribution_at_t1():
    target, cond = micro_problem()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    engine = build_method(load_preset("eagle2"), target, medusa(target, std=0.5), sampling)
    samples = sample_images(engine, cond, 6000, seed=1)
    assert chi_square_pvalue(samples, exact_ar_distribution(target, cond, sampling)) > SIGNIFICANCE


def test_a_head_reads_only_the_targets_state_and_the_depth():
    """The node at depth d drafts with head d + 1 from h_t alone, whatever token it holds."""
    target = make_target()
    drafter = medusa(target)
    hidden = torch.randn(1, 1, target.hidden_size)
    state = drafter.input_features(hidden, None)
    one = drafter(state, torch.randn(1, 1, target.hidden_size), torch.zeros(1, 1, dtype=torch.long), None)
    two = drafter(one, torch.randn(1, 1, target.hidden_size), torch.zeros(1, 1, dtype=torch.long), None)
    assert torch.equal(one[..., :-1], hidden) and one[..., -1].item() == 1 and two[..., -1].item() == 2
    with torch.no_grad():
        expected = hidden + torch.nn.functional.silu(drafter.heads[1](hidden))
        torch.testing.assert_close(drafter.normed(two), expected)


def test_no_code_outside_the_registry_compares_a_drafter_kinds_name():
    kinds = "|".join(DRAFTERS)
    compare = re.compile(rf"""[!=]=\s*["']({kinds})["']|["']({kinds})["']\s*[!=]=|in \(["']({kinds})""")
    room = REPO / "vdtrain" / "drafters"  # the registry and the kinds' own modules name their kinds
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("vdtrain", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
        if path.parent != room or path.name == "base.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert not found, found
