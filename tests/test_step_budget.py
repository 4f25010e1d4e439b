"""Issue #14's step budget, checked for every method preset on the tiny target and drafter.

A fast engine waits for the device at most twice per speculative step, however many prompts and tree
nodes it handles, and launches about as many ATen ops for 8 prompts as for 1 (batched, not looped per
prompt). Counted as a GPU would see them (``vdtrain.decode.profiling``, as-if-GPU mode), with the
prefill and first step left out. Cases the engine does not meet yet are strict xfails: a fix turns them
into XPASS failures, so the marker must then be removed.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch
from conftest import drafter_kind_for, random_gpt, random_vq, tiny_condition

from vdtrain.decode.methods import build_method, load_preset, preset_names
from vdtrain.decode.profiling import StepCounts, count_steps
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

MAX_SYNCS_PER_STEP = 2
MAX_OPS_RATIO = 1.2  # ATen ops per step at batch 8 over batch 1
PRESETS = [name for name in preset_names() if name != "ar"]  # AR is the reference, not speculative
NOT_YET = "#14: this preset's builder or schedule still keeps per-prompt state on the host"
# The drafter-tree presets meet the budget (one read per step, two for PEANUT; the same ops at B=8 as at
# B=1, within 1.13x for PEANUT, whose padded shape follows the batch's largest tree), and so does SJD-PAC
# (one read per step, the same ops at B=8), and SJD's Jacobi window (SJD, GSD on SJD: one read, the same
# ops), and VVS (two reads: the loop's and the schedule's plan; up to 1.08x ops at B=8, where some prompt
# skips or post-verifies in more steps). A preset added later must meet the budget or be listed here on
# purpose.
SYNCS_FAIL: set[tuple[str, float, int]] = set()
OPS_FAIL: set[tuple[str, float]] = set()
# slow: about 40 decodes under the counters, 1.5-4 min on a CPU
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def expected_failures(cases: list[tuple], failing: set[tuple]) -> list:
    """``cases`` as pytest params, the ``failing`` ones strict xfails."""
    xfail = pytest.mark.xfail(strict=True, raises=AssertionError, reason=NOT_YET)  # a crash still fails
    return [pytest.param(*c, marks=xfail) if c in failing else c for c in cases]


@pytest.fixture(scope="module")
def neighbour_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("neighbours"))


@cache
def _counts(name: str, temperature: float, batch: int, cache_dir: str) -> StepCounts:
    """One decode of ``batch`` prompts with preset ``name`` (shared by both budget tests)."""
    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    config = load_preset(name, {"acceptance": {"cache_dir": cache_dir}})
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind=drafter_kind_for(config)))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sampling = replace(target.sampling_defaults, temperature=temperature)
    method = build_method(config, target, drafter.eval(), sampling)
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    counts, _ = count_steps(method, tiny_condition(batch), generators, as_if_gpu=True)
    assert counts.steps, f"{name}: the decode finished in one step; nothing to measure"
    return counts


@pytest.mark.parametrize(
    "name, temperature, batch",
    expected_failures([(n, t, b) for n in PRESETS for t in (0.0, 1.0) for b in (1, 8)], SYNCS_FAIL),
)
def test_at_most_two_host_syncs_per_step(name, temperature, batch, neighbour_cache):
    counts = _counts(name, temperature, batch, neighbour_cache)
    assert counts.max_syncs <= MAX_SYNCS_PER_STEP, (
        f"{name} T={temperature:g} B={batch}: up to {counts.max_syncs} host syncs per step "
        f"(mean {counts.mean_syncs:.1f}); budget {MAX_SYNCS_PER_STEP}"
    )


@pytest.mark.parametrize(
    "name, temperature", expected_failures([(n, t) for n in PRESETS for t in (0.0, 1.0)], OPS_FAIL)
)
def test_aten_ops_per_step_do_not_grow_with_the_batch(name, temperature, neighbour_cache):
    one = _counts(name, temperature, 1, neighbour_cache).mean_ops
    eight = _counts(name, temperature, 8, neighbour_cache).mean_ops
    assert eight <= MAX_OPS_RATIO * one, (
        f"{name} T={temperature:g}: {eight:.0f} ATen ops per step at batch 8 vs {one:.0f} at batch 1 "
        f"({eight / one:.2f}x; budget {MAX_OPS_RATIO}x)"
    )
