"""The block drafter kind (issue #48): each training step's blocks are drawn from the step's generator (so
resume is exact); one forward of it drafts a block, the block a decode drafts is the block training
scores, and the block presets verify it exactly: AR's tokens at T = 0, AR's distribution at T = 1 with a
spread-out q, relaxed rules at their exact settings reproduce exact verification, a drafter that drafts
no blocks is refused. The registry-driven tests cover the rest: fit trains, exports and reloads the kind
and the block presets decode AR's tokens with it (tests/test_drafter_kinds.py); the block presets decode
with a block drafter (``conftest.drafter_kind_for``) for AR's distribution at T = 1 with a confident q
(tests/test_exactness.py, tests/test_chameleon_decoding.py), batch independence, a recorded step
(tests/test_graphs.py) and the step budget (tests/test_step_budget.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_drafter, tiny_condition
from test_engine import (
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    micro_problem,
    sample_images,
)
from test_fit import fit_config, shapes_batch

from benchmarks.block_drafting import xl_depth_ops
from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.phase_ops import KernelWeights
from vdtrain.decode.sampling import SamplingConfig, combine_cfg
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.block import training_roots
from vdtrain.target_settings import target_config, world_knobs
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps
from vdtrain.train.fit_parts import build_drafter
from vdtrain.train.module import DrafterModule

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)


def test_the_loss_draws_its_blocks_from_the_steps_generator(tiny_folder):
    """What a step trains is a function of its generator (fit seeds one per step, rank and micro-batch),
    so a resumed run repeats the uninterrupted one (tests/test_fit.py checks the machinery); the null
    rows come from ``prepare`` as for every kind."""
    target = load_target({"kind": "folder", "folder": str(tiny_folder)})
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="block", slots=4, train_roots=5), target)
    torch.manual_seed(0)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.1)
    module = DrafterModule(
        target, drafter, DrafterTrainConfig(), OptimConfig(), features="online", p_null=0.5
    )
    batch = shapes_batch(2)

    def loss(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total, parts = module.loss(batch, torch.Generator().manual_seed(seed))
        return total.detach(), parts

    (first, parts), (again, _), (other, _) = loss(3), loss(3), loss(4)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert {"feature", "cls", "top1", "block", "tau_block", "top1_slot3"} <= set(parts)
    roots = training_roots(256, 5, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert roots.tolist() == sorted(set(roots.tolist())) and len(roots) == 5 and int(roots.max()) < 254


@pytest.mark.parametrize(
    "options",
    [{}, {"layers": 2, "feature_layers": [1, 2], "query_state": True}],
    ids=["shipped", "two_layers_taps_query_state"],
)
def test_the_block_a_decode_drafts_is_the_block_training_scores(options):
    """Every query row the builder drafts (its position, mask, root feature and token above) gives the
    logits of the same row in ``teacher_blocks``, training's pass, on the decoded tokens; the decode is
    AR's, one block drafter forward per step beside the catch-up. Also for the options issue #55's search
    added: a second layer (its own cache layer), target layers fused into the rows' features (the decode's
    taps), a learned state per query offset."""
    target = make_target(image_size=8)  # 4 × 4 tokens: rows above and blocks that run past the image
    drafter = random_drafter(target, std=0.3, kind="block", **options)
    cond = tiny_condition(batch=2)
    engine = build_method(load_preset("block", {"tree": {"depth": 5}}), target, drafter, GREEDY)
    drafted, block = [], engine.drafting.drafter_block

    def spy(roots, rows):
        f_hat, logits = block(roots, rows)
        drafted.append((engine.run.committed.clone(), logits[: len(cond)].clone()))  # the cond stream
        return f_hat, logits

    engine.drafting.drafter_block = spy
    result = engine.generate(cond, [None, None])
    tokens = result.tokens
    assert torch.equal(tokens, generate_ar(target, cond, GREEDY, [None, None]))
    assert all(st.drafter_forwards == 1 + 2 * st.steps for st in result.stats)  # prefill, block, catch-up
    num = target.num_image_tokens
    with torch.no_grad():
        feats = target.sequence_features(cond, tokens, drafter.taps).float()
        states = drafter.input_features(*split_taps(feats, target.hidden_size, len(drafter.taps)))
        teacher = drafter.teacher_blocks(states, tokens, cond.mask, torch.arange(num - 2))
    compared = 0
    for committed, logits in drafted:
        count = logits.shape[1]  # the preset's depth − 1 of the drafter's 7 query rows
        for b, root in enumerate((committed - 1).tolist()):
            if root >= num - 2:  # no query token left in the image
                continue
            inside = teacher.drafted[root, :count] < num
            want = drafter.logits(teacher.queries[b, root, :count])
            torch.testing.assert_close(logits[b, inside], want[inside], rtol=0, atol=1e-4)
            compared += int(inside.sum())
    assert compared > 20


def test_the_search_options_are_checked():
    target = make_target()
    with pytest.raises(ValueError, match="at least one layer"):
        Drafter.make(DrafterConfig.for_target(target, kind="block", layers=0))
    with pytest.raises(ValueError, match=r"feature_layers \[3\] outside 0 .. 2"):
        Drafter.make(DrafterConfig.for_target(target, kind="block", feature_layers=[3]))


def test_init_from_adds_taps_and_query_state_to_a_saved_drafter_which_drafts_the_same(tmp_path):
    """fit's ``drafter.init_from`` grows a block drafter saved without taps or a query state by them (parts
    that start at zero): its trained weights kept, the same rows and blocks. Any other change is refused."""
    target = make_target(image_size=8)
    saved = random_drafter(target, std=0.3, kind="block")
    saved.save_pretrained(tmp_path / "saved")
    start = (f"drafter.init_from={tmp_path / 'saved'}", "drafter.kind=block")
    grow = ("+drafter.options.feature_layers=[1,2]", "+drafter.options.query_state=true")
    grown = build_drafter(fit_config(tmp_path, tmp_path / "run", *start, *grow), target)
    assert grown.taps == (1, 2) and grown.options.query_state and grown.options.width == saved.options.width
    cond, tokens = tiny_condition(batch=2), torch.randint(0, 16, (2, target.num_image_tokens))
    with torch.no_grad():
        feats = target.sequence_features(cond, tokens, grown.taps).float()
        hidden, tapped = split_taps(feats, target.hidden_size, 2)
        roots = torch.arange(0, target.num_image_tokens - 2, 3)
        want = saved.teacher_blocks(hidden, tokens, cond.mask, roots)
        got = grown.teacher_blocks(grown.input_features(hidden, tapped), tokens, cond.mask, roots)
    torch.testing.assert_close(got.rows, want.rows, rtol=0, atol=0)
    torch.testing.assert_close(got.queries, want.queries, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"options.width=128 .*only \['feature_layers', 'query_state'\] can be"
    ):
        build_drafter(fit_config(tmp_path, tmp_path / "run", *start, "+drafter.options.width=128"), target)
    grown.save_pretrained(tmp_path / "grown")
    again = (
        f"drafter.init_from={tmp_path / 'grown'}",
        "drafter.kind=block",
        "+drafter.options.feature_layers=[2]",
    )
    with pytest.raises(ValueError, match=r"feature_layers=\[2\] \(saved \(1, 2\)\)"):
        build_drafter(fit_config(tmp_path, tmp_path / "run", *again), target)


def test_a_block_tree_needs_a_drafter_that_drafts_blocks():
    target = make_target(image_size=8)
    with pytest.raises(ValueError, match=r"eagle1 drafter drafts none .*drafter.kind=block"):
        build_method(load_preset("block"), target, random_drafter(target), GREEDY)
    short = random_drafter(target, kind="block")
    config = dataclasses.replace(short.config, options={"slots": 4})
    with pytest.raises(ValueError, match=r"depth 8 .* drafts 4 "):
        build_method(load_preset("block"), target, Drafter.make(config), GREEDY)
    with pytest.raises(ValueError, match=r"an? eagle1 drafter drafts no blocks"):
        random_drafter(target).block_queries(torch.zeros(1, 4), 2)


@pytest.mark.parametrize(
    "relaxed",
    [{"kind": "lantern_pp", "lam": 1.0, "k": 3}, {"kind": "gsd", "group_size": 1}],
    ids=["lantern_pp_lam_1", "gsd_group_1"],
)
def test_relaxed_rules_at_their_exact_settings_verify_a_block_tree_exactly(relaxed, tmp_path):
    """LANTERN++ and GSD apply to a block tree's verification as to an eagle tree's; λ = 1 and G = 1
    decode exact verification's tokens and steps, bit for bit, at T = 1."""
    target, cond = make_target(image_size=8), tiny_condition(batch=3)
    drafter = random_drafter(target, std=0.3, kind="block")

    def decode(acceptance: dict):
        config = load_preset("block_tree", {"acceptance": {**acceptance, "cache_dir": str(tmp_path)}})
        gens = [torch.Generator().manual_seed(40 + i) for i in range(3)]
        return build_method(config, target, drafter, SAMPLED).generate(cond, gens)

    exact, relaxed_result = decode({"kind": "exact"}), decode(relaxed)
    assert torch.equal(relaxed_result.tokens, exact.tokens)
    steps = [st.committed_per_step for st in exact.stats]
    assert [st.committed_per_step for st in relaxed_result.stats] == steps
    assert max(max(s) for s in steps) > 1  # drafts were accepted


def test_a_block_drafter_drafts_one_depth_per_call_for_the_other_trees():
    target, cond = make_target(image_size=8), tiny_condition()
    drafter = random_drafter(target, std=0.3, kind="block")
    result = build_method(load_preset("eagle2"), target, drafter, GREEDY).generate(cond, [None, None])
    assert torch.equal(result.tokens, generate_ar(target, cond, GREEDY, [None, None]))
    assert max(max(st.depth_per_step) for st in result.stats) > 2


@pytest.mark.parametrize("name", ["block_tree", "block_tree_iid"])
def test_a_block_tree_keeps_the_ar_distribution_at_t1(name):
    """A spread-out q (the registry's test has a confident one): siblings drawn from their slot's q,
    without replacement or i.i.d., and judged against it (a chain is the tree's width-1 case)."""
    target, cond = micro_problem()
    drafter = random_drafter(target, std=0.5, kind="block")
    engine = build_method(load_preset(name), target, drafter, SAMPLED)
    samples = sample_images(engine, cond, 3000, seed=1)
    assert chi_square_pvalue(samples, exact_ar_distribution(target, cond, SAMPLED)) > SIGNIFICANCE


def test_iid_siblings_are_drawn_at_their_own_uniforms_and_repeat_where_q_is_peaked():
    """``tree.with_replacement``: a node's children are independent inverse-CDF draws at their own
    uniforms, so its first child is the one drawn without replacement, and a confident q repeats tokens
    among siblings (which draws without replacement never do); the tree says which rule verifies it."""
    target, cond = make_target(image_size=8), tiny_condition(batch=2)
    drafter = random_drafter(target, std=0.3, kind="block")

    def trees(name: str) -> list:
        engine, seen = build_method(load_preset(name), target, drafter, SAMPLED), []
        build = engine.builder.build
        engine.builder.build = lambda ctx, state: seen.append(build(ctx, state)) or seen[-1]
        engine.generate(cond, [torch.Generator().manual_seed(7 + i) for i in range(2)])
        return seen

    def repeats(tree) -> int:
        same = tree.earlier_siblings() & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
        return int(same.any(-1).sum())

    plain, iid = trees("block_tree"), trees("block_tree_iid")
    ranks = plain[0].sibling_ranks[0]
    first = (ranks == 0) & (plain[0].parents[0] >= 0)
    assert torch.equal(iid[0].tokens[:, first], plain[0].tokens[:, first])
    assert not torch.equal(iid[0].tokens[:, ~first], plain[0].tokens[:, ~first])
    assert iid[0].with_replacement and not plain[0].with_replacement
    assert sum(map(repeats, iid)) > 0 and sum(map(repeats, plain)) == 0


def test_the_guided_loss_scores_the_cfg_combined_logits_a_decode_verifies(tiny_folder):
    """``drafter.guided_scale``: every sample in both streams (conditional half first), and the agreement
    the loss reports is that of the guided logits ``u + s·(c − u)`` of drafter and target, computed here
    from each stream's logits as the decode combines them; at s = 1 it is the conditional stream's."""
    target = load_target({"kind": "folder", "folder": str(tiny_folder)})
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="block", slots=4, train_roots=5), target)
    torch.manual_seed(0)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.1)

    def module(scale: float | None) -> DrafterModule:
        train = DrafterTrainConfig(cls_loss="acceptance", guided_scale=scale)
        return DrafterModule(target, drafter, train, OptimConfig(), features="online")

    guided, batch = module(3.0), shapes_batch(2)
    tokens, mask, states = guided.training_inputs(batch, torch.Generator().manual_seed(0))
    cond = guided.prepare(batch, torch.zeros(2, dtype=torch.bool))
    null = guided.prepare(batch, torch.ones(2, dtype=torch.bool))
    assert torch.equal(states[:2], cond[2]) and torch.equal(states[2:], null[2])
    assert torch.equal(mask[2:], null[1]) and torch.equal(tokens[2:], tokens[:2])
    total, parts = guided.loss_on(tokens, mask, states, None, 0.0)
    total.backward()
    assert drafter.out.weight.grad.abs().sum() > 0

    with torch.no_grad():
        num, prefix = tokens.shape[1], mask.shape[1]
        roots = drafter.training_roots(num, None, tokens.device)
        teacher = drafter.teacher_blocks(states, tokens, mask, roots)
        q = drafter.logits(teacher.queries)  # [2B, R, J, V]
        p = drafter.head_logits(states[:, prefix + teacher.drafted.clamp_max(num - 1) - 1])
        q_top = combine_cfg(q[:2], q[2:], 3.0).argmax(-1)
        p_top = combine_cfg(p[:2], p[2:], 3.0).argmax(-1)
    for j in range(1, 4):
        at = (teacher.drafted - roots[:, None] - 1 == j) & (teacher.drafted < num)
        want = (q_top == p_top)[:, at].float().mean()
        torch.testing.assert_close(parts[f"top1_slot{j}"], want)
    assert "stream_tau_block" in parts and parts["guided"] > 0

    _, at_one = module(1.0).loss_on(tokens, mask, states, None, 0.0)
    _, cond_only = module(None).loss_on(tokens[:2], mask[:2], states[:2], None, 0.0)
    for name in ("top1", "top1_slot1", "top1_slot3", "tau_block"):
        torch.testing.assert_close(at_one[name], cond_only[name])


def test_guided_training_is_refused_where_it_cannot_be_computed(tiny_folder):
    target = load_target({"kind": "folder", "folder": str(tiny_folder)})
    train = DrafterTrainConfig(guided_scale=3.0)
    eagle = Drafter.make(DrafterConfig.for_target(target, kind="eagle1"), target)
    with pytest.raises(ValueError, match="guided_scale is the block kind's"):
        DrafterModule(target, eagle, train, OptimConfig())
    block = Drafter.make(DrafterConfig.for_target(target, kind="block"), target)
    with pytest.raises(ValueError, match=r"data\.features=online"):
        DrafterModule(target, block, train, OptimConfig(), features="offline")


def test_a_draft_guidance_below_the_targets_keeps_ar_exact():
    """``tree.draft_cfg_scale`` makes q alone (here the conditional stream's, scale 1, under the target's
    scale 2): the chain still keeps AR's distribution at T = 1 and AR's tokens at T = 0."""
    target, cond = micro_problem()
    drafter = random_drafter(target, std=0.5, kind="block")
    config = load_preset("block", {"tree": {"draft_cfg_scale": 1.0}})
    engine = build_method(config, target, drafter, SAMPLED)
    assert engine.drafting.draft_sampling.cfg_scale == 1.0 and engine.drafting.sampling.cfg_scale == 2.0
    samples = sample_images(engine, cond, 3000, seed=1)
    assert chi_square_pvalue(samples, exact_ar_distribution(target, cond, SAMPLED)) > SIGNIFICANCE
    tiny, prompts = make_target(image_size=8), tiny_condition()
    greedy = build_method(config, tiny, random_drafter(tiny, std=0.3, kind="block"), GREEDY)
    result = greedy.generate(prompts, [None, None])
    assert torch.equal(result.tokens, generate_ar(tiny, prompts, GREEDY, [None, None]))
    assert max(max(st.committed_per_step) for st in result.stats) > 1
    with pytest.raises(ValueError, match="draft_cfg_scale must be >= 1"):
        build_method(load_preset("block", {"tree": {"draft_cfg_scale": 0.5}}), target, drafter, SAMPLED)


def test_the_block_presets_draft_at_a_quarter_of_eagle2s_weighted_ops_without_a_selection():
    """Issue #55's draft-cost goal at XL depth (``benchmarks.block_drafting``'s count, grain's knobs and
    drafter options): the chain, at both temperatures, and the tree at T = 0 and with i.i.d. siblings at
    T = 1, draft in at most a quarter of eagle2's weighted ops, and no block draft makes a vocabulary-wide
    selection (at T = 0 the top ranks are ``selection.top_k_low_index_first``'s, a reduction at k = 1)."""
    knobs, options = world_knobs(target_config("grain")), {"width": 64, "feature_layers": [2, 4, 8]}
    weights = KernelWeights.load()
    eagle2 = xl_depth_ops(["eagle2"], knobs, options, 1.0)["eagle2"].weighted_phase("draft", weights)
    for temperature, presets in ((1.0, ["block", "block_tree_iid"]), (0.0, ["block", "block_tree"])):
        for name, ops in xl_depth_ops(presets, knobs, options, temperature).items():
            draft = ops.weighted_phase("draft", weights)
            assert draft == ops.phases["draft"], f"{name} at T = {temperature:g}: a selection in its draft"
            assert draft <= eagle2 / 4, (
                f"{name} at T = {temperature:g}: {draft:.0f} against eagle2's {eagle2:.0f}"
            )
