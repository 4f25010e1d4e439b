"""EAGLE-3 drafters decode exactly with every tree preset: T = 0 tokens identical to AR, T = 1 samples
distributed as AR's (relaxed presets at their exact settings), VVS's skipping path included."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_condition
from test_engine import (
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    make_target,
    micro_problem,
    sample_images,
)
from test_exactness import method

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import load_preset, preset_names
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig

# Every tree drafted one depth per drafter call (a block tree needs a drafter that drafts blocks).
TREE_PRESETS = [
    n for n in preset_names() if load_preset(n).needs_drafter and not load_preset(n).drafts_blocks
]


def eagle3_drafter(target, seed: int = 4, std: float = 0.3) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="eagle3"))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter.attach(target).eval()


def exact_sections(name: str) -> dict:
    """A relaxed preset at its exact setting: the exact rule, every step verified."""
    if load_preset(name).exact:
        return {}
    return {"acceptance": {"kind": "exact"}, "schedule": {"kind": "always"}}


def test_every_tree_preset_is_covered():
    assert {"eagle1", "eagle2", "peanut", "lantern", "lantern_pp", "gsd_tree", "vvs"} <= set(TREE_PRESETS)


@pytest.mark.parametrize("name", TREE_PRESETS)
def test_eagle3_drafts_decode_the_ar_tokens_at_t0(name, tmp_path):
    target = make_target(seed=1)
    drafter = eagle3_drafter(target)
    assert drafter.taps == target.default_feature_layers()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    engine = method(name, target, drafter, sampling, tmp_path, **exact_sections(name))
    result = engine.generate(cond, [None, None])
    assert torch.equal(result.tokens, generate_ar(target, cond, sampling, [None, None]))
    assert sum(s.drafter_forwards for s in result.stats) > 0


@pytest.fixture(scope="module")
def micro():
    target, cond = micro_problem()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    return (
        target,
        eagle3_drafter(target, std=0.5),
        cond,
        sampling,
        exact_ar_distribution(target, cond, sampling),
    )


# Every distinct tree the presets draft once their acceptance is exact (lantern, gsd_tree and vvs draft
# eagle2's tree, peanut_lantern peanut's).
DISTINCT_TREES = ["eagle1", "eagle2", "peanut", "lantern_pp", "vvs_release"]


@pytest.mark.parametrize("name", DISTINCT_TREES)
def test_eagle3_drafts_keep_the_ar_distribution_at_t1(micro, name, tmp_path):
    target, drafter, cond, sampling, exact = micro
    engine = method(name, target, drafter, sampling, tmp_path, **exact_sections(name))
    samples = sample_images(engine, cond, 3000, seed=31)
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


def test_vvs_skips_with_fused_stale_features(tmp_path):
    """VVS's skipped steps feed the drafter cached target features: an eagle3 drafter's are the fused
    ones, and the decode runs through skips."""
    target = make_target(image_size=8, seed=2)
    drafter = eagle3_drafter(target, std=0.2)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    engine = method("vvs", target, drafter, sampling, tmp_path, schedule={"kind": "uniform", "every": 2})
    cond = tiny_condition(batch=2, seed=7)
    result = engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    assert all(s.skipped_steps > 0 for s in result.stats)
    assert engine.run.draft.fcache.shape[-1] == target.hidden_size
