"""PEANUT (adjacency-adaptive dynamic trees): the adaptation rule on scripted acceptances, the
initialisation strategies over the position grid, and losslessness (T=0 identity with AR, including long
oracle acceptances; T=1 chi-square against the exact AR distribution)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TINY_GPT, step_outcome, tiny_condition
from test_engine import (  # noqa: F401  (micro is a fixture)
    SIGNIFICANCE,
    chi_square_pvalue,
    make_drafter,
    make_target,
    micro,
    sample_images,
)

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.base import StepState
from vdtrain.decode.builders.peanut import PeanutTreeBuilder, PeanutTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import tree_builder
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import DraftTree

CHAMELEON = {"l_k": 3, "k_min": 3, "k_max": 14}  # the paper's Anole settings; the defaults are LlamaGen's


def make_builder(grid=(1, 64), batch=1, **kwargs) -> PeanutTreeBuilder:
    builder = PeanutTreeBuilder(PeanutTreeConfig(**kwargs), grid=grid)
    builder.reset(batch)
    return builder


def plan(builder, committed: int, generator=None) -> tuple[int, int]:
    """The (d̂, k̂) ``shape`` returns for a one-prompt batch with ``committed`` image tokens."""
    n = builder.grid[0] * builder.grid[1]
    state = StepState(
        roots=torch.zeros(1, dtype=torch.long),
        root_feats=None,
        root_logits=None,
        committed=torch.tensor([committed]),
        depth_limit=torch.tensor([n - 1 - committed]),
        generators=[generator],
    )
    rounds, widths = builder.shape(state)
    return int(rounds[0]) + 1, int(widths[0])


def chain(depth: int) -> DraftTree:
    """A one-prompt chain tree with ``depth`` draft levels."""
    size = depth + 1
    return DraftTree(
        torch.zeros(1, size, dtype=torch.long),
        torch.arange(-1, depth)[None],
        torch.arange(size)[None],
        torch.ones(1, size, dtype=torch.bool),
        None,
        sampled=False,
    )


def step(builder, committed: int, accepted, tree_depth: int | None = None) -> tuple[int, int, int]:
    """Plan a tree and have ``accepted`` of its drafts accepted ("F": every level); the tree drafted has
    d̂ levels unless ``tree_depth`` says otherwise. Returns (d̂, k̂, committed after)."""
    d, k = plan(builder, committed)
    depth = d if tree_depth is None else tree_depth
    accepted = depth if accepted == "F" else accepted
    assert accepted <= depth
    path = torch.tensor([list(range(1, accepted + 1)) + [-1] * (depth - accepted)])
    verdict = BatchVerdict(path, torch.tensor([accepted]), torch.zeros(1, dtype=torch.long), torch.zeros(1))
    verified = torch.ones(1, dtype=torch.bool)
    builder.observe(
        step_outcome(chain(depth), verdict, verified, torch.zeros(1), torch.tensor([committed - 1]))
    )
    return d, k, committed + accepted + 1


def run_script(builder, acceptances) -> list[tuple[int, int]]:
    """Drive the builder through one step per acceptance; returns each step's (d̂, k̂)."""
    shapes, committed = [], 1
    for accepted in acceptances:
        d, k, committed = step(builder, committed, accepted)
        shapes.append((d, k))
    return shapes


# --- the adaptation rule ---------------------------------------------------------------------------


def test_full_acceptance_deepens_and_narrows_until_the_bounds():
    builder = make_builder(**CHAMELEON)
    # d_init 5, k_init 10; every level accepted: +1 depth, −3 width, clamped to d < 10 and k > 3.
    assert run_script(builder, ["F"] * 7) == [(5, 10), (6, 7), (7, 4), (8, 4), (9, 4), (9, 4), (9, 4)]


def test_partial_acceptance_shallows_and_widens_until_the_bounds():
    builder = make_builder(**CHAMELEON)
    assert run_script(builder, [4, 0, 2, 1]) == [(5, 10), (4, 13), (3, 13), (2, 13)]


def test_width_is_only_restricted_while_the_tree_keeps_more_than_one_level():
    builder = make_builder(**CHAMELEON, total_tokens=20)
    # From depth 2 a miss makes d̃ − l_d = 1: a one-level tree, whose width may pass k_max (14) ...
    shapes = run_script(builder, [0] * 7 + ["F"] * 3)
    assert shapes[:4] == [(5, 10), (4, 13), (3, 13), (2, 13)]
    # ... up to the node budget (total_tokens − 1 = 19); a full one-level tree clamps it back.
    assert shapes[4:] == [(1, 16), (1, 19), (1, 19), (1, 19), (2, 13), (3, 10)]


def test_width_rule_reads_the_unclamped_depth():
    rule = PeanutTreeBuilder(PeanutTreeConfig(**CHAMELEON))
    assert rule.adapt(2, 13, alpha=0.0) == (1, 16)  # d̃ − l_d = 1: unrestricted
    assert rule.adapt(1, 13, alpha=0.0) == (1, 16)  # d̃ − l_d = 0, clamped to 1: unrestricted
    assert rule.adapt(3, 13, alpha=0.0) == (2, 13)  # d̃ − l_d = 2 > 1: restricted to k < 14
    assert rule.adapt(1, 40, alpha=1.0) == (2, 13)  # d̃ + l_d = 2 > 1: clamped back
    wide = PeanutTreeBuilder(PeanutTreeConfig(**CHAMELEON, l_d=2))
    assert wide.adapt(3, 13, alpha=0.0) == (1, 16)  # d̃ − l_d = 1 with a step of 2
    assert wide.adapt(4, 13, alpha=0.0) == (2, 13)


def test_llamagen_defaults():
    rule = PeanutTreeBuilder(PeanutTreeConfig())
    assert (rule.beta, rule.l_d, rule.l_k, rule.d_min, rule.d_max, rule.k_min, rule.k_max) == (
        1.0,
        1,
        10,
        0,
        10,
        3,
        40,
    )
    assert rule.adapt(5, 10, alpha=1.0) == (6, 4)
    assert rule.adapt(5, 35, alpha=0.8) == (4, 39)
    assert rule.adapt(2, 39, alpha=0.0) == (1, 49)
    assert rule.adapt(1, 55, alpha=0.0) == (1, 58)  # the node budget: 59 nodes with the root


def test_alpha_is_measured_against_the_tree_actually_drafted():
    builder = make_builder(**CHAMELEON)
    step(builder, 1, accepted=2, tree_depth=2)  # planned d̂ = 5, but the tree had 2 levels: all used
    assert float(builder.alpha[0]) == 1.0
    assert plan(builder, 4) == (6, 7)


def test_beta_sets_the_positive_threshold():
    builder = make_builder(**CHAMELEON, beta=0.5)
    assert run_script(builder, [3, 2]) == [(5, 10), (6, 7)]  # 3/5 ≥ 0.5: positive
    assert plan(builder, 8) == (5, 10)  # 2/6 < 0.5: negative


# --- initialisation over the grid --------------------------------------------------------------------


def test_accepted_positions_inherit_their_tree():
    builder = make_builder(grid=(2, 8), **CHAMELEON)
    step(builder, 1, accepted=3)  # root 0, drafts 1..3 accepted, bonus at 4
    step(builder, 5, accepted=0)  # root 4, bonus at 5
    depth, width = builder.maps()
    assert depth[0, 0].tolist() == [5, 5, 5, 5, 4, 4, -1, -1]
    assert width[0, 0].tolist() == [10, 10, 10, 10, 13, 13, -1, -1]
    assert builder.history[0] == [(0, 5, 10, 3), (4, 4, 13, 0)]


def seeded(init: str, **kwargs) -> PeanutTreeBuilder:
    """A 3 × 4 grid whose position p holds (d, k) = (1 + p % 9, 4 + p), after a positive tree."""
    builder = make_builder(grid=(3, 4), init=init, **CHAMELEON, **kwargs)
    builder.depth_grid[0, :12] = 1 + torch.arange(12) % 9
    builder.width_grid[0, :12] = 4 + torch.arange(12)
    builder.alpha[0] = 1.0
    return builder


@pytest.mark.parametrize(
    ("init", "root", "source"),
    [
        ("horizontal", 6, 5),  # (1, 2) ← (1, 1)
        ("horizontal", 3, 2),  # end of the first row ← its left neighbour
        ("horizontal", 4, 0),  # first column: (1, 0) ← (0, 0), the position above
        ("horizontal", 8, 4),  # (2, 0) ← (1, 0)
        ("vertical", 6, 2),  # (1, 2) ← (0, 2)
        ("vertical", 4, 0),  # (1, 0) ← (0, 0)
        ("vertical", 2, 1),  # first row: (0, 2) ← (0, 1), the position to the left
        ("vertical", 10, 6),  # (2, 2) ← (1, 2)
    ],
)
def test_initialisation_reads_the_adjacent_tree(init, root, source):
    builder = seeded(init)
    expected = builder.adapt(int(builder.depth_grid[0, source]), int(builder.width_grid[0, source]), 1.0)
    assert plan(builder, root + 1) == expected


def test_the_paper_names_of_the_strategies_are_accepted():
    assert PeanutTreeBuilder(PeanutTreeConfig(init="horizontal_repeat")).init == "horizontal"
    assert PeanutTreeBuilder(PeanutTreeConfig(init="vertical_repeat")).init == "vertical"


def test_first_tree_uses_the_initial_shape():
    for init in ("horizontal", "vertical"):
        assert plan(make_builder(init=init, d_init=3, k_init=20), 1) == (3, 20)


def test_random_initialisation_is_uniform_in_the_open_bounds_and_seeded():
    builder = make_builder(init="random", **CHAMELEON)
    draws = [plan(builder, 1, torch.Generator().manual_seed(s)) for s in range(300)]
    assert {d for d, _ in draws} == set(range(1, 10))
    assert {k for _, k in draws} == set(range(4, 14))
    again = make_builder(init="random", **CHAMELEON)
    assert [plan(again, 1, torch.Generator().manual_seed(s)) for s in range(300)] == draws


def test_random_initialisation_is_adapted_and_falls_back_to_an_owned_generator():
    def script(seed):
        builder = make_builder(init="random", **CHAMELEON, init_seed=seed)
        return run_script(builder, [0, "F", 0, "F", 0])

    first = script(0)
    assert first == script(0) != script(1)
    for d, k in first[1:]:  # adapted values stay inside the bounds (depth > 1: width restricted)
        assert 1 <= d <= 9 and (4 <= k <= 13 or d == 1)


def test_reset_forgets_the_grid():
    builder = make_builder(**CHAMELEON)
    run_script(builder, ["F", "F"])
    builder.reset(1)
    assert bool(builder.alpha.isnan().all()) and int(builder.depth_grid.max()) == -1
    assert plan(builder, 1) == (5, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init": "horizontal_sample"}, "initialisation"),
        ({"d_init": 10}, "inside the bounds"),
        ({"k_init": 3}, "inside the bounds"),
        ({"d_min": 3, "d_max": 4}, "open intervals"),
        ({"l_k": -1}, "steps"),
    ],
)
def test_impossible_peanut_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeanutTreeBuilder(PeanutTreeConfig(**kwargs))


def test_tree_config_builds_peanut():
    config = PeanutTreeConfig(init="vertical_repeat", l_k=3, k_max=14, total_tokens=30)
    builder = tree_builder(config)
    assert isinstance(builder, PeanutTreeBuilder)
    assert (builder.init, builder.l_k, builder.k_max, builder.total_tokens) == ("vertical", 3, 14, 30)


# --- losslessness --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init": "horizontal"},
        {"init": "vertical", **CHAMELEON},
        {"init": "random", **CHAMELEON},
        {"init": "horizontal", **CHAMELEON, "total_tokens": 8},  # small budget: the deep path is kept
    ],
    ids=["horizontal_llamagen", "vertical_chameleon", "random_chameleon", "small_budget"],
)
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_peanut_matches_ar_and_drafts_trees_of_depth_d(kwargs, cfg_scale):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    builder = PeanutTreeBuilder(PeanutTreeConfig(**kwargs))
    result = SpeculativeEngine(target, make_drafter(target), builder, sampling).generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)
    n = target.num_image_tokens
    for b, stats in enumerate(result.stats):
        # d̄ is PEANUT's d̂: each tree has d̂ levels unless the image ends first (depth limit n − 2 − root).
        assert stats.depth_per_step == [min(d, n - 2 - root) for root, d, _, _ in builder.history[b]]
        assert [a for _, _, _, a in builder.history[b]] == [c - 1 for c in stats.committed_per_step]


class OraclePeanut(PeanutTreeBuilder):
    """PEANUT trees whose deepest path carries the known AR continuation (wrong tokens elsewhere):
    every level is accepted, so the trees must deepen and narrow step after step."""

    def __init__(self, truth: torch.Tensor, **kwargs) -> None:
        super().__init__(PeanutTreeConfig(**kwargs))
        self.truth = truth

    def build(self, engine, state) -> DraftTree:
        tree = super().build(engine, state)
        vocab, n = engine.target.vocab_size, self.truth.shape[1]
        for b in range(len(state.roots)):
            depths = torch.where(tree.valid[b], tree.depths[b], -1)
            node = int(depths.argmax())  # a deepest node: its path is the one PEANUT always keeps
            path = []
            while node > 0:
                path.append(node)
                node = int(tree.parents[b, node])
            for node in path:
                position = min(int(state.committed[b]) - 1 + int(tree.depths[b, node]), n - 1)
                right = int(self.truth[b, position])
                siblings = (tree.parents[b] == tree.parents[b, node]) & (tree.tokens[b] == right)
                tree.tokens[b, siblings] = (right + 1) % vocab
                tree.tokens[b, node] = right
        return tree


def test_oracle_peanut_trees_deepen_and_narrow_and_match_ar():
    target = make_target(replace(TINY_GPT, block_size=64), image_size=16)  # 8 × 8 tokens
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    builder = OraclePeanut(ar, **CHAMELEON)
    result = SpeculativeEngine(target, make_drafter(target), builder, sampling).generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)
    for b, stats in enumerate(result.stats):
        shapes = [(d, k) for _, d, k, _ in builder.history[b]]
        assert shapes[:7] == [(5, 10), (6, 7), (7, 4), (8, 4), (9, 4), (9, 4), (9, 4)]
        assert stats.tau > 6 and stats.mean_depth > 6


def test_peanut_sampling_has_the_ar_distribution(micro):  # noqa: F811
    target, drafter, cond, sampling, exact = micro
    # Random initialisation then adaptation: tree shapes change between steps and draw from the
    # prompt's generator, interleaved with verification's draws. Width capped at the vocabulary (4).
    builder = PeanutTreeBuilder(
        PeanutTreeConfig(
            init="random",
            l_d=1,
            l_k=1,
            d_min=0,
            d_max=4,
            k_min=0,
            k_max=5,
            d_init=2,
            k_init=2,
            total_tokens=8,
        )
    )
    samples = sample_images(SpeculativeEngine(target, drafter, builder, sampling), cond, 6000, seed=11)
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE
