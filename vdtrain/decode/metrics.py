"""One set of metric definitions for every method (docs/decoding.md, "Metrics"), from ``DecodeStats``.

- S (step compression) = image tokens / target forward passes (the prefill included, so AR has S = 1);
- τ = mean tokens committed per *verified* step (accepted drafts + the bonus);
- d̄ = mean depth of the drafted trees;
- TPF = image tokens / target forward passes. It equals S by definition; they part from τ only when
  steps are committed without verification (VVS);
- skipped steps = steps committed without verification (VVS), per prompt; a skipped step costs no
  target forward, so TPF counts its tokens and τ does not;
- relaxed acceptances = drafts accepted only thanks to a relaxed rule (LANTERN, LANTERN++, GSD), per
  prompt; 0 for exact methods.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vdtrain.decode.run import DecodeStats


def summarize(stats: Sequence[DecodeStats], n_tokens: int) -> dict[str, float]:
    forwards = [s.target_forwards for s in stats]
    s_ratio = float(np.mean([n_tokens / f for f in forwards]))
    return {
        "S": s_ratio,
        "tau": float(np.mean([s.tau for s in stats])),
        "mean_depth": float(np.mean([s.mean_depth for s in stats])),
        "TPF": s_ratio,
        "target_forwards": float(np.mean(forwards)),
        "drafter_forwards": float(np.mean([s.drafter_forwards for s in stats])),
        "relaxed_acceptances": float(np.mean([s.relaxed_acceptances for s in stats])),
        "verified_steps": float(np.mean([s.steps for s in stats])),
        "skipped_steps": float(np.mean([s.skipped_steps for s in stats])),
    }


def position_maps(stats: Sequence[DecodeStats], grid: tuple[int, int]) -> dict[str, np.ndarray]:
    """Per image position (the root of a step), the mean accepted length and the mean tree depth,
    as [h, w] arrays; NaN where no step was rooted."""
    h, w = grid
    acc, depth, count = np.zeros(h * w), np.zeros(h * w), np.zeros(h * w)
    for s in stats:
        for (pos, accepted), d in zip(s.accept_map, s.depth_per_step, strict=True):
            acc[pos] += accepted
            depth[pos] += d
            count[pos] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "accepted_length": (acc / count).reshape(h, w),
            "tree_depth": (depth / count).reshape(h, w),
        }
