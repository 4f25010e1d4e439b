"""The shapes world: procedural 64x64 scenes, their renderings and their captions.

A toy stand-in for real text-to-image data. Scenes are small enough for a tiny
autoregressive model (16x16 VQ tokens of 4x4 pixels) to learn on a CPU, varied
enough that captions matter, and crisp enough to be scored from pixels alone
(see ``consistency.py``). A caption fixes every attribute of its scene except the
objects' small position jitter and the background noise texture.

Coordinates: ``x`` grows to the right, ``y`` grows downwards, pixel ``(y, x)`` has
its centre at ``(y + 0.5, x + 0.5)``.
"""

from __future__ import annotations

import multiprocessing
import re
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 64

# Eight named colours, hand-tuned so that every pair is at least 152 apart in RGB
# (closest pairs: orange-yellow 152, yellow-white 155, red-orange 157). Nearest-
# palette assignment therefore tolerates about 75 levels of blur or colour shift.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (185, 0, 0),
    "orange": (255, 140, 0),
    "yellow": (255, 255, 100),
    "green": (0, 170, 0),
    "blue": (0, 70, 255),
    "purple": (150, 0, 200),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)

SHAPES: tuple[str, ...] = ("square", "circle", "triangle", "diamond")

# Half of the side / radius in pixels: small spans 10 px, large 16 px.
SIZES: dict[str, int] = {"small": 5, "large": 8}
MAX_JITTER = 2  # per-axis object offset in pixels, drawn from the texture seed

# 3x3 grid of cells, row-major. Cell pixel bounds are [0, 21), [21, 43), [43, 64)
# on each axis; objects are drawn around the rounded cell centres 11, 32, 53, so a
# large object with maximal jitter (centre +- 10 px) stays inside its cell.
CELLS: tuple[str, ...] = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
CELL_BOUNDS: tuple[int, int, int, int] = (0, 21, 43, 64)
CELL_CENTRES: tuple[int, int, int] = (11, 32, 53)

BACKGROUND_KINDS: tuple[str, ...] = ("flat", "stripes", "gradient", "noise")
BACKGROUND_KIND_PROBS: tuple[float, ...] = (0.4, 0.2, 0.2, 0.2)
ORIENTATIONS: tuple[str, ...] = ("horizontal", "vertical")
STRIPE_WIDTH = 4  # pixels per stripe (period 8): one VQ token row/column per stripe
# Noise backgrounds: uniform per-pixel, per-channel noise in [-24, 24] around the
# colour pulled 24 levels inside the RGB cube, so it is never clipped and reads
# as equally grainy on black and white (a blurred copy stays distinguishable
# from a flat background).
NOISE_AMPLITUDE = 24
# An object colour must stay this far (RGB distance) from every colour its
# background takes, blends of two background colours included, so object masks
# stay unambiguous on blurred images.
MIN_OBJECT_BACKGROUND_DISTANCE = 90.0

MAX_OBJECTS = 3
MAX_CAPTION_WORDS = 35  # keeps captions short for a small text encoder

# Dataset split seeds: sample i of a split is generated from default_rng([seed, i]).

TRAIN_SEED = 0
HELDOUT_SEED = 1
VALIDATION_SEED = 2  # captions that decoding knobs are chosen on, so held-out figures stay unbiased


@dataclass(frozen=True)
class Rendering:
    """What a world adds to a scene's pixels beyond what its caption states.

    The grain world's target is uncertain for the reasons a real VQ model is: content the caption
    leaves open (a smooth shading, a fine texture, grain) is what its redundant codebook spends codes
    on. Zero everywhere is the shapes world, rendered exactly as before.
    """

    grain: float = 0.0  # std (RGB levels) of Gaussian noise on every pixel and channel
    texture: float = 0.0  # std (RGB levels) of a brightness pattern drawn per 2x2-pixel block
    shading: float = 0.0  # std (RGB levels) of a smooth brightness field, one value per 4x4-pixel patch

    def __post_init__(self) -> None:
        if min(self.grain, self.texture, self.shading) < 0:
            raise ValueError(f"a rendering needs grain, texture and shading >= 0, got {self}")


# Each embedded world's rendering, by the name its target's config.json records ("world").
RENDERINGS: dict[str, Rendering] = {
    "shapes": Rendering(),
    "grain": Rendering(grain=4.0, texture=12.0, shading=24.0),
}


def rendering_of(world: str) -> Rendering:
    if world not in RENDERINGS:
        raise ValueError(f"unknown world {world!r}; known: {sorted(RENDERINGS)}")
    return RENDERINGS[world]


@dataclass(frozen=True)
class Background:
    """A background pattern.

    ``colours`` holds one colour for ``flat`` and ``noise``, two for ``stripes``
    (the first starts at the top / left edge) and ``gradient`` (from the first to
    the second). ``orientation`` is None for ``flat`` and ``noise``; for stripes
    it is the direction the stripes run (horizontal stripes are rows of colour),
    for a gradient the direction the colour changes along (horizontal: left to
    right, vertical: top to bottom) -- both as in everyday speech.
    """

    kind: str
    colours: tuple[str, ...]
    orientation: str | None = None


@dataclass(frozen=True)
class ShapeObject:
    """One coloured shape centred (up to jitter) in one cell of the 3x3 grid."""

    shape: str
    colour: str
    size: str
    cell: str


@dataclass(frozen=True)
class Scene:
    """Everything needed to render an image; ``texture_seed`` drives noise and jitter."""

    background: Background
    objects: tuple[ShapeObject, ...]
    texture_seed: int


@dataclass(frozen=True)
class ParsedCaption:
    """The attributes a caption states: the scene minus its texture seed."""

    background: Background
    objects: tuple[ShapeObject, ...]


@dataclass(frozen=True)
class Sample:
    """One training pair, with the scene kept so tests and metrics can check it."""

    caption: str
    image: np.ndarray
    scene: Scene


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def _rgb(colour: str) -> np.ndarray:
    return np.asarray(PALETTE[colour], dtype=np.float64)


def _distance_to_background(colour: str, background: Background) -> float:
    """Smallest RGB distance from ``colour`` to any colour the background shows.

    With two colours that is the distance to the segment between them: a
    gradient shows every blend, and blurring stripes (as a VQ decoder does)
    blends them at each edge.
    """
    point = _rgb(colour)
    if len(background.colours) == 1:
        return float(np.linalg.norm(point - _rgb(background.colours[0])))
    start, stop = (_rgb(c) for c in background.colours)
    direction = stop - start
    t = np.clip(np.dot(point - start, direction) / np.dot(direction, direction), 0.0, 1.0)
    return float(np.linalg.norm(point - (start + t * direction)))


def object_colours_for(background: Background) -> tuple[str, ...]:
    """Colours an object may take on this background (never a background colour)."""
    return tuple(
        c for c in COLOURS if _distance_to_background(c, background) >= MIN_OBJECT_BACKGROUND_DISTANCE
    )


def _sample_background(rng: np.random.Generator) -> Background:
    kind = str(rng.choice(BACKGROUND_KINDS, p=BACKGROUND_KIND_PROBS))
    if kind in ("flat", "noise"):
        return Background(kind, (str(rng.choice(COLOURS)),), None)
    pair = rng.choice(len(COLOURS), size=2, replace=False)
    colours = (COLOURS[pair[0]], COLOURS[pair[1]])
    return Background(kind, colours, str(rng.choice(ORIENTATIONS)))


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw a background and 1-3 objects in distinct cells, coloured off-background."""
    background = _sample_background(rng)
    allowed = object_colours_for(background)
    n_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    cells = rng.choice(len(CELLS), size=n_objects, replace=False)
    objects = tuple(
        ShapeObject(
            shape=str(rng.choice(SHAPES)),
            colour=str(rng.choice(allowed)),
            size=str(rng.choice(tuple(SIZES))),
            cell=CELLS[int(cell)],
        )
        for cell in cells
    )
    return Scene(background, objects, texture_seed=int(rng.integers(2**31)))


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def _render_background(background: Background, noise_rng: np.random.Generator) -> np.ndarray:
    """Float [H, W, 3] background; stripes and gradients start at the top / left."""
    size = IMAGE_SIZE
    ys, xs = np.mgrid[0:size, 0:size]
    first = _rgb(background.colours[0])
    if background.kind == "flat":
        return np.broadcast_to(first, (size, size, 3)).copy()
    if background.kind == "noise":
        noise = noise_rng.integers(-NOISE_AMPLITUDE, NOISE_AMPLITUDE + 1, size=(size, size, 3))
        return np.clip(first, NOISE_AMPLITUDE, 255 - NOISE_AMPLITUDE) + noise
    second = _rgb(background.colours[1])
    horizontal = background.orientation == "horizontal"
    if background.kind == "stripes":  # horizontal stripes change colour down the rows
        use_second = ((ys if horizontal else xs) // STRIPE_WIDTH) % 2 == 1
        return np.where(use_second[..., None], second, first)
    if background.kind == "gradient":  # a horizontal gradient changes left to right
        t = (((xs if horizontal else ys) + 0.5) / size)[..., None]
        return (1.0 - t) * first + t * second
    raise ValueError(f"unknown background kind {background.kind!r}")


def shape_mask(shape: str, half: int, centre_y: int, centre_x: int) -> np.ndarray:
    """Boolean [H, W] mask of a shape with half-size ``half`` around a pixel corner.

    Centres sit on pixel corners, so a square of half-size 5 is exactly 10x10.
    """
    ys, xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE]
    dy = ys + 0.5 - centre_y
    dx = xs + 0.5 - centre_x
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "circle":
        return dx**2 + dy**2 <= half**2
    if shape == "triangle":  # apex up, base at the bottom
        return (np.abs(dy) <= half) & (np.abs(dx) <= (dy + half) / 2)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= half
    raise ValueError(f"unknown shape {shape!r}")


SHADING_PATCH = 4  # pixels per side of a shading value: one VQ token's patch
SHADING_SMOOTHING = 1.0  # std, in patches, of the Gaussian that correlates neighbouring patches


def _shading_field(rng: np.random.Generator, std: float) -> np.ndarray:
    """White noise on the token grid blurred over about one patch: a patch's brightness follows its
    neighbours' (so the next token's distribution moves with the tokens before it) yet keeps an
    innovation no caption or context determines."""
    side = IMAGE_SIZE // SHADING_PATCH
    radius = int(np.ceil(3 * SHADING_SMOOTHING))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / SHADING_SMOOTHING) ** 2)
    taps /= np.sqrt(np.sum(taps**2))  # unit variance out for unit-variance white noise in
    noise = rng.normal(0.0, 1.0, size=(side + 2 * radius, side + 2 * radius))
    rows = np.stack([np.convolve(r, taps, mode="valid") for r in noise])
    field = np.stack([np.convolve(c, taps, mode="valid") for c in rows.T]).T
    return std * field


def _apply_rendering(image: np.ndarray, rendering: Rendering, texture_seed: int) -> np.ndarray:
    """A smooth shading per token patch, a texture (a brightness pattern of 2x2-pixel blocks: finer
    than a token's 4x4 patch and independent between patches, so which of a code's copies encodes a
    patch is left to chance), then grain."""
    if rendering.shading:
        field = _shading_field(np.random.default_rng([texture_seed, 5]), rendering.shading)
        image = image + field[..., None].repeat(SHADING_PATCH, axis=0).repeat(SHADING_PATCH, axis=1)
    if rendering.texture:
        texture_rng = np.random.default_rng([texture_seed, 4])
        blocks = texture_rng.normal(0.0, rendering.texture, size=(IMAGE_SIZE // 2, IMAGE_SIZE // 2, 1))
        image = image + blocks.repeat(2, axis=0).repeat(2, axis=1)
    if rendering.grain:
        grain_rng = np.random.default_rng([texture_seed, 3])
        image = image + grain_rng.normal(0.0, rendering.grain, size=image.shape)
    return np.clip(image, 0, 255)


def render(scene: Scene, rendering: Rendering = RENDERINGS["shapes"]) -> np.ndarray:
    """Render a scene to uint8 [64, 64, 3]; deterministic given the scene and the rendering."""
    noise_rng = np.random.default_rng([scene.texture_seed, 0])
    jitter_rng = np.random.default_rng([scene.texture_seed, 1])
    image = _render_background(scene.background, noise_rng)
    for obj in scene.objects:
        row, col = divmod(CELLS.index(obj.cell), 3)
        dy, dx = jitter_rng.integers(-MAX_JITTER, MAX_JITTER + 1, size=2)
        mask = shape_mask(
            obj.shape, SIZES[obj.size], CELL_CENTRES[row] + int(dy), CELL_CENTRES[col] + int(dx)
        )
        image[mask] = _rgb(obj.colour)
    return np.round(_apply_rendering(image, rendering, scene.texture_seed)).astype(np.uint8)


# ---------------------------------------------------------------------------
# Captions
# ---------------------------------------------------------------------------

# Every way a cell may be named in a caption, mapped back to the cell.
_LOCATION_PHRASES: dict[str, str] = {
    **{f"{prep} the {c}": c for c in CELLS if " " in c for prep in ("in", "at")},
    "at the top": "top",
    "in the top middle": "top",
    "at the bottom": "bottom",
    "in the bottom middle": "bottom",
    "on the left": "left",
    "at the left": "left",
    "on the right": "right",
    "at the right": "right",
    "in the center": "center",
    "at the center": "center",
    "in the middle": "center",
}
_PHRASES_BY_CELL: dict[str, tuple[str, ...]] = {
    cell: tuple(p for p, c in _LOCATION_PHRASES.items() if c == cell) for cell in CELLS
}
_COUNT_PHRASES: dict[int, tuple[str, ...]] = {
    1: ("one object", "a single object"),
    2: ("two objects",),
    3: ("three objects",),
}
_GRADIENT_DIRECTIONS: dict[str, str] = {"horizontal": "left to right", "vertical": "top to bottom"}
_GRADIENT_ENDS: dict[str, tuple[str, str]] = {
    "horizontal": ("on the left", "on the right"),
    "vertical": ("at the top", "at the bottom"),
}


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _object_phrase(obj: ShapeObject, rng: np.random.Generator) -> str:
    article = _pick(rng, ("a", "a", "one"))
    location = _pick(rng, _PHRASES_BY_CELL[obj.cell])
    return f"{article} {obj.size} {obj.colour} {obj.shape} {location}"


def _join(phrases: list[str]) -> str:
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _a(words: str) -> str:
    """Prefix the right indefinite article ("an orange ...")."""
    return ("an " if words[0] in "aeiou" else "a ") + words


def _background_noun(background: Background, rng: np.random.Generator) -> str:
    """The background as a noun phrase that can follow "on"."""
    colours, orientation = background.colours, background.orientation
    if background.kind == "flat":
        return _a(_pick(rng, ("", "plain ", "solid ")) + f"{colours[0]} background")
    if background.kind == "noise":
        return _a(_pick(rng, ("noisy", "grainy")) + f" {colours[0]} background")
    if background.kind == "stripes":
        stripes = f"{orientation} {colours[0]} and {colours[1]} stripes"
        return _pick(rng, (stripes, f"a background of {stripes}"))
    return _gradient_phrase(background, rng)


def _background_predicate(background: Background, rng: np.random.Generator) -> str:
    """The background as what follows "the background is"."""
    colours = background.colours
    if background.kind == "flat":
        return _pick(rng, ("", "plain ", "solid ")) + colours[0]
    if background.kind == "noise":
        return _pick(rng, ("noisy", "grainy")) + f" {colours[0]}"
    if background.kind == "stripes":
        return f"{background.orientation} {colours[0]} and {colours[1]} stripes"
    return _gradient_phrase(background, rng)


def _gradient_phrase(background: Background, rng: np.random.Generator) -> str:
    first, second = background.colours
    orientation = str(background.orientation)
    if rng.integers(2):
        return _a(f"{first} to {second} gradient from {_GRADIENT_DIRECTIONS[orientation]}")
    start, end = _GRADIENT_ENDS[orientation]
    return f"a gradient from {first} {start} to {second} {end}"


def _phrase(scene: Scene, rng: np.random.Generator) -> str:
    """One draw of template, object wording and background wording."""
    objects = _join([_object_phrase(obj, rng) for obj in scene.objects])
    there = "there is" if len(scene.objects) == 1 else "there are"
    template = int(rng.integers(7))
    if template == 0:
        return f"{objects} on {_background_noun(scene.background, rng)}"
    if template == 1:
        return f"on {_background_noun(scene.background, rng)} {there} {objects}"
    if template == 2:
        return f"{_background_noun(scene.background, rng)} with {objects}"
    if template == 3:
        count = _pick(rng, _COUNT_PHRASES[len(scene.objects)])
        return f"{count} on {_background_noun(scene.background, rng)}: {objects}"
    if template == 4:
        return f"{objects}. the background is {_background_predicate(scene.background, rng)}"
    if template == 5:
        image = _pick(rng, ("an image of", "a picture of"))
        return f"{image} {objects} on {_background_noun(scene.background, rng)}"
    return f"the background is {_background_predicate(scene.background, rng)}, with {objects}"


def describe(scene: Scene, rng: np.random.Generator) -> str:
    """A caption stating every attribute of the scene, in one of seven phrasings.

    Phrasings longer than ``MAX_CAPTION_WORDS`` are redrawn; one always fits
    (objects first, then the short gradient or stripes wording: at most 35
    words). Objects keep the scene's order, so ``parse_caption`` returns them
    in order.
    """
    while True:
        caption = _phrase(scene, rng)
        if len(caption.split()) <= MAX_CAPTION_WORDS:
            return caption


# --- parsing: find the background and object phrases, then demand that nothing
# but connective words is left over, so garbage cannot slip through. ---

_COLOUR_RE = "|".join(COLOURS)
_LOCATION_RE = "|".join(sorted(map(re.escape, _LOCATION_PHRASES), key=len, reverse=True))
_OBJECT_RE = re.compile(rf"\b(?:a|one) (small|large) ({_COLOUR_RE}) ({'|'.join(SHAPES)}) ({_LOCATION_RE})\b")
_DIRECTION_RE = "|".join(_GRADIENT_DIRECTIONS.values())
_END_RE = "|".join(end for ends in _GRADIENT_ENDS.values() for end in ends)
# Tried in order; flat comes last because "a noisy red background" also ends in
# "red background".
_BACKGROUND_RES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("stripes", re.compile(rf"\b(horizontal|vertical) ({_COLOUR_RE}) and ({_COLOUR_RE}) stripes\b")),
    (
        "gradient",
        re.compile(
            rf"\ban? (?:({_COLOUR_RE}) to ({_COLOUR_RE}) gradient from ({_DIRECTION_RE})"
            rf"|gradient from ({_COLOUR_RE}) ({_END_RE}) to ({_COLOUR_RE}) ({_END_RE}))\b"
        ),
    ),
    ("noise", re.compile(rf"\b(?:noisy|grainy) ({_COLOUR_RE})\b")),
    ("flat", re.compile(rf"\b(?:(?:plain|solid) ({_COLOUR_RE})|({_COLOUR_RE}) background\b)")),
    ("flat", re.compile(rf"\bbackground is ({_COLOUR_RE})\b")),
)
_COUNT_RE = re.compile(r"\b(one object|a single object|two objects|three objects)\b")
_COUNT_VALUES = {phrase: n for n, phrases in _COUNT_PHRASES.items() for phrase in phrases}
_CONNECTIVES = frozenset(
    ["a", "an", "on", "there", "is", "are", "with", "the", "background", "of", "image", "picture", "and"]
)


def _parse_background(caption: str) -> tuple[Background, str]:
    """The background a caption states, and the caption with that phrase blanked."""
    for kind, pattern in _BACKGROUND_RES:
        matches = list(pattern.finditer(caption))
        if not matches:
            continue
        if len(matches) > 1:
            raise ValueError(f"caption states more than one background: {caption!r}")
        match = matches[0]
        groups = [g for g in match.groups() if g is not None]
        if kind == "stripes":
            background = Background(kind, (groups[1], groups[2]), groups[0])
        elif kind == "gradient":
            # groups: (first, second, direction) or (first, start, second, end)
            first, second = (groups[0], groups[1]) if len(groups) == 3 else (groups[0], groups[2])
            vertical = "top" in groups[-1] or "bottom" in groups[-1]
            background = Background(kind, (first, second), "vertical" if vertical else "horizontal")
        else:
            background = Background(kind, (groups[0],), None)
        return background, caption[: match.start()] + " " + caption[match.end() :]
    raise ValueError(f"caption states no background: {caption!r}")


def parse_caption(caption: str) -> ParsedCaption:
    """Recover the stated scene attributes from any caption ``describe`` writes.

    Raises ValueError when the caption has no background, no objects, objects
    in a shared cell, a wrong object count, or words this grammar does not know.
    """
    text = " ".join(caption.lower().split())
    background, rest = _parse_background(text)
    objects = tuple(
        ShapeObject(shape=m[3], colour=m[2], size=m[1], cell=_LOCATION_PHRASES[m[4]])
        for m in _OBJECT_RE.finditer(rest)
    )
    rest = _OBJECT_RE.sub(" ", rest)
    if not objects:
        raise ValueError(f"caption states no objects: {caption!r}")
    if len({obj.cell for obj in objects}) != len(objects):
        raise ValueError(f"caption puts two objects in one cell: {caption!r}")
    for match in _COUNT_RE.finditer(rest):
        if _COUNT_VALUES[match.group(1)] != len(objects):
            raise ValueError(f"caption says {match.group(1)!r} but states {len(objects)}: {caption!r}")
    rest = _COUNT_RE.sub(" ", rest)
    leftover = [w for w in re.split(r"[\s,.:;]+", rest) if w and w not in _CONNECTIVES]
    if leftover:
        raise ValueError(f"caption has words outside the shapes grammar {leftover}: {caption!r}")
    return ParsedCaption(background, objects)


# ---------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------


def generate_one(seed: int, index: int, world: str = "shapes") -> Sample:
    """Sample ``index`` of the split ``seed``; independent of every other index. Every world draws the
    same scenes and captions; only the rendering differs."""
    rng = np.random.default_rng([seed, index])
    scene = sample_scene(rng)
    return Sample(caption=describe(scene, rng), image=render(scene, rendering_of(world)), scene=scene)


def generate(n: int, seed: int, workers: int = 1, world: str = "shapes") -> list[Sample]:
    """The first ``n`` samples of split ``seed``; shards may be made in any order.

    ``workers`` > 1 renders in that many processes (the same samples: each index has its own seed),
    which keeps a GPU fed when a target trains on hundreds of thousands of scenes.
    """
    if workers <= 1:
        return [generate_one(seed, i, world) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.starmap(generate_one, ((seed, i, world) for i in range(n)), chunksize=512)
