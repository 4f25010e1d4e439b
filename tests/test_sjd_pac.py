"""SJD-PAC: a drafter-free tree (full W-ary tree of D levels + a chain) with the engine's exact walk.

T = 0: token identity with AR. T = 1: chi-square tests over whole images, every position and every
pair of adjacent positions (``image_statistics``, Bonferroni-bound) on targets small enough to enumerate
every image, one of which drafts the chain and one of which forces tokens (Lumina-mGPT's end-of-row
column). The same tests reject the release's B1–B4 and a stale-q B5, implemented here only. The window
rules (shared columns, siblings, continuation, fresh uniform positions) are checked on scripted steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import step_outcome, tiny_condition
from image_statistics import bonferroni_pvalue
from reference_acceptance import Verdict, from_verdicts, residual, verify_exact
from test_chameleon_decoding import BOS, WORDS, enumerable_target
from test_engine import (
    MICRO_GPT,
    MICRO_VQ,
    SIGNIFICANCE,
    RowVerifierEngine,
    exact_ar_distribution,
    make_target,
    sample_images,
)
from test_jacobi import (
    GRID3_GPT,
    GRID3_VQ,
    enumerable,
    grid3,  # noqa: F401  (the 3×3 grid over 3 tokens, a module fixture)
)

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.budget import WHOLE_TREE
from vdtrain.decode.builders.base import StepState
from vdtrain.decode.builders.sjd_pac import SjdPacBuilder, SjdPacTreeConfig, tree_nodes
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import build_method, load_preset, tree_builder
from vdtrain.decode.profiling import OpCounter
from vdtrain.decode.rng import Purpose, RowRandom, inverse_cdf
from vdtrain.decode.sampling import SamplingConfig

# --- T = 0: identical tokens --------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "width", "levels"), [(64, 3, 3), (16, 3, 3), (6, 2, 2), (4, 1, 1)])
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_sjd_pac_matches_ar(cfg_scale, window, width, levels):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=window, width=width, levels=levels))
    engine = SpeculativeEngine(target, None, builder, sampling)
    result = engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    assert torch.equal(result.tokens, ar)
    n = target.num_image_tokens
    for st in result.stats:
        assert sum(st.committed_per_step) == n - 1 and st.drafter_forwards == 0
        assert st.target_forwards == 1 + st.steps
        assert max(st.depth_per_step) == min(builder.main_depth, n - 2)


# --- T = 1: the distribution over whole images, and the release's bugs -------------------------------


@pytest.fixture(scope="module")
def sharp():
    """A 2×2 grid over 4 tokens whose next-token distributions are peaked and depend strongly on the token
    before (weights of std 1, no CFG): a later sibling's subtree is often accepted where the first
    sibling's is not, which is where B1 departs from the first accepted sibling (a first-step analysis put
    its total-variation distance at 0.05, the largest of 48 candidate targets)."""
    return enumerable(MICRO_GPT, MICRO_VQ, 4, seed=6, std=1.0, cfg_scale=1.0)


@pytest.fixture(scope="module")
def sharp3x3():
    """A 3×3 grid over 3 tokens (3⁹ images) with peaked, context-dependent distributions (weights of std
    1, no CFG): the (9, 2, 3) window's main path reaches depth 4, so its chain (depths 3 and 4) is drafted
    and continued. Chosen among a few seeds as the one where each of B2–B5 moves the most mass."""
    return enumerable(GRID3_GPT, GRID3_VQ, 6, seed=3, std=1.0, cfg_scale=1.0)


@pytest.fixture(scope="module")
def lumina_forced():
    """Lumina-mGPT's layout on a 2×2 code grid: every third token is the forced end of row (3⁴ possible
    images of 6 tokens); the (6, 2, 2) window's chain reaches depth 4, past the forced column."""
    target = enumerable_target("lumina_mgpt")
    cond = target.condition_from_ids([[BOS, *WORDS, *target.layout.image_prefix]])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0)
    exact = exact_ar_distribution(target, cond, sampling)
    return target, cond, sampling, {x: p for x, p in exact.items() if p > 0}


@pytest.mark.parametrize(
    ("fixture", "shape", "count"),
    [
        ("sharp", (8, 2, 3), 4000),
        ("grid3", (9, 2, 3), 6000),
        ("sharp3x3", (9, 2, 3), 8000),
        ("lumina_forced", (6, 2, 2), 4000),
    ],
    ids=["sharp_W2_D3", "grid3_W2_D3_chain_cfg", "sharp3x3_W2_D3_chain", "lumina_forced_W2_D2_chain_cfg"],
)
def test_sjd_pac_sampling_has_the_ar_distribution(fixture, shape, count, request):
    """Whole images, every position and every adjacent pair, under one Bonferroni bound; the fixtures
    other than ``sharp`` (which is there for B1) draft the chain."""
    target, cond, sampling, exact = request.getfixturevalue(fixture)
    length, width, levels = shape
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=length, width=width, levels=levels))
    engine = SpeculativeEngine(target, None, builder, sampling)
    samples = sample_images(engine, cond, count, seed=1)
    assert set(samples) <= set(exact)  # no impossible image (forced tokens included)
    assert bonferroni_pvalue(samples, exact) > SIGNIFICANCE
    if fixture != "sharp":
        deepest = max(max(st.depth_per_step) for st in engine.generate(cond, [None]).stats)
        assert deepest == builder.main_depth > builder.levels - 1  # the chain was drafted


def longest_accepted_path(tree, row, p_nodes, greedy, generator) -> Verdict:
    """B1: every sibling is judged (on the residual of the earlier ones, as if they were rejected) and the
    accepted child with the longest accepted run below it is committed, not the first accepted one."""

    def run(node: int) -> tuple[list[int], torch.Tensor]:
        """(the chosen path below ``node``, the distribution its bonus is drawn from)."""
        p, q = p_nodes[node].double(), tree.q[row, node].double()
        best: tuple[list[int], torch.Tensor] | None = None
        for child in tree.children(row, node):
            token = int(tree.tokens[row, child])
            q = q / q.sum()
            if float(torch.rand((), generator=generator)) * q[token] < p[token]:
                below, bonus_p = run(child)
                if best is None or len(below) + 1 > len(best[0]):
                    best = ([child, *below], bonus_p)
            p = residual(p, q, p.new_zeros(0, dtype=torch.long))
            q = q.clone()
            q[token] = 0
        return best if best is not None else ([], p)

    path, p = run(0)
    return Verdict(path, int(torch.multinomial(p.float(), 1, generator=generator)))


def uniform_bonus_after_the_main_path(tree, row, p_nodes, greedy, generator) -> Verdict:
    """B2: exact walk, but when it accepts the whole main path the bonus is uniform instead of from p."""
    verdict = verify_exact(tree, row, p_nodes, greedy, generator)
    if verdict.path and len(verdict.path) == int(tree.max_depth()[row]):
        bonus = int(torch.randint(p_nodes.shape[-1], (), generator=generator))
        return Verdict(verdict.path, bonus)
    return verdict


def siblings_judged_against_the_drawn_q(tree, row, p_nodes, greedy, generator) -> Verdict:
    """B3: every sibling is judged against its column's q as drawn, as if each were a fresh draw from it,
    not against the q left once the earlier siblings are removed (they were drawn without replacement)."""
    node, path = 0, []
    while True:
        p, q = p_nodes[node].double(), tree.q[row, node].double()
        q = q / q.sum() if q.sum() > 0 else q
        accepted = None
        for child in tree.children(row, node):
            token = int(tree.tokens[row, child])
            if float(torch.rand((), generator=generator)) * q[token] < p[token]:
                accepted = child
                break
            p = residual(p, q, p.new_zeros(0, dtype=torch.long))
        if accepted is None:
            return Verdict(path, int(torch.multinomial(p.float(), 1, generator=generator)))
        path.append(accepted)
        node = accepted


class RedrawWithoutTheDraft(SjdPacBuilder):
    """B4 on the chain (where a column's only token is its draft): a rejected continuation is redrawn from
    p without the draft, the residual after its siblings as if q were a point mass on it, instead of from
    norm(max(0, p − q)) at its own node."""

    def _continue(self, drafts, p, q, undrafted, positions, rng):
        u = rng.uniform(Purpose.CONTINUE, drafts.shape[1], 2)
        p, q = p.double(), torch.where(undrafted[..., None], 0.0, q.double())
        p_x = p.gather(-1, drafts[..., None]).squeeze(-1)
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        kept = ~undrafted & (u[..., 0] * q_x < p_x)
        rest = p.scatter(-1, drafts[..., None], 0.0)
        rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)
        return torch.where(kept, drafts, inverse_cdf(rest, u[..., 1]))


class KeepTheDraftsQ(SjdPacBuilder):
    """B5 (the stale q of SCD's release, here in SJD-PAC's window): a continued draft that survives keeps
    the q it was drafted from as its proposal, instead of the p it now follows."""

    def observe(self, outcome):
        super().observe(outcome)
        tree, verdict, verified, p_nodes = outcome.tree, outcome.verdict, outcome.verified, outcome.p_nodes
        win, deep, accepted = self._windows, self.main_depth, verdict.accepted
        last = torch.zeros_like(accepted)
        if verdict.path.shape[1]:
            at = (accepted - 1).clamp(0, verdict.path.shape[1] - 1)[:, None]
            last = torch.where(accepted > 0, verdict.path.gather(1, at).squeeze(1), last)
        onward = self.layout(p_nodes.device).onward.index_select(0, last)
        k = torch.arange(deep)[None]
        holder = onward.gather(1, (accepted[:, None] + 1 + k).clamp_max(deep))
        node = onward.gather(1, (accepted[:, None] + 2 + k).clamp_max(deep))
        drafted_q = tree.q.gather(1, holder[..., None].expand(-1, -1, p_nodes.shape[-1]))
        survived = (
            verified[:, None] & (k < win.count[:, None] - 1) & (win.tokens == tree.tokens.gather(1, node))
        )
        win.q = torch.where(survived[..., None], drafted_q.to(win.q.dtype), win.q)


@pytest.mark.parametrize(
    ("fixture", "builder", "accept", "count"),
    [
        ("sharp", SjdPacBuilder, longest_accepted_path, 6000),
        ("sharp3x3", SjdPacBuilder, uniform_bonus_after_the_main_path, 1000),
        ("sharp3x3", SjdPacBuilder, siblings_judged_against_the_drawn_q, 1000),
        ("sharp3x3", RedrawWithoutTheDraft, None, 6000),
        ("sharp3x3", KeepTheDraftsQ, None, 8000),
    ],
    ids=[
        "B1_longest_path",
        "B2_uniform_bonus",
        "B3_siblings_judged_as_drawn",
        "B4_redraw_without_the_draft",
        "B5_stale_q",
    ],
)
def test_the_distribution_test_rejects_the_release_bugs(fixture, builder, accept, count, request):
    """Power: on the same fixtures and tests as the exact sampler, each error is rejected (the release's
    B1–B4, and B5 as SCD's release has it)."""
    target, cond, sampling, exact = request.getfixturevalue(fixture)
    config = SjdPacTreeConfig(tokens_per_forward=8 if fixture == "sharp" else 9, width=2, levels=3)
    if accept is None:
        engine = SpeculativeEngine(target, None, builder(config), sampling)
    else:
        engine = RowVerifierEngine(target, None, builder(config), sampling, verify=accept)
    assert bonferroni_pvalue(sample_images(engine, cond, count, seed=2), exact) < SIGNIFICANCE


# --- the window, step by step -------------------------------------------------------------------------

H, W, V = 4, 4, 8  # a 4×4 grid over 8 tokens


def _engine(temperature: float = 1.0):
    target = SimpleNamespace(grid=(H, W), num_image_tokens=H * W, vocab_size=V)
    return SimpleNamespace(target=target, sampling=SamplingConfig(temperature=temperature))


def _state(root: int, committed: int, seed: int = 0) -> StepState:
    return StepState(
        roots=torch.tensor([root]),
        root_feats=None,
        root_logits=None,
        committed=torch.tensor([committed]),
        depth_limit=torch.tensor([H * W - 1 - committed]),
        generators=[torch.Generator().manual_seed(seed)],
        rng=RowRandom(torch.tensor([seed])),
    )


def _first(window: int = 16, width: int = 3, levels: int = 3, seed: int = 0):
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=window, width=width, levels=levels))
    builder.reset(1)
    return builder, builder.build(_engine(), _state(root=5, committed=1, seed=seed))


def test_the_window_is_a_full_tree_of_shared_columns_then_a_chain():
    builder, tree = _first()
    depths = tree.depths[0].tolist()
    assert builder.max_nodes(WHOLE_TREE) == tree.size == 16 and builder.main_depth == 5 and tree.sampled
    assert [depths.count(d) for d in range(6)] == [1, 3, 9, 1, 1, 1] and tree.valid.all()
    assert tree_nodes(3, 3) == 13 and tree_nodes(1, 4) == 4
    ranks, tokens = builder.shape.ranks, tree.tokens[0].tolist()
    for d in (1, 2):  # every node at depth d carries its rank's token of the same W distinct tokens
        level = [i for i in range(16) if depths[i] == d]
        column = {ranks[i]: tokens[i] for i in level}
        assert len(set(column.values())) == 3 and all(tokens[i] == column[ranks[i]] for i in level)
    # The chain hangs off the all-rank-0 leaf; q at a node = its children's column q, uniform when fresh.
    chain = builder.main[3:]
    assert [int(tree.parents[0, i]) for i in chain] == builder.main[2:5]
    holders = [i for i in range(16) if depths[i] < 5]
    assert torch.allclose(tree.q[0, holders], torch.full((len(holders), V), 1.0 / V))
    assert not tree.q[0, builder.main[5]].any()


def test_siblings_are_drawn_without_replacement_within_q_support():
    """A column whose q has two tokens gets two ranks; the third rank and its subtree stay undrafted."""
    builder, tree = _first(window=13, width=3, levels=3)
    p = torch.zeros(1, 13, V)
    p[0, :, [2, 6]] = 0.5
    builder.observe(step_outcome(tree, *batched([Verdict([], bonus=1)], tree), p, torch.tensor([0])))
    nxt = builder.build(_engine(), _state(root=1, committed=2))
    # Depth 1 continues the old depth 2, depth 2 is the position after the window: both q = p (tokens 2, 6).
    assert torch.equal(nxt.q[0, :4], p[0, :4]) and set(nxt.tokens[0, 1:3].tolist()) == {2, 6}
    drafted = [True, True, False]
    assert nxt.valid[0].tolist() == [True, *drafted, *drafted, *drafted, False, False, False]
    for seed in range(5):  # a fresh (uniform) column has W distinct tokens
        _, tree = _first(window=13, seed=seed)
        for d in (1, 2):
            assert len(set(tree.tokens[0, tree.depths[0] == d][:3].tolist())) == 3


def test_continuation_keeps_a_passing_draft_and_stores_p_as_its_q():
    builder, tree = _first(window=16)
    p = torch.full((1, 16, V), 1.0 / V)  # p = q (uniform): every draft passes
    builder.observe(step_outcome(tree, *batched([Verdict([], bonus=7)], tree), p, torch.tensor([0])))
    nxt = builder.build(_engine(), _state(root=7, committed=2))
    # Depths 2 .. 5 of the old main path continue as depths 1 .. 4; depth 5 is the draw after the window.
    main = builder.main
    assert nxt.tokens[0, main[1:5]].tolist() == tree.tokens[0, main[2:6]].tolist()
    assert torch.equal(nxt.q[0, main[:5]], p[0, main[1:6]])


def test_continuation_redraws_from_its_own_nodes_residual():
    """After a rejection at depth 1, the depth-2 draft continues under p at its own parent (the rank-0
    child of the root): kept with min(1, p/q), else from norm(max(0, p − q)) — overall a draw from p.
    The release draws from the residual after all siblings (B4), which is not p."""
    target_p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
    seen = []
    for seed in range(3000):
        builder, tree = _first(window=16, seed=seed)
        p = torch.full((1, 16, V), 1.0 / V)
        p[0, builder.main[1]] = target_p
        rng = RowRandom(torch.tensor([seed]))
        builder.observe(step_outcome(tree, *batched([Verdict([], bonus=7)], tree), p, torch.tensor([0]), rng))
        seen.append(int(builder._windows.tokens[0, 0]))
        assert torch.equal(builder._windows.q[0, 0], target_p)
    freq = torch.bincount(torch.tensor(seen), minlength=V) / len(seen)
    assert torch.allclose(freq, target_p, atol=0.03)


def test_continuation_follows_the_accepted_path():
    """Accepting the rank-1 child at depth 1 (its subtree ends at depth 2): depth 3 continues under the p
    computed at that child's rank-0 child (a leaf), depth 4 and on under the main path's chain."""
    builder, tree = _first(window=16)
    rank1 = 2  # the root's second child
    below = builder.first_child[rank1]
    p = torch.softmax(torch.randn(1, 16, V, generator=torch.Generator().manual_seed(3)), -1)
    builder.observe(step_outcome(tree, *batched([Verdict([rank1], bonus=0)], tree), p, torch.tensor([0])))
    window = builder._windows
    assert window.start.item() == 3 and window.count.item() == 4  # depths 3, 4, 5 and 6 (past the window)
    assert torch.equal(window.q[0, :4], p[0, [below, *builder.main[3:6]]])


def test_an_accepted_main_path_leaves_a_fresh_uniform_window():
    builder, tree = _first(window=16)
    p = torch.full((1, 16, V), 1.0 / V)
    builder.observe(
        step_outcome(tree, *batched([Verdict(builder.main[1:], bonus=3)], tree), p, torch.tensor([0]))
    )
    nxt = builder.build(_engine(), _state(root=3, committed=7))
    depths = nxt.depths[0]
    assert torch.allclose(nxt.q[0, depths < 5], torch.full((int((depths < 5).sum()), V), 1.0 / V))


def test_a_window_never_passes_the_last_image_token():
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=16, width=3, levels=3))
    builder.reset(1)
    state = _state(root=5, committed=H * W - 2)  # one image token left to draft
    tree = builder.build(_engine(), state)
    assert tree.max_depth().item() == 1 and tree.valid[0].sum().item() == 4


def test_greedy_continuation_takes_the_argmax():
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=16, width=3, levels=3))
    builder.reset(1)
    tree = builder.build(_engine(0.0), _state(root=5, committed=1))
    p = torch.softmax(torch.randn(1, 16, V, generator=torch.Generator().manual_seed(0)), -1)
    builder.observe(
        step_outcome(tree, *batched([Verdict([], bonus=1)], tree), p, torch.tensor([0]), greedy=True)
    )
    main = builder.main
    assert builder._windows.tokens[0, :5].tolist() == p[0, main[1:6]].argmax(-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 0}, "width >= 1"),
        ({"levels": 0}, "levels >= 1"),
        ({"tokens_per_forward": 12}, "cannot hold its tree"),
        ({"tokens_per_forward": 1, "width": 1, "levels": 1}, "at least one draft"),
    ],
)
def test_impossible_windows_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SjdPacBuilder(SjdPacTreeConfig(**kwargs))


# --- batched: a step reads nothing from the device --------------------------------------------------


def _batch_step(batch: int, temperature: float) -> tuple[int, int]:
    """(host syncs, ATen ops) of one build and one observe for ``batch`` prompts at different progress,
    counted as a GPU would see them, after a first step that lays the window out."""
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=16, width=3, levels=3))
    builder.reset(batch)
    engine = _engine(temperature)
    committed = torch.arange(batch) % 12 + 1
    state = StepState(
        roots=torch.arange(batch) % V,
        root_feats=None,
        root_logits=None,
        committed=committed,
        depth_limit=H * W - 1 - committed,
        generators=[None] * batch,
        rng=RowRandom(torch.arange(batch)),
    )
    p = torch.softmax(torch.randn(batch, 16, V, generator=torch.Generator().manual_seed(1)), -1)
    rows = [Verdict([], bonus=1), Verdict([1], bonus=2), Verdict([2, 6], bonus=0)]
    verdicts = [rows[b % 3] for b in range(batch)]
    tree = builder.build(engine, state)
    verdict = batched(verdicts, tree)
    greedy = engine.sampling.greedy
    builder.observe(step_outcome(tree, *verdict, p, committed - 1, state.rng, greedy))
    state.committed = committed + torch.tensor([len(v.path) + 1 for v in verdicts])
    with OpCounter(as_if_gpu=True) as counter:
        tree = builder.build(engine, state)
        builder.observe(step_outcome(tree, *verdict, p, state.committed - 1, state.rng, greedy))
    return counter.counts.syncs, counter.counts.ops


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_reads_nothing_and_costs_the_same_ops_at_any_batch(temperature):
    """Issue #14's budget for the builder alone (tests/test_step_budget.py checks whole decodes)."""
    one, eight = _batch_step(1, temperature), _batch_step(8, temperature)
    assert one[0] == eight[0] == 0
    assert one[1] == eight[1]


def test_the_builder_needs_the_runs_row_random():
    builder = SjdPacBuilder(SjdPacTreeConfig(tokens_per_forward=16, width=3, levels=3))
    state = _state(root=5, committed=1)
    state.rng = None
    with pytest.raises(ValueError, match="RowRandom"):
        builder.build(_engine(), state)


# --- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "length"), [({}, 64), ({"tree": {"tokens_per_forward": 16}}, 16)])
def test_the_preset_builds_a_drafter_free_engine(overrides, length):
    """``sjd_pac`` is the release's default (L 64); its CLI's L 16 is the documented override."""
    config = load_preset("sjd_pac", overrides)
    assert config.name == "sjd_pac" and not config.needs_drafter and config.exact
    builder = tree_builder(config.tree)
    assert isinstance(builder, SjdPacBuilder)
    assert (builder.tokens_per_forward, builder.width, builder.levels) == (length, 3, 3)
    method = build_method(config, make_target(), None, SamplingConfig())
    assert isinstance(method, SpeculativeEngine) and method.drafting.drafter is None


def batched(verdicts: list[Verdict], tree) -> tuple[BatchVerdict, torch.Tensor]:
    """``observe``'s (verdict, verified) for per-row verdicts, every row verified."""
    return from_verdicts(verdicts, tree.size - 1), torch.ones(len(verdicts), dtype=torch.bool)
