"""Caption consistency: does a 64x64 image show what its shapes-world caption says?

The score is the fraction of binary checks that pass: two for the background
(kind, colours) and three per object (colour present in its cell, shape, size).
Every check reads pixels only, through nearest-palette colour distances with a
tolerance of about half the palette spacing, so mild VQ blur and colour shift
do not fail a correct image, while a wrong colour, a missing object or a wrong
pattern does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .scene import (
    CELL_BOUNDS,
    CELLS,
    COLOURS,
    IMAGE_SIZE,
    PALETTE,
    SIZES,
    STRIPE_WIDTH,
    Background,
    ShapeObject,
    parse_caption,
)

_PALETTE_RGB = np.array([PALETTE[c] for c in COLOURS], dtype=np.float64)

# A pixel "has" a palette colour within this RGB distance. The closest palette
# pair is 152 apart, so a pixel matches at most one colour, and a 50/50 blend of
# an object with its background (at least 76 from either) matches neither.
COLOUR_TOLERANCE = 70.0
# Fewer matching pixels than this in a cell means the object is absent: a third
# of the smallest shape (a small triangle or diamond covers about 50 pixels).
MIN_OBJECT_PIXELS = 16
# Object extent (the longer bounding-box side) in pixels: small objects span
# 9-10, large ones 15-16 (a blur erodes them by 1-2), so split at 13; anything
# outside [4, 20] is not one of our objects.
SIZE_SPLIT = SIZES["small"] + SIZES["large"]
MIN_EXTENT, MAX_EXTENT = 4, 20
# Shape moments (see classify_shape): |skew| above this is a triangle (rendered
# -0.56, blurred -0.3 to -0.75, others within +-0.25); a four-fold moment
# beyond +-this is a diamond / square (rendered +-0.43), within it a circle.
TRIANGLE_SKEW = 0.3
FOUR_FOLD_SPLIT = 0.2
# Flat and noise backgrounds: this share of pixels lies within the tolerance of
# the background's median colour.
MIN_UNIFORM_SHARE = 0.9
# Median absolute difference between horizontal neighbours (mean over RGB): about
# 16 for the noise background, 6 after a 2x2 blur; 0 for a flat colour, up to 3.5
# after the same blur plus Gaussian noise of sigma 3.
NOISE_TEXTURE_SPLIT = 4.5
# Stripes: the share of colour variance explained by the position within the
# stripe period along the stated axis (about 0 along the other axis).
MIN_STRIPE_R2 = 0.6
# Gradients: the share of variance a linear ramp along the stated axis explains
# (at most about 0.3 along the other axis, through the shape of the mask), and
# the least colour change (RGB distance) across the image it must show.
MIN_GRADIENT_R2, MIN_GRADIENT_CHANGE = 0.8, 100.0


@dataclass(frozen=True)
class ConsistencyResult:
    """``score`` is the mean of ``checks``.

    Checks are named ``background.kind``, ``background.colour`` and
    ``object{i}.colour`` / ``.shape`` / ``.size``, with i counting the caption's
    objects in order from 0.
    """

    score: float
    checks: dict[str, bool]


def _palette_labels(rgb: np.ndarray) -> np.ndarray:
    """Index into COLOURS of the nearest palette colour per [..., 3] pixel, -1 if none is close."""
    distances = np.linalg.norm(rgb[..., None, :] - _PALETTE_RGB, axis=-1)
    labels = np.argmin(distances, axis=-1)
    return np.where(np.min(distances, axis=-1) <= COLOUR_TOLERANCE, labels, -1)


def _nearest_colour(rgb: np.ndarray) -> str | None:
    """The palette colour nearest one ``rgb`` triple, or None when none is within tolerance."""
    label = int(_palette_labels(rgb))
    return COLOURS[label] if label >= 0 else None


def _cell_slices(cell: str) -> tuple[slice, slice]:
    row, col = divmod(CELLS.index(cell), 3)
    return (
        slice(CELL_BOUNDS[row], CELL_BOUNDS[row + 1]),
        slice(CELL_BOUNDS[col], CELL_BOUNDS[col + 1]),
    )


# ---------------------------------------------------------------------------
# Background
# ---------------------------------------------------------------------------


def _explained_variance(values: np.ndarray, groups: np.ndarray) -> float:
    """Share of the variance of ``values`` [N, 3] explained by group means."""
    total = float(((values - values.mean(axis=0)) ** 2).sum())
    if total == 0.0:
        return 0.0
    fitted = np.zeros_like(values)
    for group in np.unique(groups):
        members = groups == group
        fitted[members] = values[members].mean(axis=0)
    return 1.0 - float(((values - fitted) ** 2).sum()) / total


def _linear_fit(values: np.ndarray, coord: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """R^2 of a per-channel linear ramp along ``coord``, and its colours at both edges."""
    design = np.stack([np.ones_like(coord), coord], axis=1)
    coef, *_ = np.linalg.lstsq(design, values, rcond=None)
    residual = float(((values - design @ coef) ** 2).sum())
    total = float(((values - values.mean(axis=0)) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 0.0
    return r2, coef[0] + 0.5 * coef[1], coef[0] + (IMAGE_SIZE - 0.5) * coef[1]


def _noise_texture(image: np.ndarray, mask: np.ndarray) -> float:
    """Median over neighbour pairs inside ``mask`` of the mean RGB abs difference."""
    diffs = np.abs(image[:, 1:] - image[:, :-1]).mean(axis=-1)
    pairs = mask[:, 1:] & mask[:, :-1]
    return float(np.median(diffs[pairs])) if pairs.any() else 0.0


def _check_background(image: np.ndarray, background: Background, object_cells: set[str]) -> dict[str, bool]:
    """Judge the background from pixels outside every cell that holds an object."""
    mask = np.ones(image.shape[:2], dtype=bool)
    for cell in object_cells:
        mask[_cell_slices(cell)] = False
    ys, xs = np.nonzero(mask)
    values = image[mask]
    colours = background.colours
    horizontal = background.orientation == "horizontal"

    if background.kind in ("flat", "noise"):
        median = np.median(values, axis=0)
        uniform = np.mean(np.linalg.norm(values - median, axis=-1) <= COLOUR_TOLERANCE) >= MIN_UNIFORM_SHARE
        noisy = _noise_texture(image, mask) >= NOISE_TEXTURE_SPLIT
        kind_ok = uniform and noisy == (background.kind == "noise")
        colour_ok = _nearest_colour(median) == colours[0]
    elif background.kind == "stripes":
        # Stripes run along rows when horizontal, so colour varies with y.
        along = ys if horizontal else xs
        kind_ok = _explained_variance(values, along % (2 * STRIPE_WIDTH)) >= MIN_STRIPE_R2
        # The two commonest palette colours must be the stated pair (phase free).
        labels = _palette_labels(values)
        counts = np.bincount(labels[labels >= 0], minlength=len(COLOURS))
        top_two = {COLOURS[i] for i in np.argsort(counts)[::-1][:2] if counts[i] > 0}
        colour_ok = top_two == set(colours)
    elif background.kind == "gradient":
        # A horizontal gradient changes from left to right, so colour varies with x.
        along = xs if horizontal else ys
        r2, start, end = _linear_fit(values, along.astype(np.float64))
        change = float(np.linalg.norm(end - start))
        kind_ok = r2 >= MIN_GRADIENT_R2 and change >= MIN_GRADIENT_CHANGE
        colour_ok = _nearest_colour(start) == colours[0] and _nearest_colour(end) == colours[1]
    else:
        raise ValueError(f"unknown background kind {background.kind!r}")
    return {"background.kind": bool(kind_ok), "background.colour": bool(colour_ok)}


# ---------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of ``mask``; stray matching pixels drop out."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, next_label = 0, 0, 1
    height, width = mask.shape
    for start in zip(*np.nonzero(mask), strict=True):
        if labels[start]:
            continue
        labels[start] = next_label
        queue, size = deque([start]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = next_label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = next_label, size
        next_label += 1
    return labels == best_label


def classify_shape(mask: np.ndarray) -> str | None:
    """Name the shape a boolean mask shows, from two normalised pixel moments.

    With (x, y) taken from the centroid, y pointing down: the skewness of y is
    about -0.56 for an apex-up triangle (mass piles up at the base) and 0 for
    the symmetric shapes; the four-fold moment E[x^4 - 6x^2y^2 + y^4] / E[r^4]
    (the cos 4-theta part of the mass) is -0.43 for a square, +0.42 for a
    diamond (the same square turned 45 degrees) and 0 for a circle. Moments
    average over every pixel, so blur and a stray edge pixel barely move them,
    unlike bounding-box fill ratios.
    """
    ys, xs = np.nonzero(mask)
    if len(ys) < 3:
        return None
    y = ys - ys.mean()
    x = xs - xs.mean()
    second = float(np.mean(y**2))
    fourth = float(np.mean((x**2 + y**2) ** 2))
    if second == 0.0 or fourth == 0.0:
        return None
    skew = float(np.mean(y**3)) / second**1.5
    four_fold = float(np.mean(x**4 - 6 * x**2 * y**2 + y**4)) / fourth
    if skew <= -TRIANGLE_SKEW:
        return "triangle"
    if skew >= TRIANGLE_SKEW:  # apex down: not a shape of this world
        return None
    if four_fold <= -FOUR_FOLD_SPLIT:
        return "square"
    if four_fold >= FOUR_FOLD_SPLIT:
        return "diamond"
    return "circle"


def _check_object(image: np.ndarray, obj: ShapeObject, prefix: str) -> dict[str, bool]:
    """Colour present in the object's cell, then shape and size of its largest blob."""
    region = image[_cell_slices(obj.cell)]
    distances = np.linalg.norm(region - np.asarray(PALETTE[obj.colour], np.float64), axis=-1)
    mask = distances <= COLOUR_TOLERANCE
    present = int(mask.sum()) >= MIN_OBJECT_PIXELS
    shape_ok = size_ok = False
    if present:
        blob = _largest_component(mask)
        rows = np.nonzero(blob.any(axis=1))[0]
        cols = np.nonzero(blob.any(axis=0))[0]
        extent = max(rows[-1] - rows[0], cols[-1] - cols[0]) + 1
        if MIN_EXTENT <= extent <= MAX_EXTENT:
            shape_ok = classify_shape(blob) == obj.shape
            size_ok = (extent > SIZE_SPLIT) == (obj.size == "large")
    return {
        f"{prefix}.colour": present,
        f"{prefix}.shape": shape_ok,
        f"{prefix}.size": size_ok,
    }


# ---------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------


def score_image(image: np.ndarray, caption: str) -> ConsistencyResult:
    """Score one uint8 [64, 64, 3] image against its caption (ValueError if unparsable)."""
    if image.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"expected a {IMAGE_SIZE}x{IMAGE_SIZE}x3 image, got {image.shape}")
    parsed = parse_caption(caption)
    pixels = image.astype(np.float64)
    checks = _check_background(pixels, parsed.background, {obj.cell for obj in parsed.objects})
    for index, obj in enumerate(parsed.objects):
        checks.update(_check_object(pixels, obj, f"object{index}"))
    return ConsistencyResult(score=sum(checks.values()) / len(checks), checks=checks)


def score_batch(images: np.ndarray | list[np.ndarray], captions: list[str]) -> float:
    """Mean consistency score over paired images and captions."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if len(captions) == 0:
        raise ValueError("score_batch needs at least one image")
    return float(np.mean([score_image(im, c).score for im, c in zip(images, captions, strict=True)]))
