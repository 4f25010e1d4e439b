"""One metric definition for every method: S, τ, d̄, TPF and the per-position maps."""

from __future__ import annotations

import math

import numpy as np

from vdtrain.decode.metrics import position_maps, summarize
from vdtrain.decode.run import DecodeStats


def test_summary_of_a_speculative_run():
    # 8 tokens: prefill gives x_0, then steps committing 3 + 2 + 2 (+ x_0) = 8 tokens in 4 target forwards
    stats = DecodeStats(
        target_forwards=4,
        steps=3,
        committed_per_step=[3, 2, 2],
        depth_per_step=[4, 2, 3],
        accept_map=[(0, 2), (3, 1), (5, 1)],
    )
    s = summarize([stats], n_tokens=8)
    assert s["S"] == 2.0 and s["TPF"] == 2.0
    assert math.isclose(s["tau"], 7 / 3) and s["mean_depth"] == 3.0


def test_ar_has_unit_compression():
    ar = DecodeStats(target_forwards=4, steps=3, committed_per_step=[1, 1, 1], depth_per_step=[0, 0, 0])
    assert summarize([ar], 4)["S"] == 1.0


def test_position_maps_average_per_root_position():
    a = DecodeStats(accept_map=[(0, 2), (3, 0)], depth_per_step=[4, 2])
    b = DecodeStats(accept_map=[(0, 4)], depth_per_step=[6])
    maps = position_maps([a, b], (2, 2))
    assert maps["accepted_length"][0, 0] == 3.0 and maps["tree_depth"][0, 0] == 5.0
    assert maps["accepted_length"][1, 1] == 0.0 and np.isnan(maps["accepted_length"][0, 1])
