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
    """The node at depth d drafts with head d + 1 from h_t alone, whatever token it holds: a call keeps
    h_t [.., H] (no counter channel) and the rows' offset picks the head."""
    target = make_target()
    drafter = medusa(target)
    hidden = torch.randn(1, 1, target.hidden_size)
    state = drafter.input_features(hidden, None)
    one = drafter(state, torch.randn(1, 1, target.hidden_size), torch.zeros(1, 1, dtype=torch.long), None)
    assert torch.equal(one, hidden)
    with torch.no_grad():
        expected = hidden + torch.nn.functional.silu(drafter.heads[1](hidden))
        torch.testing.assert_close(drafter.normed(one, 1), expected)
        rows = drafter.normed(one.expand(1, 2, -1), torch.tensor([1, 7]))  # an offset per row
        torch.testing.assert_close(rows[:, :1], expected)
        last = hidden + torch.nn.functional.silu(drafter.heads[-1](hidden))
        torch.testing.assert_close(drafter.normed(one, 7), last)  # past the heads: the last


def test_medusa_drafts_all_its_heads_in_one_block_forward():
    """Through the block tree (issue #56): query row j of the one block forward reads head j + 1 on the
    root's h_t (the last head past them), and the decode is AR's at T = 0."""
    target, cond = make_target(), tiny_condition()
    drafter = medusa(target)
    engine = build_method(load_preset("block", {"tree": {"depth": 5}}), target, drafter, GREEDY)
    blocks, block = [], engine.drafting.drafter_block

    def spy(roots, rows):
        f_hat, logits = block(roots, rows)
        blocks.append((roots.clone(), logits.clone()))
        return f_hat, logits

    engine.drafting.drafter_block = spy
    result = engine.generate(cond, [None, None])
    assert torch.equal(result.tokens, generate_ar(target, cond, GREEDY, [None, None]))
    assert all(st.drafter_forwards == 1 + 2 * st.steps for st in result.stats)  # prefill, block, catch-up
    assert blocks and all(logits.shape[1] == 4 for _, logits in blocks)  # depth − 1 query rows
    with torch.no_grad():
        for roots, logits in blocks:
            for j in range(4):  # heads 2, 3, then the last again (3 heads)
                torch.testing.assert_close(logits[:, j], drafter.logits(roots, j + 1), rtol=0, atol=0)


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
