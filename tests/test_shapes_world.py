"""The shapes world: determinism, captions that round-trip, and a score that tells
right images from wrong ones while forgiving VQ-like blur."""

import itertools

import numpy as np
import pytest

from vdtrain.shapes import (
    BACKGROUND_KINDS,
    CELLS,
    COLOURS,
    HELDOUT_SEED,
    PALETTE,
    SHAPES,
    SIZES,
    TRAIN_SEED,
    Background,
    Scene,
    ShapeObject,
    describe,
    generate,
    generate_one,
    parse_caption,
    render,
    score_batch,
    score_image,
)
from vdtrain.shapes.scene import CELL_BOUNDS, MAX_CAPTION_WORDS


@pytest.fixture(scope="module")
def heldout() -> list:
    return generate(300, HELDOUT_SEED)


def _degrade(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A stand-in for VQ reconstruction: 2x2 box blur, colour shift, pixel noise."""
    padded = np.pad(image.astype(np.float64), ((0, 1), (0, 1), (0, 0)), mode="edge")
    blurred = (padded[:-1, :-1] + padded[1:, :-1] + padded[:-1, 1:] + padded[1:, 1:]) / 4
    shifted = blurred + rng.uniform(-8, 8, size=3) + rng.normal(0, 3, size=blurred.shape)
    return np.clip(np.round(shifted), 0, 255).astype(np.uint8)


def _template(caption: str) -> str:
    """Which sentence frame a caption uses, from its fixed words."""
    if caption.startswith("the background is"):
        return "background first, predicate"
    if ". the background is" in caption:
        return "objects first, predicate"
    if caption.startswith("on "):
        return "on background there is"
    if caption.startswith(("an image of", "a picture of")):
        return "an image of"
    if ":" in caption:
        return "count then list"
    if " with " in caption:
        return "background with objects"
    return "objects on background"


def test_palette_colours_are_far_apart() -> None:
    rgb = [np.array(PALETTE[c], dtype=float) for c in COLOURS]
    assert len(COLOURS) == 8
    assert min(np.linalg.norm(a - b) for a, b in itertools.combinations(rgb, 2)) >= 150


def test_generation_is_deterministic_per_index() -> None:
    first, again = generate(6, TRAIN_SEED), generate(6, TRAIN_SEED, workers=2)  # processes change nothing
    for a, b in zip(first, again, strict=True):
        assert a.caption == b.caption and a.scene == b.scene
        np.testing.assert_array_equal(a.image, b.image)
    # Sample i depends on (seed, i) only, so shards can be made independently.
    alone = generate_one(TRAIN_SEED, 4)
    assert alone.caption == first[4].caption
    np.testing.assert_array_equal(alone.image, first[4].image)
    assert len({s.caption for s in first}) == len(first)
    assert not np.array_equal(first[0].image, first[1].image)
    assert generate(1, HELDOUT_SEED)[0].caption != first[0].caption
    np.testing.assert_array_equal(render(first[0].scene), first[0].image)


def test_scenes_respect_the_world_rules(heldout: list) -> None:
    for sample in heldout:
        scene: Scene = sample.scene
        assert sample.image.shape == (64, 64, 3) and sample.image.dtype == np.uint8
        assert 1 <= len(scene.objects) <= 3
        assert len({obj.cell for obj in scene.objects}) == len(scene.objects)
        for obj in scene.objects:
            assert obj.colour not in scene.background.colours
            # Every pixel of the object's exact colour lies inside its cell.
            row, col = divmod(CELLS.index(obj.cell), 3)
            exact = np.all(sample.image == PALETTE[obj.colour], axis=-1)
            other_objects = [o for o in scene.objects if o.colour == obj.colour and o is not obj]
            if scene.background.kind != "noise" and not other_objects:
                ys, xs = np.nonzero(exact)
                assert CELL_BOUNDS[row] <= ys.min() and ys.max() < CELL_BOUNDS[row + 1]
                assert CELL_BOUNDS[col] <= xs.min() and xs.max() < CELL_BOUNDS[col + 1]
    kinds = [s.scene.background.kind for s in heldout]
    assert set(kinds) == set(BACKGROUND_KINDS)
    assert 0.3 <= kinds.count("flat") / len(kinds) <= 0.5


def test_captions_vary_and_parse_back_to_the_scene() -> None:
    samples = generate(500, TRAIN_SEED)
    templates = {_template(s.caption) for s in samples[:300]}
    assert len(templates) >= 6, templates
    assert max(len(s.caption.split()) for s in samples) <= MAX_CAPTION_WORDS
    for sample in samples:
        parsed = parse_caption(sample.caption)
        assert parsed.background == sample.scene.background, sample.caption
        assert parsed.objects == sample.scene.objects, sample.caption


@pytest.mark.parametrize(
    "caption",
    [
        "",
        "hello world",
        "a small red circle in the top left",  # no background
        "a blue background",  # no object
        "a small red circle in the top left on a blue background with a dragon",
        "two objects on a blue background: a small red circle in the top left",
        "a small red circle in the top left and a large red square in the top left on a blue background",
        "a small red circle in the top left on a blue background and a green background",
    ],
)
def test_parse_caption_rejects_garbage(caption: str) -> None:
    with pytest.raises(ValueError):
        parse_caption(caption)


def test_ground_truth_scores_high_and_exercises_every_check(heldout: list) -> None:
    results = [score_image(s.image, s.caption) for s in heldout]
    assert np.mean([r.score for r in results]) >= 0.98
    check_types = {
        name.split(".", 1)[1] if name.startswith("object") else name for r in results for name in r.checks
    }
    assert check_types == {"background.kind", "background.colour", "colour", "shape", "size"}
    objects = [obj for s in heldout for obj in s.scene.objects]
    assert {o.shape for o in objects} == set(SHAPES)
    assert {o.size for o in objects} == set(SIZES)
    assert {o.cell for o in objects} == set(CELLS)
    assert {c for s in heldout for c in s.scene.background.colours} == set(COLOURS)


def test_mismatched_captions_and_noise_score_low(heldout: list) -> None:
    images = [s.image for s in heldout]
    shifted = [heldout[(i + 1) % len(heldout)].caption for i in range(len(heldout))]
    assert score_batch(images, shifted) <= 0.6
    # Every kind of check can fail: none of them passes regardless of the image.
    failed = {
        name.split(".", 1)[1] if name.startswith("object") else name
        for image, caption in zip(images, shifted, strict=True)
        for name, ok in score_image(image, caption).checks.items()
        if not ok
    }
    assert failed == {"background.kind", "background.colour", "colour", "shape", "size"}
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8) for _ in heldout]
    assert score_batch(noise, [s.caption for s in heldout]) <= 0.3


def test_blurred_colour_shifted_ground_truth_still_scores_high(heldout: list) -> None:
    rng = np.random.default_rng(0)
    degraded = [_degrade(s.image, rng) for s in heldout]
    assert score_batch(degraded, [s.caption for s in heldout]) >= 0.9


def test_background_kind_check_tells_every_kind_and_orientation_apart() -> None:
    """Render each background and state each other one: only the true one passes."""
    objects = (
        ShapeObject("circle", "red", "large", "center"),
        ShapeObject("triangle", "yellow", "small", "top left"),
    )
    backgrounds = [
        Background("flat", ("blue",)),
        Background("noise", ("blue",)),
        Background("stripes", ("blue", "white"), "horizontal"),
        Background("stripes", ("blue", "white"), "vertical"),
        Background("gradient", ("blue", "white"), "horizontal"),
        Background("gradient", ("blue", "white"), "vertical"),
    ]
    rng = np.random.default_rng(0)
    for shown, stated in itertools.product(backgrounds, backgrounds):
        image = render(Scene(shown, objects, texture_seed=7))
        caption = describe(Scene(stated, objects, texture_seed=7), rng)
        checks = score_image(image, caption).checks
        assert checks["background.kind"] == (shown == stated), (shown, caption)
