"""The block trees' confidence cut (``tree.cut``, issue #55 item 3): a level is drafted only while the
product of the slots' confidences (each slot's largest q) down to it reaches the cut. The cut is a
function of q alone, so the cut presets stay exact: AR's tokens at T = 0, AR's distribution at T = 1,
each prompt's sample whatever its batch. The distribution test has the power to catch the two ways to
break it: a cut on the drawn tokens' own q, and a node judged against another slot's q (test-only
builders below, not code paths of the library)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_drafter, tiny_condition
from test_block_drafter import GREEDY, SAMPLED
from test_engine import (
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    micro_problem,
    sample_images,
)
from test_exactness import assert_samples_alike_batched_and_alone
from test_graphs import _decode, _engine

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.block import BlockTreeBuilder
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.graphs import record_fx
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import guided_logits, split_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_CUT = 0.02  # on the tiny target (24 codes) with a random drafter: some steps cut, some not
# On the micro problem (4 codes) with the fixture's drafter, the first step's predicted reach of level 2 is
# 0.27-0.55 by the first token: 0.4 cuts it after about half of them. The drawn tokens' path q falls
# below 0.2 on some draws and not others, where a cut on it is biased.
MICRO_CUT, DRAWN_CUT = 0.4, 0.2
MICRO_DEPTH = 2  # its 4 image tokens leave a step at most 2 levels: the slots past them are never drafted


def cut_rows(engine: SpeculativeEngine) -> list[int]:
    """[rows cut, rows seen]: of every tree's rows that may draft level 2, those whose deepest valid node
    is above both the image's end and the tree's depth (only a cut leaves a rank-0 chain so short)."""
    counts, build = [0, 0], engine.builder.build

    def counted(ctx, state):
        tree = build(ctx, state)
        reach = state.depth_limit.clamp_max(int(tree.depths.max()))
        deepest = (tree.depths * tree.valid).amax(1)
        seen = reach >= 2
        counts[0] += int((seen & (deepest < reach)).sum())
        counts[1] += int(seen.sum())
        return tree

    engine.builder.build = counted
    return counts


def cut_method(name: str, target, drafter, sampling, cut: float | None, **tree) -> SpeculativeEngine:
    """Preset ``name`` with ``tree.cut`` and the other ``tree`` keys given."""
    return build_method(load_preset(name, {"tree": {"cut": cut, **tree}}), target, drafter, sampling)


@pytest.mark.parametrize("name", ["block", "block_tree"])
def test_a_cut_block_tree_decodes_ar_tokens_at_t0(name):
    """At T = 0 the cut reads the same confidence (``draft_confidence``), and the tokens stay AR's."""
    target, cond = make_target(image_size=8), tiny_condition(batch=2)
    drafter = random_drafter(target, std=0.3, kind="block")
    engine = cut_method(name, target, drafter, GREEDY, TINY_CUT)
    counts = cut_rows(engine)
    assert torch.equal(
        engine.generate(cond, [None, None]).tokens, generate_ar(target, cond, GREEDY, [None] * 2)
    )
    cut, seen = counts
    assert 0 < cut < seen, f"{cut} of {seen} rows cut: the test needs a cut that cuts some"


@pytest.fixture(scope="module")
def micro():
    target, cond = micro_problem()
    return (
        target,
        cond,
        random_drafter(target, std=0.3, kind="block"),
        exact_ar_distribution(target, cond, SAMPLED),
    )


@pytest.mark.parametrize("name", ["block", "block_tree", "block_tree_iid"])
def test_a_cut_block_tree_keeps_the_ar_distribution_at_t1(micro, name):
    """The cut decides from q alone, before and whatever the draws: AR's distribution, with about half
    the first steps cut."""
    target, cond, drafter, exact = micro
    engine = cut_method(name, target, drafter, SAMPLED, MICRO_CUT, depth=MICRO_DEPTH)
    counts = cut_rows(engine)
    samples = sample_images(engine, cond, 3000, seed=1)
    cut, seen = counts
    assert seen and 0.1 < cut / seen < 0.9, f"{cut} of {seen} rows cut: the test needs a cut that cuts often"
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


class DrawnTokenCut(BlockTreeBuilder):
    """The broken rule: a level kept while the drawn path's own q (the product of its tokens' q) reaches
    the cut, rather than the slots' confidences (level 1 kept, as ``BlockTreeBuilder.levels`` keeps it):
    which drafts are verified then depends on what was drawn."""

    def __init__(self, config) -> None:
        super().__init__(dataclasses.replace(config, cut=None))
        self.drawn_cut = config.cut

    def build(self, ctx, state):
        tree = super().build(ctx, state)
        parents = tree.parents.clamp_min(0)[..., None].expand(-1, -1, tree.q.shape[-1])
        q_drawn = tree.q.gather(1, parents).gather(2, tree.tokens[..., None]).squeeze(-1)  # [B, T]
        q_drawn[:, 0] = 1.0  # the root is committed
        path = q_drawn.clamp_min(1e-30).log().float() @ tree.ancestors[0].T.float()  # log q of each path
        tree.valid = tree.valid & ((tree.depths <= 1) | (path.exp() >= self.drawn_cut))
        return tree


class OtherSlotsQ(BlockTreeBuilder):
    """The broken rule: a chain's node judged against the next slot's q, not the q it was drawn from."""

    def build(self, ctx, state):
        tree = super().build(ctx, state)
        tree.q = torch.cat([tree.q[:, 1:], tree.q[:, -1:]], 1)
        return tree


@pytest.mark.parametrize("builder", [BlockTreeBuilder, DrawnTokenCut], ids=["confidence", "drawn_tokens"])
def test_a_cut_on_the_confidence_keeps_the_distribution_and_one_on_the_drawn_tokens_does_not(micro, builder):
    """Which drafts are verified must not depend on what was drawn. At ``DRAWN_CUT`` 6 000 samples reject
    the cut on the drawn path's q (p below 1e-7 on seeds 1, 2, 3), and accept the library's cut: the
    test fails if the library's rule is made to read the drawn tokens."""
    target, cond, drafter, exact = micro
    config = load_preset("block", {"tree": {"depth": MICRO_DEPTH, "cut": DRAWN_CUT}}).tree
    engine = SpeculativeEngine(target, drafter, builder(config), SAMPLED)
    pvalue = chi_square_pvalue(sample_images(engine, cond, 6000, seed=1), exact)
    assert pvalue > SIGNIFICANCE if builder is BlockTreeBuilder else pvalue < SIGNIFICANCE


def test_the_distribution_test_rejects_a_node_judged_against_another_slots_q(micro):
    target, cond, drafter, exact = micro
    builder = OtherSlotsQ(load_preset("block", {"tree": {"cut": MICRO_CUT, "depth": MICRO_DEPTH}}).tree)
    engine = SpeculativeEngine(target, drafter, builder, SAMPLED)
    assert chi_square_pvalue(sample_images(engine, cond, 1500, seed=1), exact) < SIGNIFICANCE


@pytest.mark.parametrize("name", ["block", "block_tree", "block_tree_iid"])
def test_a_cut_block_tree_samples_alike_batched_and_alone(name):
    target = make_target(image_size=8)
    engine = cut_method(name, target, random_drafter(target, std=0.2, kind="block"), SAMPLED, TINY_CUT)
    counts = cut_rows(engine)
    assert_samples_alike_batched_and_alone(engine)
    cut, seen = counts
    assert 0 < cut < seen, f"{cut} of {seen} rows cut: the test needs a cut that cuts some"


def test_a_cut_block_tree_step_records_and_replays(tmp_path):
    """The cut reads nothing from the device on the host and keeps the step's shapes: a step recorded by
    ``record_fx`` (which refuses a host sync) replays the eager decode."""
    eager = _engine("block_tree", 1.0, tmp_path, tree={"cut": TINY_CUT})
    recorded = _engine("block_tree", 1.0, tmp_path, record_fx, tree={"cut": TINY_CUT})
    counts = cut_rows(eager)
    for seed in (10, 20):
        want, got = _decode(eager, seed=seed), _decode(recorded, seed=seed)
        assert torch.equal(got.tokens, want.tokens) and got.stats == want.stats, f"decode {seed}"
    cut, seen = counts
    assert 0 < cut < seen, f"{cut} of {seen} rows cut: the test needs a cut that cuts some"


@pytest.mark.parametrize("cut", [0.0, 1.5])
def test_a_cut_outside_0_1_is_refused(cut):
    with pytest.raises(ValueError, match=r"tree.cut is a probability in \(0, 1\]"):
        BlockTreeBuilder(load_preset("block", {"tree": {"cut": cut}}).tree)


class TargetScaleQ(BlockTreeBuilder):
    """The broken rule: drafts drawn from q at the draft's scale (``tree.draft_cfg_scale``) but judged against
    the q of the target's scale."""

    def _draw(self, ctx, state, shape, logits):
        tree = super()._draw(ctx, state, shape, logits)
        q = guided_logits(*split_cfg(logits, ctx.sampling), ctx.sampling).softmax(-1)
        tree.q = q.index_select(1, shape.layout(q.device).node_slots)
        return tree


@pytest.mark.parametrize("builder", [BlockTreeBuilder, TargetScaleQ], ids=["draft_scale_q", "target_scale_q"])
def test_drafts_at_their_own_guidance_are_judged_against_the_q_they_were_drawn_from(micro, builder):
    """``tree.draft_cfg_scale`` 1 under the target's 2: the library judges each draft against the q it was
    drawn from and keeps AR's distribution; judging against the target-scale q does not (the test fails if
    the library's rule is made to)."""
    target, cond, drafter, exact = micro
    config = load_preset("block", {"tree": {"depth": MICRO_DEPTH}}).tree
    engine = SpeculativeEngine(target, drafter, builder(config), SAMPLED, draft_cfg_scale=1.0)
    pvalue = chi_square_pvalue(sample_images(engine, cond, 3000, seed=1), exact)
    assert pvalue > SIGNIFICANCE if builder is BlockTreeBuilder else pvalue < SIGNIFICANCE
