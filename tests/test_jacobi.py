"""SJD (speculative Jacobi decoding) and GSD on SJD: a Jacobi window drafted as a chain, no drafter.

T = 0: token identity with AR. T > 0: SJD's Theorem 1 (lossless) by the chi-square test of
``test_engine`` on targets small enough to enumerate every image, and the same test rejects a plausible
bug. The window rules (refinement, initialisations) are checked on scripted steps; GSD with G = 1 is SJD.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, step_outcome, tiny_condition
from reference_acceptance import Verdict, from_verdicts, verify_exact
from test_engine import (
    MICRO_GPT,
    MICRO_VQ,
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    sample_images,
)

from vdtrain.decode.acceptance import EXACT, BatchVerdict, Grouped, GsdConfig
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.budget import WHOLE_TREE
from vdtrain.decode.builders.base import StepState
from vdtrain.decode.builders.jacobi import INITS, JacobiTreeConfig, JacobiWindowBuilder
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import DecodeConfig, build_method, tree_builder
from vdtrain.decode.profiling import OpCounter
from vdtrain.decode.rng import RowRandom
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import DraftTree
from vdtrain.targets.base import Condition

# --- T = 0: identical tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_sjd_matches_ar(cfg_scale, init, window):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    engine = SpeculativeEngine(
        target, None, JacobiWindowBuilder(JacobiTreeConfig(window=window, init=init)), sampling
    )
    result = engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    assert torch.equal(result.tokens, ar)
    n = target.num_image_tokens
    for st in result.stats:
        assert sum(st.committed_per_step) == n - 1 and st.drafter_forwards == 0
        assert st.target_forwards == 1 + st.steps and max(st.depth_per_step) == min(window, n - 2)


# --- T > 0: SJD's Theorem 1 ----------------------------------------------------------------------------

GRID3_GPT = replace(TINY_GPT, vocab_size=3, block_size=9, cls_token_num=2)
GRID3_VQ = replace(TINY_VQ, codebook_size=3)


def enumerable(gpt, vq, image_size, seed=3, std=0.3, cfg_scale=2.0):
    """(target, condition, sampling at T = 1, every image's exact probability) for a target small enough
    to enumerate its images."""
    target = make_target(gpt, vq, image_size=image_size, seed=seed, std=std)
    cond = Condition(
        torch.randn(1, 2, gpt.caption_dim, generator=torch.Generator().manual_seed(5)),
        torch.ones(1, 2, dtype=torch.bool),
    )
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=1.0)
    return target, cond, sampling, exact_ar_distribution(target, cond, sampling)


@pytest.fixture(scope="module")
def micro():
    """test_engine's 2×2 grid, 4 tokens (4⁴ images)."""
    return enumerable(MICRO_GPT, MICRO_VQ, 4)


@pytest.fixture(scope="module")
def grid3():
    """A 3×3 grid over 3 tokens (3⁹ images): windows carried over several steps and cut at the end."""
    return enumerable(GRID3_GPT, GRID3_VQ, 6)


@pytest.mark.parametrize(
    ("fixture", "window", "init", "count"),
    [("micro", 2, "random", 6000), ("grid3", 3, "horizontal_sample", 4000)],
)
def test_sjd_sampling_has_the_ar_distribution(fixture, window, init, count, request):
    target, cond, sampling, exact = request.getfixturevalue(fixture)
    engine = SpeculativeEngine(
        target, None, JacobiWindowBuilder(JacobiTreeConfig(window=window, init=init)), sampling
    )
    samples = sample_images(engine, cond, count, seed=1)
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


class KeepDrafts(JacobiWindowBuilder):
    """A plausible bug (GSD's Algorithm 1 read literally): the unaccepted positions take the new
    distributions as q but keep their old tokens instead of being re-drawn from them."""

    def observe(self, outcome):
        super().observe(outcome)
        tree, verdict, verified = outcome.tree, outcome.verdict, outcome.verified
        win, k = self._windows, torch.arange(self.window)[None]
        old = tree.tokens.gather(1, (verdict.accepted[:, None] + 2 + k).clamp_max(tree.size - 1))
        drafted = verified[:, None] & (k < win.count[:, None] - 1)  # the last entry had no draft
        win.tokens = torch.where(drafted, old, win.tokens)


def test_the_distribution_test_rejects_refinement_without_redrawing(micro):
    target, cond, sampling, exact = micro
    engine = SpeculativeEngine(target, None, KeepDrafts(JacobiTreeConfig(window=2)), sampling)
    assert chi_square_pvalue(sample_images(engine, cond, 6000, seed=2), exact) < SIGNIFICANCE


def _chain(q_row: torch.Tensor, token: int) -> DraftTree:
    return DraftTree(
        torch.tensor([[0, token]]),
        torch.tensor([[-1, 0]]),
        torch.tensor([[0, 1]]),
        torch.ones(1, 2, dtype=torch.bool),
        torch.stack([q_row, torch.zeros_like(q_row)])[None],
        sampled=True,
    )


@pytest.mark.parametrize(
    ("q", "accept", "residual"),
    [
        ([0.2, 0.6, 0.2], 0.5, [1.0, 0.0, 0.0]),  # refined: min(1, p/q), norm(max(0, p − q))
        ([0.0, 1.0, 0.0], 0.3, [5 / 7, 0.0, 2 / 7]),  # fresh (point mass): p(x), p without x
    ],
)
def test_the_exact_walk_on_a_chain_is_sjd_verification(q, accept, residual):
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    tree, draws = _chain(torch.tensor(q), 1), 4000
    verdicts = [verify_exact(tree, 0, p, False, torch.Generator().manual_seed(i)) for i in range(draws)]
    accepted = sum(v.path == [1] for v in verdicts)
    assert abs(accepted / draws - accept) < 0.03
    bonus = torch.bincount(torch.tensor([v.bonus for v in verdicts if not v.path]), minlength=3)
    assert torch.allclose(bonus / bonus.sum(), torch.tensor(residual), atol=0.03)


# --- the window, step by step -------------------------------------------------------------------------

H, W, V = 3, 4, 8  # a 3×4 grid over 8 tokens


def _engine(temperature: float = 1.0, grid: tuple[int, int] = (H, W)):
    target = SimpleNamespace(grid=grid, num_image_tokens=grid[0] * grid[1], vocab_size=V)
    return SimpleNamespace(target=target, sampling=SamplingConfig(temperature=temperature))


def _state(root: int, committed: int, seed: int = 0, image: int = H * W) -> StepState:
    return StepState(
        roots=torch.tensor([root]),
        root_feats=None,
        root_logits=None,
        committed=torch.tensor([committed]),
        depth_limit=torch.tensor([image - 1 - committed]),
        generators=[None],
        rng=RowRandom(torch.tensor([seed])),
    )


def _point_masses(tokens: list[int]) -> torch.Tensor:
    """p_nodes [1, T, V]: node i predicts ``tokens[i]`` with certainty."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()[None]


def _is_point_mass(q: torch.Tensor, tokens: torch.Tensor) -> bool:
    return torch.equal(q, torch.nn.functional.one_hot(tokens, V).float())


def test_a_window_is_a_chain_of_fresh_point_masses():
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=4))
    builder.reset(1)
    tree = builder.build(_engine(), _state(root=5, committed=1))
    assert tree.tokens[0, 0] == 5 and tree.sampled
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3] and tree.depths[0].tolist() == [0, 1, 2, 3, 4]
    assert tree.valid.all() and builder.max_nodes(WHOLE_TREE) == 5
    assert _is_point_mass(tree.q[0, :4], tree.tokens[0, 1:])  # q of node i: what node i + 1 was drawn from
    # Never past the last image token: with 2 image tokens left to draft the window has 2 drafts.
    builder.reset(1)
    state = _state(root=5, committed=H * W - 3)
    assert state.depth_limit.item() == 2
    assert builder.build(_engine(), state).valid[0].tolist() == [True, True, True, False, False]


def test_refinement_redraws_the_positions_after_a_rejection():
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=4))
    builder.reset(1)
    tree = builder.build(_engine(), _state(root=5, committed=1))  # drafts for positions 1 .. 4
    # Node i predicts position 1 + i; positions 3, 4, 5 are spread over two tokens each.
    p = torch.zeros(1, 5, V)
    p[0, 0, 1] = p[0, 1, 2] = 1.0
    p[0, 2, [3, 4]] = 0.5
    p[0, 3, [5, 6]] = 0.5
    p[0, 4, [6, 7]] = 0.5
    # The draft at position 1 is accepted, the one at position 2 rejected: the bonus replaces it.
    builder.observe(step_outcome(tree, *batched([Verdict([1], bonus=7)], tree), p, torch.tensor([0])))
    nxt = builder.build(_engine(), _state(root=7, committed=3))
    # Positions 3, 4, 5 (depths 1, 2, 3 of the new chain) carry draws from the distributions just computed
    # for them (p at nodes 2, 3, 4 of the old chain, conditioned on the rejected draft) and those as q.
    refined = nxt.tokens[0, 1:4].tolist()
    assert refined[0] in (3, 4) and refined[1] in (5, 6) and refined[2] in (6, 7)
    assert torch.equal(nxt.q[0, :3], p[0, 2:5])
    # The window is refilled to 4 with one fresh token (position 6), q = its point mass.
    assert nxt.valid[0].all() and _is_point_mass(nxt.q[0, 3], nxt.tokens[0, 4])


def test_refined_tokens_are_drawn_with_the_prompts_row_random():
    p = torch.full((1, 5, V), 1.0 / V)
    runs = []
    for seed in (0, 0, 1):
        builder = JacobiWindowBuilder(JacobiTreeConfig(window=4))
        builder.reset(1)
        state = _state(root=5, committed=1, seed=seed)
        tree = builder.build(_engine(), state)
        builder.observe(
            step_outcome(tree, *batched([Verdict([], bonus=2)], tree), p, torch.tensor([0]), state.rng)
        )
        runs.append(builder.build(_engine(), _state(root=2, committed=2)).tokens[0, 1:].tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_all_accepted_and_greedy_refinement():
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=3))
    builder.reset(1)
    tree = builder.build(_engine(0.0), _state(root=5, committed=1))
    verdict = batched([Verdict([1, 2, 3], bonus=0)], tree)
    builder.observe(step_outcome(tree, *verdict, _point_masses([1, 2, 3, 4]), torch.tensor([0]), greedy=True))
    nxt = builder.build(_engine(0.0), _state(root=0, committed=5))
    assert _is_point_mass(nxt.q[0, :3], nxt.tokens[0, 1:])  # nothing left to refine: all fresh
    # At T = 0 refinement takes the argmax of the computed distributions (vanilla Jacobi).
    p = torch.softmax(torch.randn(1, 4, V, generator=torch.Generator().manual_seed(0)), -1)
    builder.observe(
        step_outcome(nxt, *batched([Verdict([], bonus=1)], nxt), p, torch.tensor([4]), greedy=True)
    )
    last = builder.build(_engine(0.0), _state(root=1, committed=6))
    assert torch.equal(last.tokens[0, 1:4], p[0, 1:4].argmax(-1))


# --- initialisations on a hand-made grid --------------------------------------------------------------
#
#   row 0:  x0  1   2   3         committed in step 1 (drafts at 1..4 accepted, bonus at 5);
#   row 1:  4   5   6*  7*        the stored distribution of position k is a point mass on stored(k)
#   row 2:  8*  9*  .   .         * = fresh in step 2 (window 6..9)
X0, BONUS = 6, 5


def stored(k: int) -> int:
    return {1: 1, 2: 2, 3: 3, 4: 4, 5: 7}[k]


def _step_two(init: str, seed: int = 0):
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=4, init=init))
    builder.reset(1)
    state = _state(root=X0, committed=1, seed=seed)
    first = builder.build(_engine(), state)
    p = _point_masses([stored(k) for k in range(1, 6)])
    verdict = batched([Verdict([1, 2, 3, 4], bonus=BONUS)], first)
    builder.observe(step_outcome(first, *verdict, p, torch.tensor([0]), state.rng))
    second = builder.build(_engine(), _state(root=BONUS, committed=6, seed=seed))
    board = [X0, *first.tokens[0, 1:].tolist(), BONUS]  # committed tokens of positions 0 .. 5
    fresh = second.tokens[0, 1:].tolist()  # positions 6, 7, 8, 9
    assert _is_point_mass(second.q[0, :4], second.tokens[0, 1:])
    return first.tokens[0, 1:].tolist(), board, fresh


def _first_window(init: str, window: int, seed: int) -> list[int]:
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=window, init=init))
    builder.reset(1)
    return builder.build(_engine(), _state(root=X0, committed=1, seed=seed)).tokens[0, 1:].tolist()


def _varies(init: str, position: int) -> bool:
    """The fresh token at ``position`` (6 .. 9) takes more than one value over seeds: random."""
    return len({_step_two(init, seed)[2][position - 6] for seed in range(12)}) > 1


def test_horizontal_repeat_copies_the_left_neighbour():
    drafts, _, fresh = _step_two("horizontal_repeat")
    assert drafts[:3] == [X0, X0, X0]  # positions 1, 2, 3 copy x0 along row 0
    assert fresh[0] == fresh[1] == BONUS and fresh[3] == fresh[2]  # 6 ← 5, 7 ← 6; 9 ← 8
    assert _varies("horizontal_repeat", 8)  # first column: random


def test_vertical_repeat_copies_the_token_one_row_up():
    drafts, board, fresh = _step_two("vertical_repeat")
    assert drafts[3] == X0  # position 4 ← position 0
    assert fresh == [board[2], board[3], board[4], board[5]]
    # First row: random (position 1 in step 1).
    assert len({_first_window("vertical_repeat", 3, seed)[0] for seed in range(12)}) > 1


def test_horizontal_sample_draws_from_the_nearest_stored_distribution_on_the_left():
    _, _, fresh = _step_two("horizontal_sample")
    assert fresh[0] == fresh[1] == stored(5)  # 6 ~ stored(5); 7: 6 is fresh, so stored(5) again
    assert _varies("horizontal_sample", 8) and _varies("horizontal_sample", 9)  # no stored in row 2


def test_vertical_sample_draws_from_the_stored_distribution_one_row_up():
    _, _, fresh = _step_two("vertical_sample")
    assert fresh == [stored(2), stored(3), stored(4), stored(5)]


def test_random_initialisation_is_uniform_over_the_image_tokens():
    _step_two("random")  # fresh q are point masses
    seen = torch.tensor([t for seed in range(40) for t in _first_window("random", 10, seed)])
    counts = torch.bincount(seen, minlength=V)
    assert len(counts) == V and (counts > 0).all()


def test_stored_distributions_are_the_refined_q_of_drafts_and_p_of_committed_tokens():
    """Position 6 after a rejection at position 2: its left neighbour 5 is a refined draft (stored = its
    new q), the position above it (2) is the bonus (stored = p at its node, not the residual)."""
    p = _point_masses([1, 2, 3, 4, 5])
    fresh = {}
    for init in ("horizontal_sample", "vertical_sample"):
        builder = JacobiWindowBuilder(JacobiTreeConfig(window=4, init=init))
        builder.reset(1)
        tree = builder.build(_engine(), _state(root=X0, committed=1))
        builder.observe(step_outcome(tree, *batched([Verdict([1], bonus=0)], tree), p, torch.tensor([0])))
        nxt = builder.build(_engine(), _state(root=0, committed=3))
        assert nxt.tokens[0, 1:4].tolist() == [3, 4, 5]  # refined positions 3, 4, 5
        fresh[init] = int(nxt.tokens[0, 4])  # position 6
    assert fresh == {"horizontal_sample": 5, "vertical_sample": 2}


# A 6 × 2 grid: step 1 commits positions 1 .. 3 (drafts) and 4 (bonus); the window of step 2 (positions
# 5, 6, 7) is all fresh and spans two rows, so position 7's walk up the column passes the fresh 5 to 3.
NARROW = (6, 2)


def _narrow_step_two(init: str) -> tuple[list[int], list[int]]:
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=3, init=init))
    builder.reset(1)
    engine, image = _engine(grid=NARROW), NARROW[0] * NARROW[1]
    first = builder.build(engine, _state(root=X0, committed=1, image=image))
    p = _point_masses([stored(k) for k in range(1, 5)])
    builder.observe(
        step_outcome(first, *batched([Verdict([1, 2, 3], bonus=BONUS)], first), p, torch.tensor([0]))
    )
    second = builder.build(engine, _state(root=BONUS, committed=5, image=image))
    return [X0, *first.tokens[0, 1:].tolist(), BONUS], second.tokens[0, 1:].tolist()


def test_vertical_initialisations_walk_past_fresh_positions_in_a_wide_window():
    board, fresh = _narrow_step_two("vertical_repeat")
    assert fresh == [board[3], board[4], board[3]]  # 7 ← 5 ← 3: a fresh token copies a fresh copy
    _, fresh = _narrow_step_two("vertical_sample")
    assert fresh == [stored(3), stored(4), stored(3)]  # 5 and 7 ~ stored(3): 5 is fresh, stores nothing


def test_horizontal_initialisations_stay_in_the_row():
    board, fresh = _narrow_step_two("horizontal_repeat")
    assert fresh[0] == board[4] and fresh[2] == fresh[1]  # 5 ← 4; 7 ← 6, itself first in its row
    _, fresh = _narrow_step_two("horizontal_sample")
    assert fresh[0] == stored(4)  # 5 ~ stored(4); 7: only the fresh 6 left of it: random


def test_repeat_past_an_unknown_token_draws_once_and_copies_it():
    """A window built without the steps before it (no committed board): position 5 has nothing known
    above it, draws uniformly, and 7 below it copies that draw; 6 copies the root at 4."""
    seen = set()
    for seed in range(12):
        builder = JacobiWindowBuilder(JacobiTreeConfig(window=3, init="vertical_repeat"))
        builder.reset(1)
        state = _state(root=BONUS, committed=5, seed=seed, image=NARROW[0] * NARROW[1])
        fresh = builder.build(_engine(grid=NARROW), state).tokens[0, 1:].tolist()
        assert fresh[1] == BONUS and fresh[2] == fresh[0]
        seen.add(fresh[0])
    assert len(seen) > 1


def test_impossible_windows_are_refused():
    with pytest.raises(ValueError, match="at least one draft"):
        JacobiWindowBuilder(JacobiTreeConfig(window=0))
    with pytest.raises(ValueError, match="unknown Jacobi initialisation"):
        JacobiWindowBuilder(JacobiTreeConfig(window=4, init="diagonal"))


# --- configuration and GSD on SJD ---------------------------------------------------------------------


def test_jacobi_config_builds_a_drafter_free_engine():
    target = make_target()
    config = DecodeConfig("sjd", JacobiTreeConfig(window=5, init="vertical_sample"))
    assert not config.needs_drafter
    builder = tree_builder(config.tree)
    assert isinstance(builder, JacobiWindowBuilder) and (builder.window, builder.init) == (
        5,
        "vertical_sample",
    )
    method = build_method(config, target, None, SamplingConfig())
    assert isinstance(method, SpeculativeEngine) and method.drafting.drafter is None


def _gsd(target, group_size: int) -> Grouped:
    return Grouped(
        GsdConfig(group_size=group_size, delta_p=0.15, max_distance=100.0),
        target.token_embedding.weight.detach(),
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gsd_with_group_size_one_is_sjd(temperature):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature, top_k=12)
    runs = []
    for accept in (EXACT, _gsd(target, 1)):
        engine = SpeculativeEngine(
            target,
            None,
            JacobiWindowBuilder(JacobiTreeConfig(window=6, init="horizontal_sample")),
            sampling,
            accept=accept,
        )
        runs.append(engine.generate(cond, [torch.Generator().manual_seed(10 + i) for i in range(2)]))
    sjd, gsd = runs
    assert torch.equal(sjd.tokens, gsd.tokens)
    assert [s.committed_per_step for s in sjd.stats] == [s.committed_per_step for s in gsd.stats]
    assert all(s.relaxed_acceptances == 0 for s in gsd.stats)


def test_gsd_groups_accept_more_than_sjd():
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    engine = SpeculativeEngine(
        target, None, JacobiWindowBuilder(JacobiTreeConfig(window=6)), sampling, accept=_gsd(target, 14)
    )
    result = engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    assert sum(s.relaxed_acceptances for s in result.stats) > 0


def batched(verdicts: list[Verdict], tree: DraftTree) -> tuple[BatchVerdict, torch.Tensor]:
    """``observe``'s (verdict, verified) for per-row verdicts, every row verified."""
    return from_verdicts(verdicts, tree.size - 1), torch.ones(len(verdicts), dtype=torch.bool)


# --- batched: a step reads nothing, and a prompt's drafts do not depend on its batch ------------------

VERDICTS = [Verdict([], bonus=1), Verdict([1], bonus=2), Verdict([1, 2, 3, 4, 5], bonus=0)]


def _prompts(batch: int) -> list[tuple[int, int, int]]:
    """(seed, tokens committed before the first step, verdict) of ``batch`` prompts at different progress."""
    return [(b, b % 7 + 1, b % 3) for b in range(batch)]


def _two_steps(init: str, temperature: float, prompts: list[tuple[int, int, int]], counted: bool = False):
    """Two build + observe steps (each prompt gets the same verdict both times); returns the second
    step's tree and, with ``counted``, that step's (host syncs, ATen ops) as a GPU would see them."""
    batch = len(prompts)
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=5, init=init))
    builder.reset(batch)
    engine = _engine(temperature)
    committed = torch.tensor([c for _, c, _ in prompts])
    rng = RowRandom(torch.tensor([seed for seed, _, _ in prompts]))
    p = torch.softmax(torch.randn(len(VERDICTS), 6, V, generator=torch.Generator().manual_seed(1)), -1)
    p = p[[v for _, _, v in prompts]]
    verdict = from_verdicts([VERDICTS[v] for _, _, v in prompts], 5)
    verified = torch.ones(batch, dtype=torch.bool)
    counter = OpCounter(as_if_gpu=True)
    for step in range(2):
        state = StepState(
            roots=committed % V,
            root_feats=None,
            root_logits=None,
            committed=committed,
            depth_limit=H * W - 1 - committed,
            generators=[None] * batch,
            rng=rng,
        )
        if step and counted:
            counter.__enter__()
        tree = builder.build(engine, state)
        builder.observe(step_outcome(tree, verdict, verified, p, committed - 1, rng, engine.sampling.greedy))
        if step and counted:
            counter.__exit__(None, None, None)
        committed = committed + verdict.accepted + 1
        rng.advance()
    return tree, (counter.counts.syncs, counter.counts.ops)


@pytest.mark.parametrize("init", ["random", "horizontal_repeat", "vertical_sample"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_reads_nothing_and_costs_the_same_ops_at_any_batch(temperature, init):
    """Issue #14's budget for the builder alone (tests/test_step_budget.py checks whole decodes)."""
    _, one = _two_steps(init, temperature, _prompts(1), counted=True)
    _, eight = _two_steps(init, temperature, _prompts(8), counted=True)
    assert one[0] == eight[0] == 0
    assert one[1] == eight[1]


@pytest.mark.parametrize("init", INITS)
def test_a_prompts_window_is_the_same_batched_and_alone(init):
    prompts = _prompts(6)
    together, _ = _two_steps(init, 1.0, prompts)
    for b, prompt in enumerate(prompts):
        alone, _ = _two_steps(init, 1.0, [prompt])
        assert torch.equal(together.tokens[b], alone.tokens[0]) and torch.equal(together.q[b], alone.q[0])
        assert torch.equal(together.valid[b], alone.valid[0])


def test_the_builder_needs_the_runs_row_random():
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=4))
    state = _state(root=5, committed=1)
    state.rng = None
    with pytest.raises(ValueError, match="RowRandom"):
        builder.build(_engine(), state)


def test_the_tree_bounds_its_depth_and_width_on_the_host():
    builder = JacobiWindowBuilder(JacobiTreeConfig(window=16))
    builder.reset(1)
    tree = builder.build(_engine(), _state(root=5, committed=1))
    assert (tree.depth_bound, tree.width_bound) == (H * W - 2, 1)
    assert int(tree.max_depth()[0]) == H * W - 2
