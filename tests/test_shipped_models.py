"""The shipped shapes target and drafters (eagle1, eagle3): they load, match, and speculative decoding is
lossless on them."""

from __future__ import annotations

import pytest
import torch

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder
from vdtrain.decode.builders.static import StaticTreeBuilder
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import EAGLE1_PATHS, static_tree
from vdtrain.drafter import Drafter
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets.shapes import REPO_ROOT, load_target_folder

DRAFTERS = {
    "eagle1": REPO_ROOT / "checkpoints" / "shapes" / "drafter",
    "eagle3": REPO_ROOT / "checkpoints" / "shapes" / "drafter_eagle3",
}


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def shipped(request):
    with torch.no_grad():  # for this module's tests only: grad mode is restored at its teardown
        target = load_target_folder()
        drafter = Drafter.from_pretrained(DRAFTERS[request.param], target)
        assert drafter.config.kind == request.param
        yield target, drafter


@pytest.mark.parametrize(
    "builder",
    [StaticTreeBuilder(static_tree(EAGLE1_PATHS)), DynamicTreeBuilder(top_k=10, depth=5, total_tokens=59)],
    ids=["eagle1", "eagle2"],
)
def test_greedy_speculative_decoding_matches_ar_on_20_shapes_prompts(shipped, builder):
    target, drafter = shipped
    cond = target.encode_captions(shapes_heldout_captions(20))
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None] * 20)
    result = SpeculativeEngine(target, drafter, builder, sampling).generate(cond, [None] * 20)
    assert torch.equal(result.tokens, ar)
    assert sum(s.tau for s in result.stats) / 20 > 1.5  # the trained drafter really drafts
