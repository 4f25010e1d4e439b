"""Per-image quality scores, chosen by name in the target config (``quality:``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Scorer = Callable[[np.ndarray, str], float]


def _shapes_consistency(image: np.ndarray, caption: str) -> float:
    from vdtrain.shapes.consistency import score_image

    return score_image(image, caption).score


SCORERS: dict[str, Scorer] = {"shapes_consistency": _shapes_consistency}


def quality_scorer(name: str | None) -> Scorer | None:
    if name is None:
        return None
    if name not in SCORERS:
        raise ValueError(f"unknown quality metric {name!r}; known: {sorted(SCORERS)}")
    return SCORERS[name]
