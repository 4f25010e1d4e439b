"""Decoding exactness across methods (issue #13 items 1-3).

- Every exact preset keeps the AR distribution at T = 1 when the drafter is confident and top-k / top-p
  leave q fewer tokens than a node has children (drafts past q's support must not be accepted for free).
- Prompt ``i`` is sampled with its own generator whatever its batch: every preset gives the same tokens
  batched and alone.
- Vocabularies smaller than a tree's width are capped, not a crash in torch.
- Trees shrunk to the row limit (``tree.max_rows``, issue #33) stay exact: T = 0 tokens are AR's, T = 1
  samples follow AR's distribution, and a short batch sized by the run's planned batch samples alike.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import drafter_kind_for, tiny_condition
from test_engine import (
    MICRO_GPT,
    MICRO_VQ,
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    micro_problem,
    sample_images,
)

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.budget import GPU_MAX_ROWS, WHOLE_TREE, TreeBudget, tree_budget
from vdtrain.decode.builders.base import StepState
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import ARMethod, build_method, decode_config, load_preset, preset_names
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import EAGLE1_PATHS, LANTERN_PP_PATHS, DraftTree
from vdtrain.drafters import Drafter, DrafterConfig, drafter_class
from vdtrain.drafters.eagle import Eagle1Drafter
from vdtrain.targets.base import Condition

SHARPEN = 8.0  # drafter logits × SHARPEN: q is nearly one-hot


class Sharpened:
    """Mixed into a drafter kind: its q is nearly one-hot, so top-p leaves it one token where a node has
    several children."""

    def logits(self, hidden: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        return super().logits(hidden, offset) * SHARPEN


class ConfidentDrafter(Sharpened, Eagle1Drafter):
    """An eagle1 drafter with a nearly one-hot q."""


def confident_drafter(target, seed: int = 4, kind: str = "eagle1") -> Drafter:
    """A ``kind`` drafter with a nearly one-hot q (``Sharpened``), random weights, attached."""
    sharpened = (
        ConfidentDrafter if kind == "eagle1" else type("Confident", (Sharpened, drafter_class(kind)), {})
    )
    torch.manual_seed(seed)
    drafter = sharpened(DrafterConfig.for_target(target, kind=kind))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return drafter.attach(target).eval()


def method(name: str, target, drafter, sampling, tmp_path: Path, options=None, **sections):
    """Preset ``name`` with ``sections`` in place of its own (a section's kind owns its keys, so a new
    kind starts from its own defaults); ``options``: the engine's ``DecodeOptions``."""
    config = load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})
    config = replace(config, **{k: getattr(decode_config({k: node}), k) for k, node in sections.items()})
    return build_method(config, target, drafter if config.needs_drafter else None, sampling, options)


# --- item 1: drafts past q's support ------------------------------------------------------------------

# Sampling top-k 3 is below the static trees' root width (4, 5) and top-p 0.8 leaves a confident q one
# token, so most nodes have more children than q has tokens.
TRUNCATED = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=3, top_p=0.8)
EXACT_PRESETS = [n for n in preset_names() if load_preset(n).exact]


@pytest.fixture(scope="module")
def truncated_micro():
    target, cond = micro_problem()
    return target, cond, exact_ar_distribution(target, cond, TRUNCATED)


def test_the_exact_presets_are_found():
    assert {"ar", "eagle1", "eagle2", "peanut", "sjd"} <= set(EXACT_PRESETS)
    assert not {"lantern", "lantern_pp", "gsd", "vvs"} & set(EXACT_PRESETS)


# 3000 prompts × 2 CFG streams = 6000 rows: 30 000 rows leave every tree 5 nodes (a window of 4).
SHRUNK = {"max_rows": 30_000}
SHRUNK_TREES = {
    "eagle1": {"kind": "static", "preset": "eagle1", **SHRUNK},
    "eagle2": {"kind": "dynamic", **SHRUNK},
    "sjd": {"kind": "jacobi", **SHRUNK},
}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [(n, {}) for n in EXACT_PRESETS]
    + [("lantern_pp", {"acceptance": {"kind": "exact"}})]
    + [(n, {"tree": tree}) for n, tree in SHRUNK_TREES.items()],
    ids=[*EXACT_PRESETS, "lantern_pp_tree_exact", *(f"{n}_shrunk" for n in SHRUNK_TREES)],
)
def test_exact_methods_keep_the_distribution_when_q_has_fewer_tokens_than_children(
    truncated_micro, name, overrides, tmp_path
):
    target, cond, exact = truncated_micro
    drafter = confident_drafter(target, kind=drafter_kind_for(load_preset(name)))
    engine = method(name, target, drafter, TRUNCATED, tmp_path, **overrides)
    if isinstance(engine, ARMethod):
        c = Condition(cond.features.expand(3000, -1, -1), cond.mask.expand(3000, -1))
        gens = [torch.Generator().manual_seed(9_000_000 + i) for i in range(3000)]
        samples = [tuple(x) for x in engine.generate(c, gens).tokens.tolist()]
    else:
        samples = sample_images(engine, cond, 3000, seed=21)
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


class FirstTree(Exception):
    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree


def first_tree(engine: SpeculativeEngine, root_logits: torch.Tensor, limit: int) -> DraftTree:
    """The first tree ``engine``'s builder drafts in a real decode of one prompt, with the drafter's
    root logits replaced by ``root_logits`` [1, V] and the depth limited to ``limit``."""
    build = engine.builder.build

    def build_once(eng, state: StepState) -> DraftTree:
        state.root_logits, state.depth_limit = root_logits, torch.full_like(state.depth_limit, limit)
        raise FirstTree(build(eng, state))

    engine.builder.build = build_once
    try:
        cond = Condition(torch.randn(1, 2, MICRO_GPT.caption_dim), torch.ones(1, 2, dtype=torch.bool))
        engine.generate(cond, [torch.Generator().manual_seed(0)])
    except FirstTree as done:
        return done.tree
    finally:
        del engine.builder.build
    raise AssertionError("the engine drafted no tree")


def test_static_children_outside_qs_support_are_not_drafted():
    target = make_target(MICRO_GPT, MICRO_VQ, image_size=4, seed=3)
    sampling = SamplingConfig(temperature=1.0, top_k=2)
    engine = SpeculativeEngine(
        target, confident_drafter(target), StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS)), sampling
    )
    # q over 4 tokens keeps 2 (top-k): of the root's 4 children only ranks 0 and 1 are drafts.
    logits = torch.tensor([[0.0, 3.0, -1.0, 2.0]])
    tree = first_tree(engine, logits, limit=1)
    kids = tree.children(0, 0)
    assert len(kids) == 2
    assert sorted(tree.tokens[0, kids].tolist()) == [1, 3]
    assert not tree.valid[0, tree.depths[0] > 1].any()  # the depth limit


# --- item 2: a prompt's sample does not depend on its batch ---------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_prompts_sample_alike_batched_and_alone(name, tmp_path):
    target = make_target(image_size=8)  # 4 × 4 tokens: rows reach the image's end at different steps
    drafter = Drafter.make(DrafterConfig.for_target(target, kind=drafter_kind_for(load_preset(name))))
    torch.manual_seed(0)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    drafter = drafter.attach(target).eval()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    assert_samples_alike_batched_and_alone(method(name, target, drafter, sampling, tmp_path))


def assert_samples_alike_batched_and_alone(engine) -> None:
    """Four prompts decoded together and each alone, each with its own generator, give the same tokens."""
    cond = tiny_condition(batch=4, seed=7)

    def gens(rows: range) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in rows]

    batched = engine.generate(cond, gens(range(4))).tokens
    for i in range(4):
        alone = engine.generate(
            Condition(cond.features[i : i + 1], cond.mask[i : i + 1]), gens(range(i, i + 1))
        )
        assert torch.equal(alone.tokens[0], batched[i]), f"prompt {i}"


def test_a_shrunk_tree_samples_alike_in_a_short_batch_when_the_planned_batch_is_given(tmp_path):
    target = make_target(image_size=8)
    drafter = confident_drafter(target)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    config = load_preset("eagle2", {"tree": {"max_rows": 40}})  # 40 // (2 streams × 4) = 5 nodes
    engine = build_method(config, target, drafter, sampling)
    cond = tiny_condition(batch=4, seed=7)
    gens = [torch.Generator().manual_seed(300 + i) for i in range(4)]
    with pytest.warns(UserWarning, match=r"no planned_batch, so its 4 prompts' trees shrink to 5 nodes"):
        batched = engine.generate(cond, gens).tokens  # the default: this batch's size
    assert engine.run.budget == TreeBudget(5)
    for i in range(4):
        one = Condition(cond.features[i : i + 1], cond.mask[i : i + 1])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the planned batch given: nothing depends on this batch
            alone = engine.generate(one, [torch.Generator().manual_seed(300 + i)], planned_batch=4).tokens
        assert engine.run.budget == TreeBudget(5), "the short batch's tree follows the planned batch"
        assert torch.equal(alone[0], batched[i]), f"prompt {i}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one prompt alone: its trees are one prompt's
        engine.generate(one, [None])
    assert engine.run.budget == TreeBudget(20)
    with pytest.raises(ValueError, match="planned_batch must be a positive number of prompts, got 0"):
        engine.generate(one, [None], planned_batch=0)


# --- item 3: tiny vocabularies ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "builder",
    [
        lambda: StaticTreeBuilder(StaticTreeConfig(paths=LANTERN_PP_PATHS)),  # root width 5
        lambda: DynamicTreeBuilder(DynamicTreeConfig(top_k=10, depth=2, total_tokens=12)),
    ],
    ids=["static_width_5", "dynamic_top_k_10"],
)
def test_trees_wider_than_the_vocabulary_are_capped(builder, temperature):
    target = make_target(MICRO_GPT, MICRO_VQ, image_size=4, seed=3)  # 4 image tokens
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    cond = Condition(torch.randn(2, 2, MICRO_GPT.caption_dim), torch.ones(2, 2, dtype=torch.bool))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    engine = SpeculativeEngine(target, confident_drafter(target), builder(), sampling)
    tokens = engine.generate(cond, gens).tokens
    if temperature == 0.0:
        assert torch.equal(tokens, generate_ar(target, cond, sampling, [None, None]))
    assert tokens.shape == (2, 4) and int(tokens.max()) < 4


# --- trees shrunk to the row limit ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["eagle1", "eagle2", "peanut", "sjd", "block"])
def test_a_tree_shrunk_to_the_row_limit_keeps_ar_tokens_at_t0(name, tmp_path):
    target, cond = make_target(), tiny_condition()  # 2 prompts × 2 CFG streams: 4 rows
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    drafter = confident_drafter(target, kind=drafter_kind_for(load_preset(name)))
    full = method(name, target, drafter, sampling, tmp_path)
    config = load_preset(name, {"tree": {"max_rows": 12}})  # 12 // 4 = 3 nodes
    shrunk = build_method(config, target, drafter if config.needs_drafter else None, sampling)
    tokens = shrunk.generate(cond, [None, None], planned_batch=2).tokens
    budget = shrunk.run.budget
    assert budget == TreeBudget(3)
    assert shrunk.builder.max_nodes(budget) <= full.builder.max_nodes(WHOLE_TREE)
    verified = shrunk.builder.tree_size(budget)
    assert verified == 3, f"{name}: {verified} nodes verified under the row limit"
    assert torch.equal(tokens, generate_ar(target, cond, sampling, [None, None]))


def test_the_node_budget_follows_the_rows_and_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert tree_budget(None, 16, 2, cpu) == WHOLE_TREE  # auto: no limit on a CPU
    assert tree_budget(None, 16, 2, gpu) == TreeBudget(GPU_MAX_ROWS // 32)  # B 16 with CFG: 8 nodes on a GPU
    assert tree_budget(None, 500, 2, gpu) == TreeBudget(2)  # never below the root and one draft
    assert tree_budget(0, 16, 2, gpu) == WHOLE_TREE  # off
    assert tree_budget(100, 4, 1, cpu) == TreeBudget(25)  # an explicit limit applies anywhere
    assert TreeBudget(8).cap(59) == 8 and TreeBudget(80).cap(59) == 59 and WHOLE_TREE.cap(59) == 59
