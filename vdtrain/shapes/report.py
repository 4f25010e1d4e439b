"""How good is the shapes target? Caption-consistency of its samples at several CFG scales.

Compared with two references on the same held-out captions: random image tokens (the floor) and the
VQ reconstructions of the ground-truth images (the ceiling the tokenizer allows).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.images import captioned_grid
from vdtrain.shapes.build import images_to_tensor, tensor_to_images
from vdtrain.shapes.consistency import score_image
from vdtrain.shapes.scene import HELDOUT_SEED, generate
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
) -> tuple[dict[str, dict[str, float]], dict[float, np.ndarray], list[str]]:
    samples = generate(n_captions, HELDOUT_SEED)
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
    for scale in cfg_scales:
        images[scale] = sample_images(target, captions, replace(base, cfg_scale=scale), seed, batch_size)
        scores[f"cfg_{scale:g}"] = _score(images[scale], captions)
    return scores, images, captions


def sample_grid(images: np.ndarray, captions: list[str], n: int = 16, columns: int = 4):
    return captioned_grid(list(images[:n]), captions[:n], columns=columns, scale=3)
