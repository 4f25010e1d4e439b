"""The tensor-only EAGLE-2 / PEANUT tree builder: the same trees as the per-node builder (fixed, per-row
and PEANUT shapes, T = 0 and T > 0, depth limits at the image end), AR tokens at T = 0, its documented
tie-breaking and vocabulary cap, and no host syncs with a batch-independent op count inside ``build``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_condition
from reference_builders import ReferenceDeepestPathBuilder, ReferenceDynamicTreeBuilder
from test_engine import make_drafter, make_target

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.budget import WHOLE_TREE, TreeBudget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig, ranked
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.kernels import plain_twins
from vdtrain.decode.profiling import Counts, OpCounter
from vdtrain.decode.rows import DrafterRows
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.selection import top_k_low_index_first

# --- per-row shapes (PEANUT-like): a fixed pseudo-random function of the row and its progress ------------


def row_shapes(state: StepState, max_rounds: int, max_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rounds, width) per row, changing from step to step and from row to row."""
    key = state.committed * 7 + torch.arange(len(state.roots), device=state.roots.device) * 3
    return key % (max_rounds + 1), 1 + (key * 11 + 4) % max_width


class OldPerRow(ReferenceDynamicTreeBuilder):
    def shape(self, state):
        return row_shapes(state, self.depth, self.top_k)


class NewPerRow(DynamicTreeBuilder):
    own_shape = True

    def shape(self, state):
        return row_shapes(state, self.depth, self.top_k)


class OldPeanut(ReferenceDeepestPathBuilder):
    """PEANUT's tree (deepest path kept) with scripted shapes instead of the adaptation rule."""

    def __init__(self, depth: int, top_k: int, total_tokens: int) -> None:
        super().__init__(top_k=top_k, depth=depth, total_tokens=total_tokens)
        self.max_rounds, self.max_width = depth, top_k

    def shape(self, state):
        return row_shapes(state, self.max_rounds, self.max_width)


class NewPeanut(NewPerRow):
    keep_deepest_path = True


# --- running builders side by side inside a real decode -------------------------------------------------


class Twin(DraftTreeBuilder):
    """Builds every step's trees with each builder on the same state; the engine follows the first."""

    def __init__(self, *builders: DraftTreeBuilder) -> None:
        self.builders = builders
        self.trees: list[list[tuple[torch.Tensor, ...]]] = []
        self.limits: list[torch.Tensor] = []

    def max_nodes(self, budget: TreeBudget) -> int:
        return max(b.max_nodes(budget) for b in self.builders)

    def reset(self, batch: int) -> None:
        for b in self.builders:
            b.reset(batch)

    def build(self, engine, state):
        trees = [b.build(engine, state) for b in self.builders]
        for tree in trees[1:]:  # the tensor builders' host bounds hold
            children = (tree.parents[:, :, None] == torch.arange(tree.size)) & tree.valid[:, :, None]
            assert int(tree.max_depth().max()) <= tree.depth_bound
            assert int(children.sum(1).max()) <= tree.width_bound
        self.trees.append(
            [(t.tokens.clone(), t.parents.clone(), t.depths.clone(), t.valid.clone()) for t in trees]
        )
        self.limits.append(state.depth_limit.clone())
        return trees[0]


def run_twin(twin: Twin, temperature: float, cfg_scale: float, batch: int = 3) -> None:
    target = make_target()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=temperature)
    engine = SpeculativeEngine(target, make_drafter(target), twin, sampling)
    gens = [torch.Generator().manual_seed(11 + b) for b in range(batch)]
    engine.generate(tiny_condition(batch=batch), gens)


def assert_same_trees(twin: Twin, a: int = 0, b: int = 1) -> None:
    assert len(twin.trees) >= 3
    for step, trees in enumerate(twin.trees):
        for name, x, y in zip(("tokens", "parents", "depths", "valid"), trees[a], trees[b], strict=True):
            assert torch.equal(x, y), f"step {step}: {name} differ\n{x}\n{y}"


@pytest.mark.parametrize(
    "top_k, depth, total_tokens, temperature, cfg_scale",
    [
        (4, 3, 16, 0.0, 1.0),
        (4, 3, 16, 0.0, 2.5),
        (4, 3, 16, 1.0, 2.0),
        (10, 5, 59, 0.0, 2.5),
        (3, 4, 30, 1.0, 1.0),
    ],
    ids=["small-greedy", "small-greedy-cfg", "small-sampled-cfg", "default-greedy-cfg", "roomy-sampled"],
)
def test_fixed_shapes_give_the_old_builders_trees(top_k, depth, total_tokens, temperature, cfg_scale):
    twin = Twin(
        ReferenceDynamicTreeBuilder(top_k=top_k, depth=depth, total_tokens=total_tokens),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=top_k, depth=depth, total_tokens=total_tokens)),
    )
    run_twin(twin, temperature, cfg_scale)
    assert_same_trees(twin)
    # The image end limited some rows' depth below the builder's (masked rows were exercised).
    assert any(bool(((lim >= 1) & (lim <= depth)).any()) for lim in twin.limits)


@pytest.mark.parametrize("temperature, cfg_scale", [(0.0, 2.5), (1.0, 1.0)])
def test_per_row_shapes_give_the_old_builders_trees(temperature, cfg_scale):
    twin = Twin(
        OldPerRow(top_k=6, depth=4, total_tokens=20),
        NewPerRow(DynamicTreeConfig(top_k=6, depth=4, total_tokens=20)),
    )
    run_twin(twin, temperature, cfg_scale, batch=4)
    assert_same_trees(twin)
    depths = torch.stack([t[0][2].max(dim=1).values for t in twin.trees])
    assert len({int(d) for d in depths.flatten()}) >= 4  # rows really had different shapes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_peanut_trees_keep_the_same_deepest_path(temperature):
    plain = NewPerRow(DynamicTreeConfig(top_k=5, depth=4, total_tokens=8))
    twin = Twin(OldPeanut(4, 5, 8), NewPeanut(DynamicTreeConfig(top_k=5, depth=4, total_tokens=8)), plain)
    run_twin(twin, temperature, 2.0, batch=4)
    assert_same_trees(twin)
    # The small budget pruned deep levels that PEANUT's rule then kept.
    deeper = [bool((t[1][2].max(1).values > t[2][2].max(1).values).any()) for t in twin.trees]
    assert any(deeper)


@pytest.mark.parametrize(
    "builder",
    [
        DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16)),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=10, depth=5, total_tokens=59)),
        NewPerRow(DynamicTreeConfig(top_k=6, depth=4, total_tokens=20)),
        NewPeanut(DynamicTreeConfig(top_k=5, depth=4, total_tokens=8)),
    ],
    ids=["eagle2_small", "eagle2_default", "per_row", "peanut"],
)
def test_greedy_decoding_with_the_tensor_builder_matches_ar(builder):
    target = make_target()
    cond = tiny_condition(batch=3)
    sampling = SamplingConfig(cfg_scale=2.5, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None] * 3)
    result = SpeculativeEngine(target, make_drafter(target), builder, sampling).generate(cond, [None] * 3)
    assert torch.equal(result.tokens, ar)
    assert max(s.tau for s in result.stats) > 1  # drafts were accepted, the trees were used


# --- tie-breaking ---------------------------------------------------------------------------------------


@pytest.fixture(params=["fast", "plain"])
def twin(request):
    """The chunked selection (``selection._chunked``) and its plain twin, a stable sort of the row."""
    with plain_twins(request.param == "plain"):
        yield request.param


def test_topk_ties_go_to_the_lower_index(twin):
    values = torch.tensor([[0.5, -1.0, 0.5, 0.0, -0.0, -1.0, 2.0, 0.5]])
    got_values, got_index = top_k_low_index_first(values, 8)
    assert got_index.tolist() == [[6, 0, 2, 7, 3, 4, 1, 5]]  # −0.0 ties +0.0, by index
    assert torch.equal(got_values, values[:, got_index[0]])
    scores = torch.tensor([[-1.0, -2.0, -1.0, 0.0, -2.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False, True]])
    assert ranked(scores, valid, 4).tolist() == [[0, 2, 1, 4]]  # the invalid best comes last


def test_topk_ties_go_to_the_lower_index_on_random_tie_heavy_rows(twin):
    """Against a sort by (−value, index) in Python: few distinct values, −inf and −0.0, every k, rows
    long enough to be cut into more chunks than k (and rows that are not)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 30 if trial % 3 else 400, (1,), generator=g))
        k = int(torch.randint(1, min(n, 12) + 1, (1,), generator=g))
        values = torch.randint(-2, 3 + trial % 5 * 40, (2, 3, n), generator=g).float()
        if trial % 2:
            values[values == -2] = float("-inf")
            values[values == 1] = -0.0
        got_values, got_index = top_k_low_index_first(values, k)
        for row, index in zip(values.flatten(0, 1).tolist(), got_index.flatten(0, 1).tolist(), strict=True):
            assert index == sorted(range(n), key=lambda i, row=row: (-row[i], i))[:k], (row, k)
        assert torch.equal(got_values, values.gather(-1, got_index))


def stub_engine(logits: torch.Tensor, n_img: int = 16, prefix: int = 3) -> SimpleNamespace:
    """Just what ``build`` uses of an engine: the drafter returns ``logits`` [V] for every row."""

    def drafter_forward(feats, rows):
        return feats, logits.expand(feats.shape[0], feats.shape[1], -1)

    return SimpleNamespace(
        target=SimpleNamespace(
            prefix_length=prefix, num_image_tokens=n_img, image_slot=lambda index: index + prefix
        ),
        draft_probs=lambda x: x.softmax(-1),
        draft_confidence=lambda x: x.softmax(-1),
        # Rows as ``drafter_inputs`` lays them out (one stream): the builder slices them per round.
        drafter_inputs=lambda tokens, token_index, slots, vis, next_embeds=None: DrafterRows(
            next_embeds, token_index, vis[:, None], slots, token_index + 1
        ),
        drafter_embeds=lambda tokens: None,
        drafter_forward=drafter_forward,
    )


def stub_state(logits: torch.Tensor, batch: int = 1, committed: int = 2, n_img: int = 16) -> StepState:
    committed_t = torch.full((batch,), committed)
    return StepState(
        roots=torch.full((batch,), 7),
        root_feats=torch.zeros(batch, 4),
        root_logits=logits.expand(batch, -1),
        committed=committed_t,
        depth_limit=n_img - 1 - committed_t,
        generators=[None] * batch,
    )


@pytest.mark.parametrize(
    "total_tokens, tokens, parents, depths",
    [
        # Depth 2: the four candidates tie; the budget keeps the first created (children of node 1 first).
        (6, [7, 1, 2, 1, 2, 1], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2]),
        # Depth 3: the frontier took the first two tied candidates, both children of node 1.
        (
            11,
            [7, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2],
            [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4],
            [0, 1, 1] + [2] * 4 + [3] * 4,
        ),
    ],
)
def test_ties_resolve_by_token_id_then_creation_order(total_tokens, tokens, parents, depths):
    # Tokens 1, 2, 3 tie above token 0: a node's children are always tokens 1, 2 (the lower ids).
    logits = torch.tensor([0.0, 1.0, 1.0, 1.0])
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=2, total_tokens=total_tokens))
    tree = builder.build(stub_engine(logits), stub_state(logits))
    assert tree.tokens.tolist() == [tokens]
    assert tree.parents.tolist() == [parents]
    assert tree.depths.tolist() == [depths]
    assert tree.valid.all()


def test_a_depth_limit_and_padding_follow_the_old_layout():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=3, total_tokens=12))
    state = stub_state(logits, batch=3, n_img=8)
    state.depth_limit = torch.tensor([2, 0, 1])
    tree = builder.build(stub_engine(logits, n_img=8), state)
    # Row 0: two levels (2 + 4 nodes); row 1: the root alone; row 2: one level. Padding: token 0,
    # parent 0, depth 1, invalid.
    assert tree.valid.sum(1).tolist() == [7, 1, 3]
    assert tree.tokens[0].tolist() == [7, 4, 3, 4, 3, 4, 3, 0, 0, 0, 0, 0]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2, 0, 0, 0, 0, 0]
    assert tree.depths[1].tolist() == [0] + [1] * 11
    assert tree.tokens[2, :3].tolist() == [7, 4, 3]


# --- vocabulary and envelope ----------------------------------------------------------------------------


def test_top_k_above_the_vocabulary_is_capped_once_on_the_preset_path():
    """``decode.tree.top_k=600`` on a 512-token vocabulary was capped silently at build time only, and its
    600-wide envelope made every step crawl (issue 26): the engine caps it, with one warning, so the
    envelope is the capped one and a decode costs the ops of a tree as wide as the vocabulary."""
    from vdtrain.decode.methods import build_method, load_preset

    target = make_target()
    drafter = make_drafter(target)
    vocab = target.vocab_size
    at_vocab = build_method(
        load_preset("eagle2", {"tree": {"top_k": vocab}}), target, drafter, SamplingConfig()
    )
    with pytest.warns(UserWarning, match=f"exceeds the target's vocabulary \\({vocab} image tokens\\)"):
        too_wide = build_method(
            load_preset("eagle2", {"tree": {"top_k": 3 * vocab}}), target, drafter, SamplingConfig()
        )
    assert too_wide.builder.top_k == vocab
    assert too_wide.builder.max_nodes(WHOLE_TREE) == at_vocab.builder.max_nodes(WHOLE_TREE)
    counts = []
    at_vocab.generate(tiny_condition(), [torch.Generator().manual_seed(9)] * 2)  # makes the shared constants
    for method in (at_vocab, too_wide):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        with OpCounter() as counter:
            tokens = method.generate(tiny_condition(), gens).tokens
        counts.append((counter.counts.ops, tokens))
    assert counts[1][0] == counts[0][0] and torch.equal(counts[1][1], counts[0][1])


@pytest.mark.parametrize("kwargs", [{"top_k": 0}, {"depth": -1}, {"total_tokens": 1}])
def test_impossible_tensor_trees_are_refused(kwargs):
    with pytest.raises(ValueError, match="dynamic tree"):
        DynamicTreeBuilder(DynamicTreeConfig(**kwargs))


def test_top_k_above_the_vocabulary_is_capped_at_build():
    logits = torch.tensor([0.3, 1.0, -2.0, 0.5])
    wide = DynamicTreeBuilder(DynamicTreeConfig(top_k=9, depth=1, total_tokens=30))
    exact = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=1, total_tokens=30))
    got, want = (b.build(stub_engine(logits), stub_state(logits, batch=2)) for b in (wide, exact))
    for x, y in zip(
        (got.tokens, got.parents, got.depths, got.valid),
        (want.tokens, want.parents, want.depths, want.valid),
        strict=True,
    ):
        assert torch.equal(x, y)
    assert int(got.valid.sum()) == 2 * 21  # 4 + 16 drafts per row: every child of every token


class OutOfEnvelope(DynamicTreeBuilder):
    own_shape = True

    def shape(self, state):
        rounds, widths = super().shape(state)
        return rounds + 1, widths


def test_a_shape_outside_the_envelope_is_refused():
    logits = torch.tensor([0.3, 1.0, -2.0, 0.5])
    with pytest.raises(RuntimeError, match="outside envelope"):
        OutOfEnvelope(DynamicTreeConfig(top_k=2, depth=1)).build(stub_engine(logits), stub_state(logits))


class TooWide(DynamicTreeBuilder):
    def envelope(self, state):
        return self.depth, 3 * self.top_k


def test_an_envelope_past_the_scratch_reserved_is_refused():
    logits = torch.zeros(50)
    with pytest.raises(ValueError, match="scratch slots"):
        TooWide(DynamicTreeConfig(top_k=4, depth=3, total_tokens=8)).build(
            stub_engine(logits), stub_state(logits)
        )


# --- host syncs and op counts ---------------------------------------------------------------------------


class StopDecode(Exception):
    pass


class Counted(DraftTreeBuilder):
    """Counts (as a GPU would see them) the host syncs, host-to-device copies and ATen ops of each
    ``build`` of ``inner``; ``builds``: stop the decode after that many."""

    def __init__(self, inner: DraftTreeBuilder, builds: int | None = None) -> None:
        self.inner, self.builds, self.counts = inner, builds, []

    def max_nodes(self, budget: TreeBudget) -> int:
        return self.inner.max_nodes(budget)

    def build(self, engine, state):
        with OpCounter(as_if_gpu=True) as counter:
            tree = self.inner.build(engine, state)
        self.counts.append(counter.counts)
        if len(self.counts) == self.builds:
            raise StopDecode
        return tree


def count_builds(
    builder: DraftTreeBuilder, batch: int, temperature: float = 0.0, builds: int | None = None
) -> list[Counts]:
    target = make_target()
    counted = Counted(builder, builds)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    engine = SpeculativeEngine(target, make_drafter(target), counted, sampling)
    with contextlib.suppress(StopDecode):
        engine.generate(tiny_condition(batch=batch), [torch.Generator().manual_seed(b) for b in range(batch)])
    return counted.counts


@pytest.mark.parametrize(
    "builder",
    [
        DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16)),
        NewPeanut(DynamicTreeConfig(top_k=5, depth=4, total_tokens=8)),
    ],
    ids=["eagle2", "peanut"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_build_reads_nothing_on_the_host(builder, temperature):
    counts = count_builds(builder, batch=2, temperature=temperature)
    assert len(counts) >= 3
    assert all(c.syncs == 0 and c.h2d == 0 for c in counts), counts


def test_the_counter_sees_the_old_builders_host_reads():
    (first,) = count_builds(ReferenceDynamicTreeBuilder(4, 3, 16), batch=2, builds=1)
    assert first.syncs > 0


def test_build_op_count_does_not_grow_with_the_batch():
    one, eight, old_one, old_eight = (
        count_builds(builder, batch, builds=1)[0].ops
        for builder in (
            DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16)),
            ReferenceDynamicTreeBuilder(4, 3, 16),
        )
        for batch in (1, 8)
    )
    assert eight <= 1.2 * one
    assert old_eight > 2 * old_one  # what the per-node builder pays
