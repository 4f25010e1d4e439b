"""The shipped shapes target and drafters (eagle1, eagle3, block), and the grain world's block drafter: they
load, match, and speculative decoding is lossless on them."""

from __future__ import annotations

import pytest
import torch

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.block import BlockTreeBuilder, BlockTreeConfig
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import EAGLE1_PATHS
from vdtrain.drafters.base import Drafter
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets.shapes import REPO_ROOT, load_target_folder

DRAFTERS = {
    "eagle1": REPO_ROOT / "checkpoints" / "shapes" / "drafter",
    "eagle3": REPO_ROOT / "checkpoints" / "shapes" / "drafter_eagle3",
    "block": REPO_ROOT / "checkpoints" / "shapes" / "drafter_block",
}


SAMPLING = SamplingConfig(cfg_scale=3.0, temperature=0.0)
PROMPTS = 4  # decoded as one batch: the trees grow with it, and the CPU pays for every row


@pytest.fixture(scope="module")
def shipped():
    """The shipped target, 4 held-out captions and their AR tokens, decoded once for the module."""
    with torch.no_grad():  # for this module's tests only: grad mode is restored at its teardown
        target = load_target_folder()
        cond = target.encode_captions(shapes_heldout_captions(PROMPTS))
        yield target, cond, generate_ar(target, cond, SAMPLING, [None] * PROMPTS)


@pytest.mark.parametrize(
    ("kind", "builder"),
    [
        ("eagle1", StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS))),
        ("eagle1", DynamicTreeBuilder(DynamicTreeConfig(top_k=10, depth=5, total_tokens=59))),
        ("eagle3", DynamicTreeBuilder(DynamicTreeConfig(top_k=10, depth=5, total_tokens=59))),
        ("block", BlockTreeBuilder(BlockTreeConfig(preset="lantern_pp"))),
    ],
    ids=[
        "eagle1-drafter-eagle1",
        "eagle1-drafter-eagle2",
        "eagle3-drafter-eagle2",
        "block-drafter-block_tree",
    ],
)
def test_greedy_speculative_decoding_matches_ar_on_held_out_shapes_prompts(shipped, kind, builder):
    target, cond, ar = shipped
    drafter = Drafter.from_pretrained(DRAFTERS[kind], target)
    assert drafter.config.kind == kind
    result = SpeculativeEngine(target, drafter, builder, SAMPLING).generate(cond, [None] * PROMPTS)
    assert torch.equal(result.tokens, ar)
    assert sum(s.tau for s in result.stats) / PROMPTS > 1.5  # the trained drafter really drafts


GRAIN = REPO_ROOT / "checkpoints" / "grain"


@pytest.mark.usefixtures("one_thread")
def test_the_shipped_grain_block_drafter_drafts_blocks_that_decode_ar_tokens():
    """Both block presets (a chain and a tree over one forward's slots) on the grain target: AR's tokens
    at T = 0, more than one token per step."""
    with torch.no_grad():
        target = load_target_folder(GRAIN / "target")
        drafter = Drafter.from_pretrained(GRAIN / "drafter_block", target)
        assert drafter.config.kind == "block" and drafter.block_slots == 8
        sampling = SamplingConfig(cfg_scale=target.sampling_defaults.cfg_scale, temperature=0.0)
        cond = target.encode_captions(shapes_heldout_captions(1))
        ar = generate_ar(target, cond, sampling, [None])
        for name, tau in (("block", 1.15), ("block_tree", 1.4)):
            result = build_method(load_preset(name), target, drafter, sampling).generate(cond, [None])
            assert torch.equal(result.tokens, ar), name
            assert result.stats[0].tau > tau, f"{name}: τ {result.stats[0].tau:.2f}"
