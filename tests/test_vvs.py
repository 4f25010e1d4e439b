"""VVS, partial verification skipping (lossy): the schedule, the skipped-step rules, post-verification.

Skipping is lossy, so there is no distribution test; what is proved is the bookkeeping: never two skips in
a row, a never-skipping schedule is its base method token for token, the target KV cache equals a fresh
prefill of the committed tokens after every verified step (the unverified tokens included once
post-verified), the drafter KV holds only rows computed from true target features after such a step, and
TPF > τ when steps are skipped.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, random_gpt, random_vq, tiny_condition
from omegaconf import OmegaConf
from test_engine import assert_cache_is_fresh_prefill

from vdtrain.decode.acceptance import Lantern
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder
from vdtrain.decode.builders.static import StaticTreeBuilder
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import ScheduleConfig, verification_schedule
from vdtrain.decode.metrics import summarize
from vdtrain.decode.neighbours import latent_neighbours
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import EAGLE1_PATHS, DraftTree, static_tree
from vdtrain.decode.vvs import (
    SimilaritySchedule,
    UniformSchedule,
    leaf_paths,
    path_similarity,
    truncation_length,
    unverified_path,
)
from vdtrain.drafter import Drafter, DrafterConfig, teacher_mask
from vdtrain.generate import decode_config
from vdtrain.targets.base import Condition
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

CONF = Path(__file__).resolve().parents[1] / "conf"
GRID8_GPT = replace(TINY_GPT, block_size=64)  # 16 px → 8 × 8 = 64 image tokens: many steps


def make_target(seed: int = 0) -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(GRID8_GPT, seed=seed), VQTokenizer(random_vq(TINY_VQ), 16), None, "tiny", SamplingConfig()
    )


def make_drafter(target, seed: int = 0, std: float = 0.2) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig.for_target(target))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter.attach(target).eval()


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


class Trace:
    """``on_step`` hook recording, per prompt, 'S' (skipped) or 'V' (verified) for every step it took,
    and whether the tree of a 'V' step could have been skipped at all (it had drafts)."""

    def __init__(self, engine: SpeculativeEngine, batch: int, n_img: int) -> None:
        self.engine, self.n_img = engine, n_img
        self.before = [1] * batch
        self.kinds: list[list[str]] = [[] for _ in range(batch)]
        self.forced: list[list[bool]] = [[] for _ in range(batch)]

    def __call__(self, cache, committed, tokens) -> None:
        for b, m in enumerate(committed.tolist()):
            if m == self.before[b]:
                continue
            self.kinds[b].append("S" if int(self.engine.run.pending[b]) > 0 else "V")
            self.forced[b].append(self.before[b] == self.n_img - 1)  # no draft possible: must verify
            self.before[b] = m


def run_traced(engine, cond, sampling_gens):
    trace = Trace(engine, len(cond), engine.target.num_image_tokens)
    result = engine.generate(cond, sampling_gens, on_step=trace)
    return result, trace


# --- the schedule's hard rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [UniformSchedule(every=1), "similarity_always"],
    ids=["uniform_every_1", "similarity_t_sim_-1"],
)
def test_never_skips_twice_in_a_row(schedule):
    target = make_target()
    if schedule == "similarity_always":
        schedule = SimilaritySchedule(target.tokenizer.codebook(), t_sim=-1.0, alpha=0.8)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    builder = DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
    engine = SpeculativeEngine(target, make_drafter(target), builder, sampling, schedule=schedule)
    result, trace = run_traced(engine, tiny_condition(), generators(2))
    for b, kinds in enumerate(trace.kinds):
        text = "".join(kinds)
        assert "SS" not in text and text.startswith("S")  # it wants to skip every step: it alternates
        for i in range(1, len(kinds)):  # a verified step after a verified one only at the last token
            if kinds[i] == kinds[i - 1] == "V":
                assert trace.forced[b][i]
        st = result.stats[b]
        assert st.skipped_steps == text.count("S") and st.steps == text.count("V")
        assert sum(st.committed_per_step) + sum(st.committed_per_skip) == target.num_image_tokens - 1
        assert st.target_forwards == 1 + st.steps


def test_uniform_schedule_skips_every_ith_step():
    target = make_target()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    builder = DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
    engine = SpeculativeEngine(target, make_drafter(target), builder, sampling, schedule=UniformSchedule(3))
    _, trace = run_traced(engine, tiny_condition(), generators(2))
    for kinds in trace.kinds:
        text = "".join(kinds)
        assert len(text) >= 6 and text[:6] == "VVSVVS"


# --- a never-skipping schedule is the base method ------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_schedule_that_never_skips_is_its_base_method(temperature, tmp_path):
    target = make_target()
    drafter = make_drafter(target)
    lantern = Lantern(latent_neighbours(target.tokenizer.codebook(), 8, str(tmp_path)), 8, delta=0.2)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    cond = tiny_condition()

    def run(schedule):
        builder = DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
        engine = SpeculativeEngine(target, drafter, builder, sampling, lantern, schedule=schedule)
        return engine.generate(cond, generators(2, seed=11))

    base = run(None)
    never = SimilaritySchedule(target.tokenizer.codebook(), t_sim=2.0, alpha=0.8)  # S̄ <= 1 < 2
    for result in (run(never), run(UniformSchedule(every=10**6))):
        assert torch.equal(result.tokens, base.tokens)
        for a, b in zip(result.stats, base.stats, strict=True):
            assert a.committed_per_step == b.committed_per_step and a.skipped_steps == 0
            assert a.target_forwards == b.target_forwards and a.drafter_forwards == b.drafter_forwards
    assert all(len(s) > 0 for s in never.scores)  # the score really was computed


# --- metrics ------------------------------------------------------------------------------------------


def test_tpf_exceeds_tau_when_steps_are_skipped():
    target = make_target()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    builder = DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
    engine = SpeculativeEngine(target, make_drafter(target), builder, sampling, schedule=UniformSchedule(2))
    result = engine.generate(tiny_condition(), generators(2))
    summary = summarize(result.stats, target.num_image_tokens)
    assert summary["skipped_steps"] > 0 and summary["TPF"] > summary["tau"]
    for st in result.stats:
        assert st.target_forwards == 1 + st.steps  # a skipped step costs no target forward
        assert st.tau == sum(st.committed_per_step) / st.steps  # τ: verified steps only
        assert summarize([st], target.num_image_tokens)["TPF"] == target.num_image_tokens / st.target_forwards


# --- post-verification: KV caches and features --------------------------------------------------------


@pytest.mark.parametrize("builder_kind", ["dynamic", "static"])
def test_caches_equal_a_fresh_pass_after_every_verified_step(builder_kind):
    """After each verified step, for every prompt with nothing left unverified: the target KV equals a
    fresh prefill over the committed tokens, the feature cache equals the true target features, and the
    drafter KV equals a teacher-forced drafter pass over those true features."""
    target = make_target()
    drafter = make_drafter(target)
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    builder = (
        DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
        if builder_kind == "dynamic"
        else StaticTreeBuilder(static_tree(EAGLE1_PATHS))
    )
    engine = SpeculativeEngine(target, drafter, builder, sampling, schedule=UniformSchedule(2))
    stream = cond.cat(target.null_condition(cond))
    prefix, batch = target.prefix_length, len(cond)
    previous_pending = [0] * batch
    post_verified = []

    def check(cache, committed, tokens):
        for b in range(batch):
            m, pending = int(committed[b]), int(engine.run.pending[b])
            was, previous_pending[b] = previous_pending[b], pending
            if pending or m < 2:
                continue
            assert_cache_is_fresh_prefill(target, stream, cache, tokens, b, m)
            rows = torch.tensor([b, b + batch])
            sub = Condition(stream.features[rows], stream.mask[rows])
            n = prefix + m - 1
            true = target.forward_sequence(sub, tokens[b, : m - 1].repeat(2, 1)).hidden  # [2, L+m-1, H]
            torch.testing.assert_close(engine.run.fcache[rows, :n], true, atol=1e-4, rtol=1e-4)
            # Drafter rows 0 .. L+m-2: f_s with the embedding of the token at slot s+1.
            nxt = torch.cat(
                [true.new_zeros(2, prefix - 1, true.shape[-1]), drafter.embed(tokens[b, :m].repeat(2, 1))], 1
            )
            fresh = drafter.new_cache(2, target.max_seq_len)
            pos = torch.arange(n)
            drafter(true, nxt, pos, teacher_mask(sub.mask, n), fresh, pos)
            dk, dv = engine.run.dcache.k[:, rows, :, :n], engine.run.dcache.v[:, rows, :, :n]
            torch.testing.assert_close(dk, fresh.k[:, :, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(dv, fresh.v[:, :, :, :n], atol=1e-4, rtol=1e-4)
            if was:
                post_verified.append(m)

    result = engine.generate(cond, generators(2, seed=3), on_step=check)
    assert sum(s.skipped_steps for s in result.stats) >= 4
    assert len(post_verified) >= 4  # the checks really covered post-verified tokens


def test_skipped_rows_use_the_most_recent_cached_features():
    """Right after a skip of γ tokens after m committed, drafter row L+m−1+j was computed from the
    cached feature of slot L+m−1−γ+j (the γ most recent), paired with the token at slot L+m+j."""
    target = make_target()
    drafter = make_drafter(target)
    cond = tiny_condition(batch=1)
    sampling = SamplingConfig(cfg_scale=1.0, temperature=1.0)
    builder = DynamicTreeBuilder(top_k=3, depth=3, total_tokens=12)
    engine = SpeculativeEngine(target, drafter, builder, sampling, schedule=UniformSchedule(2))
    prefix, seen = target.prefix_length, []
    state = {"m": 1, "cache": None}

    def check(cache, committed, tokens):
        m_new = int(committed[0])
        if int(engine.run.pending[0]) > 0:  # a skip committed γ tokens after m
            m, g = state["m"], m_new - state["m"]
            assert g == int(engine.run.pending[0])
            fc = state["cache"]  # the feature cache before the skip (a skip does not change it)
            torch.testing.assert_close(engine.run.fcache, fc)
            stale = fc[:, prefix + m - 1 - g + torch.arange(g)]
            nxt = drafter.embed(tokens[:, m : m + g])
            fresh = drafter.new_cache(1, target.max_seq_len)
            n = prefix + m - 1
            fresh.k[:, :, :, :n], fresh.v[:, :, :, :n] = (
                engine.run.dcache.k[:, :, :, :n],
                engine.run.dcache.v[:, :, :, :n],
            )
            slots = n + torch.arange(g)
            mask = torch.cat(
                [cond.mask[:, None, :].expand(1, g, -1), torch.ones(1, g, m - 1 + g, dtype=torch.bool)], -1
            )
            mask[0, :, prefix + m - 1 :] = torch.ones(g, g, dtype=torch.bool).tril()
            drafter(stale, nxt, slots, mask[:, None], fresh, slots)
            rows = slice(n, n + g)
            torch.testing.assert_close(
                engine.run.dcache.k[:, :, :, rows], fresh.k[:, :, :, rows], atol=1e-5, rtol=1e-4
            )
            seen.append(g)
        state["m"], state["cache"] = m_new, engine.run.fcache.clone()

    engine.generate(cond, generators(1, seed=5), on_step=check)
    assert len(seen) >= 3


# --- the skipped step's path and the similarity score on hand-made data --------------------------------


def hand_tree() -> DraftTree:
    # root → 1, 2; 1 → 3, 4; 3 → 5; node 6 is padding (invalid).
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 0]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 3, 1]])
    tokens = torch.tensor([[9, 10, 11, 12, 13, 14, 15]])
    valid = torch.tensor([[True] * 6 + [False]])
    return DraftTree(tokens, parents, depths, valid, None, sampled=False)


def test_path_choice_and_truncation_on_a_hand_made_tree():
    tree = hand_tree()
    paths = leaf_paths(tree, 0)
    assert paths == [[2], [1, 4], [1, 3, 5]]  # by leaf node index; the padding node is no leaf
    # L̄ = (1 + 2 + 3) / 3 = 2: γ = min(L_s, 2)
    assert [truncation_length(paths, i) for i in range(3)] == [1, 2, 2]
    assert truncation_length([[1], [1, 2, 3], [1, 4, 6]], 1) == 2  # L̄ = 7/3 → ⌊L̄⌋ = 2
    assert truncation_length([[1, 2, 3, 4], [5, 6, 7, 8]], 0) == 4
    counts = {(2,): 0, (1, 3): 0, (1, 4): 0}
    for seed in range(600):
        counts[tuple(unverified_path(tree, 0, torch.Generator().manual_seed(seed)))] += 1
    assert all(150 < c < 250 for c in counts.values()), counts  # uniform over the three leaves
    empty = DraftTree(
        tree.tokens, tree.parents, tree.depths, torch.tensor([[True] + [False] * 6]), None, False
    )
    assert leaf_paths(empty, 0) == [] and unverified_path(empty, 0, None) == []


def test_similarity_score_on_a_hand_made_codebook():
    # e0 = x, e1 = y, e2 = (x + y) scaled (cosine ignores the norm), e3 = −x.
    codebook = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [-1.0, 0.0]])
    r = 1 / math.sqrt(2)
    paths = [[0, 1], [0, 3], [2, 1], [3]]
    level0 = (1 + r - 1 + r - 1 - r) / 6  # pairs of tokens [0, 0, 2, 3]
    level1 = (0 + 1 + 0) / 3  # pairs of tokens [1, 3, 1] (the last path is too short)
    alpha = 0.5
    expected = (level0 + alpha * level1) / (1 + alpha)
    assert math.isclose(path_similarity(paths, codebook, alpha, stride=1), expected, rel_tol=1e-6)
    # stride 2 keeps paths 0 and 2: level 0 compares tokens 0 and 2, level 1 tokens 1 and 1.
    assert math.isclose(
        path_similarity(paths, codebook, alpha, stride=2), (r + alpha) / (1 + alpha), rel_tol=1e-6
    )
    # stride 4 would keep path 0 alone: all paths are compared instead.
    assert math.isclose(path_similarity(paths, codebook, alpha, stride=4), expected, rel_tol=1e-6)
    assert path_similarity([[0, 1]], codebook, alpha) == 1.0  # a chain: no alternative to verify
    # The schedule reads the tree's tokens along its paths.
    tree = DraftTree(
        torch.tensor([[0, 0, 2, 1, 3]]),
        torch.tensor([[-1, 0, 0, 1, 1]]),
        torch.tensor([[0, 1, 1, 2, 2]]),
        torch.ones(1, 5, dtype=torch.bool),
        None,
        False,
    )  # paths by leaf index: [2], [0, 1], [0, 3] (tokens)
    schedule = SimilaritySchedule(codebook, t_sim=0.5, alpha=alpha, stride=1)
    want = path_similarity([[2], [0, 1], [0, 3]], codebook, alpha, stride=1)
    assert math.isclose(schedule.score(tree, 0), want, rel_tol=1e-6)
    assert schedule.wants_skip(tree, 0, 1) == (want >= 0.5)


# --- configuration ------------------------------------------------------------------------------------


def test_every_preset_has_a_valid_schedule():
    for path in sorted((CONF / "decode").glob("*.yaml")):
        config = decode_config(OmegaConf.load(path))
        want = {"vvs": "similarity", "vvs_uniform": "uniform"}.get(path.stem, "always")
        assert config.schedule.kind == want, path.stem
    vvs = decode_config(OmegaConf.load(CONF / "decode" / "vvs.yaml"))
    assert (vvs.tree.kind, vvs.acceptance.kind, vvs.acceptance.delta, vvs.acceptance.k) == (
        "dynamic",
        "lantern",
        0.1,
        1000,
    )
    assert (vvs.schedule.t_sim, vvs.schedule.stride) == (0.7, 2)


def test_bad_schedules_are_refused():
    target = make_target()
    with pytest.raises(ValueError, match="unknown schedule"):
        verification_schedule(ScheduleConfig(kind="sometimes"), target)
    with pytest.raises(ValueError, match="every >= 1"):
        verification_schedule(ScheduleConfig(kind="uniform", every=0), target)
