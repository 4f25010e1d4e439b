"""The decoding engine: trees as data, exact verification, KV bookkeeping — proven lossless.

T=0: token identity with AR. T>0: on a target small enough to enumerate every image, the empirical
distribution of speculative samples passes a chi-square test against the exact AR distribution, and the
same test rejects a deliberately wrong verifier.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, random_gpt, random_vq, tiny_condition
from conftest import random_drafter as make_drafter
from reference_acceptance import Verdict, from_verdicts
from scipy.stats import chisquare

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.builders.base import DraftTreeBuilder
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.sampling import SamplingConfig, probabilities
from vdtrain.decode.trees import (
    EAGLE1_PATHS,
    LANTERN_PP_PATHS,
    DraftTree,
    ancestor_matrix,
    static_tree,
)
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.base import Condition
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer


def make_target(gpt_config=TINY_GPT, vq_config=TINY_VQ, image_size=8, seed=0, std=0.3) -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(gpt_config, seed=seed, std=std),
        VQTokenizer(random_vq(vq_config), image_size),
        None,
        "tiny",
        SamplingConfig(),
    )


# --- trees as data ------------------------------------------------------------------------------------


def test_static_tree_presets_have_the_published_shapes():
    eagle1, lpp = static_tree(EAGLE1_PATHS), static_tree(LANTERN_PP_PATHS)
    assert (eagle1.size, eagle1.depth) == (26, 5)
    assert (lpp.size, lpp.depth) == (58, 5)
    assert max(lpp.width(i) for i in range(lpp.size)) == 5
    assert [len(lpp.nodes_at(d)) for d in range(1, 6)] == [5, 13, 16, 14, 9]


@pytest.mark.parametrize(
    "paths, message",
    [([[0], [0, 1]], "skip a rank"), ([[0, 0]], "no parent"), ([[0], [0]], "twice"), ([], "at least one")],
)
def test_impossible_static_trees_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        static_tree(paths)


@pytest.mark.parametrize("kwargs", [{"top_k": 0}, {"depth": -1}, {"total_tokens": 1}])
def test_impossible_dynamic_trees_are_refused(kwargs):
    with pytest.raises(ValueError, match="dynamic tree"):
        DynamicTreeBuilder(DynamicTreeConfig(**kwargs))


def test_ancestor_matrix_of_a_small_tree():
    # root → a, b; a → c; c → d
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    anc = ancestor_matrix(parents)[0].int().tolist()
    assert anc == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]


# --- T = 0: identical tokens --------------------------------------------------------------------------


class OracleChain(DraftTreeBuilder):
    """Drafts the known AR continuation at rank 0 with a wrong sibling at rank 1: long acceptances
    that exercise the KV moves and the drafter catch-up."""

    def __init__(self, truth: torch.Tensor, depth: int) -> None:
        self.truth, self.depth = truth, depth
        self.tree = static_tree([p for d in range(1, depth + 1) for p in ((0,) * d, (0,) * (d - 1) + (1,))])

    def max_nodes(self, budget: TreeBudget) -> int:
        return self.tree.size

    def build(self, engine, state) -> DraftTree:
        t, batch = self.tree, len(state.roots)
        tokens = torch.zeros(batch, t.size, dtype=torch.long)
        tokens[:, 0] = state.roots
        n = self.truth.shape[1]
        for i in range(1, t.size):
            index = (state.committed + t.depths[i] - 1).clamp_max(n - 1)
            right = self.truth.gather(1, index[:, None]).squeeze(1)
            tokens[:, i] = right if t.ranks[i] == 0 else (right + 1) % engine.target.vocab_size
        depths = torch.tensor(t.depths).expand(batch, -1)
        return DraftTree(
            tokens,
            torch.tensor(t.parents).expand(batch, -1).clone(),
            depths.clone(),
            depths <= state.depth_limit[:, None],
            None,
            sampled=False,
        )


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_oracle_drafts_are_accepted_and_tokens_match_ar(cfg_scale):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    engine = SpeculativeEngine(target, make_drafter(target), OracleChain(ar, depth=4), sampling)
    result = engine.generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)
    assert all(s.tau > 4 for s in result.stats)  # whole chains accepted: the commit path really ran
    assert all(sum(s.committed_per_step) == target.num_image_tokens - 1 for s in result.stats)


@pytest.mark.parametrize(
    "builder",
    [
        StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS)),
        StaticTreeBuilder(StaticTreeConfig(paths=LANTERN_PP_PATHS)),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16)),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=10, depth=5, total_tokens=59)),
    ],
    ids=["eagle1", "lantern_pp_tree", "eagle2_small", "eagle2_default"],
)
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_speculative_decoding_matches_ar(builder, cfg_scale):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    result = SpeculativeEngine(target, make_drafter(target), builder, sampling).generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)


@pytest.mark.parametrize("learned_pos_embedding", [False, True])
def test_a_target_with_identity_caption_rope_decodes_exactly_and_its_drafter_follows_it(
    learned_pos_embedding,
):
    target = make_target(
        replace(TINY_GPT, caption_rope="identity", learned_pos_embedding=learned_pos_embedding)
    )
    drafter = make_drafter(target)
    rope = drafter.layer.rope
    assert drafter.config.layer["caption_rope"] == "identity"
    assert torch.equal(rope[: target.prefix_length, :, 0], torch.ones_like(rope[:5, :, 0]))
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.5, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16))
    result = SpeculativeEngine(target, drafter, builder, sampling).generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)


def assert_cache_is_fresh_prefill(target, stream, cache, tokens, b: int, m: int) -> None:
    """Prompt ``b``'s cache rows (both CFG streams) equal a fresh prefill + forward over its first
    ``m - 1`` committed tokens (the root ``x_{m-1}`` is not yet seen by the target)."""
    batch, prefix = len(stream) // 2, target.prefix_length
    idx = torch.arange(m - 1)
    rows = torch.tensor([b, b + batch])
    sub = Condition(stream.features[rows], stream.mask[rows])
    one = target.new_cache(2)
    target.prefill(sub, one)
    target.forward_tokens(
        sub,
        tokens[b, : m - 1].repeat(2, 1),
        idx,
        one,
        idx + prefix,
        target.causal_visibility(0, m - 1, "cpu"),
    )
    n = prefix + m - 1
    torch.testing.assert_close(cache.k[:, rows, :, :n], one.k[:, :, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, rows, :, :n], one.v[:, :, :, :n], atol=1e-5, rtol=1e-4)


def test_target_cache_equals_a_fresh_prefill_after_every_step():
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    stream = cond.cat(target.null_condition(cond))
    checked = []

    def check(cache, committed, tokens):
        for b in range(len(cond)):
            m = int(committed[b])
            if m < 2:
                continue
            assert_cache_is_fresh_prefill(target, stream, cache, tokens, b, m)
            checked.append(m)

    engine = SpeculativeEngine(target, make_drafter(target), OracleChain(ar, depth=3), sampling)
    engine.generate(cond, [None, None], on_step=check)
    assert len(checked) >= 4


def test_a_drafter_for_another_target_is_refused():
    target, other = make_target(), make_target(seed=1)
    drafter = Drafter.make(DrafterConfig.for_target(other))
    with pytest.raises(ValueError, match="head_fingerprint"):
        SpeculativeEngine(target, drafter, DynamicTreeBuilder(DynamicTreeConfig()), SamplingConfig())


# --- T > 0: the exact distribution --------------------------------------------------------------------

MICRO_GPT = replace(TINY_GPT, vocab_size=4, block_size=4, cls_token_num=2)
MICRO_VQ = replace(TINY_VQ, codebook_size=4)


def exact_ar_distribution(target, cond, sampling) -> dict[tuple[int, ...], float]:
    """P(x) for every image x (V^N of them) by the chain rule over teacher-forced target logits."""
    vocab, n = target.vocab_size, target.num_image_tokens
    images = torch.tensor(list(itertools.product(range(vocab), repeat=n)))
    rows = len(images)
    c = Condition(cond.features.expand(rows, -1, -1), cond.mask.expand(rows, -1))
    both = c.cat(target.null_condition(c)) if sampling.uses_cfg else c
    logits = target.forward_sequence(both, images.repeat(len(both) // rows, 1)).logits
    logits = logits[:, target.prefix_length - 1 : -1]
    uncond = logits[rows:] if sampling.uses_cfg else None
    p = probabilities(logits[:rows], uncond, sampling)
    probs = p.gather(-1, images[..., None]).squeeze(-1).prod(-1)
    return {tuple(x.tolist()): float(pr) for x, pr in zip(images, probs, strict=True)}


class RowVerifierEngine(SpeculativeEngine):
    """The engine with a per-row ``verify(tree, row, p_nodes, greedy, generator) -> Verdict`` in place of
    batched acceptance: for deliberately wrong rules that the distribution tests must reject."""

    def __init__(self, *args, verify, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.row_verify, self.generator = verify, torch.Generator().manual_seed(0)

    def _accept(self, tree, p_nodes, p_relax):
        greedy = self.sampling.greedy
        rows = [self.row_verify(tree, b, p_nodes[b], greedy, self.generator) for b in range(len(p_nodes))]
        return from_verdicts(rows, tree.size - 1)


def wrong_verifier(tree, row, p_nodes, greedy, generator) -> Verdict:
    """A classic bug: accept with min(1, p/q) but draw the bonus from p instead of the residual."""
    node, path = 0, []
    while True:
        p = p_nodes[node].double()
        kids = tree.children(row, node)
        if kids:
            c = kids[0]
            tok = int(tree.tokens[row, c])
            q = tree.q[row, node].double() if tree.sampled else torch.ones_like(p)
            if float(torch.rand((), generator=generator)) * q[tok] < p[tok]:
                path.append(c)
                node = c
                continue
        return Verdict(path, int(torch.multinomial(p.float(), 1, generator=generator)))


def sample_images(engine, cond, count, seed) -> list[tuple[int, ...]]:
    c = Condition(cond.features.expand(count, -1, -1), cond.mask.expand(count, -1))
    gens = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(count)]
    return [tuple(x) for x in engine.generate(c, gens, planned_batch=count).tokens.tolist()]


def chi_square_pvalue(samples, exact) -> float:
    counts = {x: 0 for x in exact}
    for x in samples:
        counts[x] += 1
    total = len(samples)
    # Pool the outcomes whose expected count is small into one bin.
    big = [x for x in exact if exact[x] * total >= 5]
    observed = [counts[x] for x in big] + [total - sum(counts[x] for x in big)]
    expected = [exact[x] * total for x in big] + [total - sum(exact[x] * total for x in big)]
    return float(chisquare(observed, expected).pvalue)


SIGNIFICANCE = 1e-3  # a correct method fails this test once in a thousand seeds


def micro_problem() -> tuple[LlamaGenTarget, Condition]:
    """The enumerable problem: 4 image tokens over a 4-token vocabulary, one fixed caption."""
    target = make_target(MICRO_GPT, MICRO_VQ, image_size=4, seed=3)
    cond = Condition(
        torch.randn(1, 2, MICRO_GPT.caption_dim, generator=torch.Generator().manual_seed(5)),
        torch.ones(1, 2, dtype=torch.bool),
    )
    return target, cond


@pytest.fixture(scope="module")
def micro():
    target, cond = micro_problem()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    return (
        target,
        make_drafter(target, seed=4, std=0.5),
        cond,
        sampling,
        exact_ar_distribution(target, cond, sampling),
    )


@pytest.mark.parametrize(
    "builder",
    [
        StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS)),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=3, depth=2, total_tokens=8)),
    ],
    ids=["eagle1_sampled_static", "eagle2_dynamic"],
)
def test_speculative_sampling_has_the_ar_distribution(micro, builder):
    target, drafter, cond, sampling, exact = micro
    samples = sample_images(SpeculativeEngine(target, drafter, builder, sampling), cond, 6000, seed=1)
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


def test_the_distribution_test_rejects_a_wrong_verifier(micro):
    target, drafter, cond, sampling, exact = micro
    builder = StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS))
    engine = RowVerifierEngine(target, drafter, builder, sampling, verify=wrong_verifier)
    # 1 500 samples reject it with p below 1e-45 (seeds 2, 3, 4); the exact samplers get 6 000.
    assert chi_square_pvalue(sample_images(engine, cond, 1500, seed=2), exact) < SIGNIFICANCE


def test_ar_sampling_itself_passes_the_distribution_test(micro):
    target, _, cond, sampling, exact = micro
    c = Condition(cond.features.expand(6000, -1, -1), cond.mask.expand(6000, -1))
    gens = [torch.Generator().manual_seed(7_000_000 + i) for i in range(6000)]
    samples = [tuple(x) for x in generate_ar(target, c, sampling, gens).tolist()]
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE
