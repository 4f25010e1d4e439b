"""How good is the shapes target? Caption-consistency of its samples at several CFG scales.

Compared with two references on the same held-out captions: random image tokens (the floor) and the
VQ reconstructions of the ground-truth images (the ceiling the tokenizer allows). A teacher-forced probe
(``caption_sensitivity``) shows which caption attributes the target reads at all.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.images import captioned_grid, images_to_tensor, tensor_to_images
from vdtrain.shapes.build import token_nll
from vdtrain.shapes.consistency import score_image
from vdtrain.shapes.scene import (
    CELLS,
    COLOURS,
    HELDOUT_SEED,
    SHAPES,
    SIZES,
    Scene,
    describe,
    generate,
    object_colours_for,
)
from vdtrain.targets.base import Target


def _score(images: np.ndarray, captions: list[str]) -> dict[str, float]:
    """Mean caption consistency, and the pass rate of each kind of check (background kind / colour,
    object colour / shape / size) so that a chance pass on one kind is visible."""
    results = [score_image(img, cap) for img, cap in zip(images, captions, strict=True)]
    kinds: dict[str, list[bool]] = {}
    for r in results:
        for name, ok in r.checks.items():
            kinds.setdefault(name.split(".", 1)[1] if name.startswith("object") else name, []).append(ok)
    return {
        "score": float(np.mean([r.score for r in results])),
        **{k: float(np.mean(v)) for k, v in kinds.items()},
    }


@torch.no_grad()
def sample_images(
    target: Target, captions: list[str], sampling: SamplingConfig, seed: int, batch_size: int
) -> np.ndarray:
    images = []
    for start in tqdm(range(0, len(captions), batch_size), desc=f"cfg {sampling.cfg_scale}", leave=False):
        batch = captions[start : start + batch_size]
        gens = [torch.Generator().manual_seed(seed + start + i) for i in range(len(batch))]
        tokens = generate_ar(target, target.encode_captions(batch), sampling, gens)
        images.append(tensor_to_images(target.tokenizer.decode(tokens)))
    return np.concatenate(images)


@torch.no_grad()
def consistency_report(
    target: Target,
    n_captions: int = 64,
    cfg_scales: tuple[float, ...] = (1.0, 3.0, 4.0),
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 16,
    top_k: int | None = None,
) -> tuple[dict[str, dict[str, float]], dict[float, np.ndarray], list[str]]:
    samples = generate(n_captions, HELDOUT_SEED, world=target.world or "shapes")
    captions = [s.caption for s in samples]
    truth = images_to_tensor([s.image for s in samples])
    gen = torch.Generator().manual_seed(seed)
    random_tokens = torch.randint(target.vocab_size, (n_captions, target.num_image_tokens), generator=gen)
    scores = {
        "ground_truth": _score(np.stack([s.image for s in samples]), captions),
        "vq_reconstruction": _score(
            tensor_to_images(target.tokenizer.decode(target.tokenizer.encode(truth))), captions
        ),
        "random_tokens": _score(tensor_to_images(target.tokenizer.decode(random_tokens)), captions),
    }
    images = {}
    base = replace(target.sampling_defaults, temperature=temperature)
    if top_k is not None:
        base = replace(base, top_k=top_k)
    for scale in cfg_scales:
        images[scale] = sample_images(target, captions, replace(base, cfg_scale=scale), seed, batch_size)
        scores[f"cfg_{scale:g}"] = _score(images[scale], captions)
    return scores, images, captions


def sample_grid(images: np.ndarray, captions: list[str], n: int = 16, columns: int = 4):
    return captioned_grid(list(images[:n]), captions[:n], columns=columns, scale=3)


# The attribute of a one-object scene that each caption edit changes (see edit_scene).
CAPTION_EDITS = ("background colour", "object cell", "object colour", "object shape", "object size")


def edit_scene(scene: Scene, edit: str, rng: np.random.Generator) -> Scene:
    """``scene`` (one object) with one attribute changed to another legal value, all else equal."""
    obj = scene.objects[0]
    if edit == "background colour":
        rest = scene.background.colours[1:]
        options = [
            c for c in COLOURS
            if c not in scene.background.colours
            and obj.colour in object_colours_for(replace(scene.background, colours=(c, *rest)))
        ]  # fmt: skip
        return replace(scene, background=replace(scene.background, colours=(str(rng.choice(options)), *rest)))
    field, values = {
        "object cell": ("cell", CELLS),
        "object colour": ("colour", object_colours_for(scene.background)),
        "object shape": ("shape", SHAPES),
        "object size": ("size", tuple(SIZES)),
    }[edit]
    options = [v for v in values if v != getattr(obj, field)]
    return replace(scene, objects=(replace(obj, **{field: str(rng.choice(options))}),))


@torch.no_grad()
def caption_sensitivity(
    target: Target, n_scenes: int = 96, seed: int = 0, batch_size: int = 32
) -> dict[str, dict[str, float]]:
    """How much the target's likelihood of a held-out image drops when its caption is edited.

    Sampled images only show what the target binds after many noisy draws; this teacher-forced probe
    shows it directly. For one-object held-out scenes, each edit changes one attribute of the caption
    (same phrasing otherwise) and reports the mean rise in the image's NLL (nats per image) and the
    share of images that the true caption explains better. A target that reads an attribute from its
    caption pays many nats for each wrong one; one that ignores it pays nothing.
    """
    held_out = generate(8 * n_scenes, HELDOUT_SEED, world=target.world or "shapes")
    samples = [s for s in held_out if len(s.scene.objects) == 1][:n_scenes]
    if len(samples) < n_scenes:
        raise ValueError(f"only {len(samples)} one-object held-out scenes among the first {8 * n_scenes}")
    scenes = [s.scene for s in samples]
    tokens = target.tokenizer.encode(images_to_tensor([s.image for s in samples])).flatten(1)
    rng = np.random.default_rng(seed)

    def image_nll(edited: list[Scene]) -> torch.Tensor:
        # One phrasing seed per scene, shared by the true and the edited caption.
        captions = [describe(s, np.random.default_rng([seed, i])) for i, s in enumerate(edited)]
        parts = []
        for start in range(0, len(captions), batch_size):
            cond = target.encode_captions(captions[start : start + batch_size])
            parts.append(token_nll(target, cond, tokens[start : start + batch_size]).sum(1))
        return torch.cat(parts)

    true_nll = image_nll(scenes)
    result = {}
    for edit in CAPTION_EDITS:
        cost = image_nll([edit_scene(s, edit, rng) for s in scenes]) - true_nll
        preferred = float((cost > 0).float().mean())
        result[edit] = {"nats": float(cost.mean()), "true_caption_preferred": preferred}
    return result
