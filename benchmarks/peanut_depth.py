"""PEANUT's adapted tree depth on easy (flat) versus hard (textured) image regions.

    python -m benchmarks.peanut_depth --prompts 100

Decodes held-out shapes captions with the ``peanut`` preset and reports the mean drafted tree depth
d̄ and the mean accepted length per step, grouped two ways:

- by prompt: the caption's background, flat (large uniform regions) against stripes, gradients, noise;
- by image region: each step by the patch of the generated image under its root token (the 4×4 pixels
  that token decodes to), flat when the patch's mean absolute deviation from its mean colour is below
  ``--flat-threshold`` (0-255 scale), textured otherwise.

EAGLE-2 drafts a fixed shape, so its depth is the same for every group.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import torch

from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.metrics import position_maps
from vdtrain.drafters.base import Drafter
from vdtrain.eval.runner import decode_prompts, vq_decode
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.shapes.scene import parse_caption
from vdtrain.targets import load_target_folder
from vdtrain.targets.shapes import resolve_folder


def flat_patches(images: np.ndarray, grid: tuple[int, int], threshold: float) -> np.ndarray:
    """[N, h*w] bool: the pixel patch under each token is (nearly) one colour."""
    n, height, width, _ = images.shape
    h, w = grid
    patches = images.reshape(n, h, height // h, w, width // w, 3).transpose(0, 1, 3, 2, 4, 5).astype(float)
    patches = patches.reshape(n, h * w, -1, 3)
    deviation = np.abs(patches - patches.mean(axis=2, keepdims=True)).mean(axis=(2, 3))
    return deviation < threshold


def depth_by_region(stats, images: np.ndarray, grid: tuple[int, int], threshold: float) -> dict[str, float]:
    """Mean tree depth and accepted drafts of the steps rooted on flat vs textured patches."""
    flat = flat_patches(images, grid, threshold)
    groups: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for i, s in enumerate(stats):
        for (root, accepted), depth in zip(s.accept_map, s.depth_per_step, strict=True):
            groups[bool(flat[i, root])].append((depth, accepted))
    out = {}
    for is_flat, name in ((True, "flat"), (False, "textured")):
        steps = np.array(groups[is_flat], dtype=float).reshape(-1, 2)
        out[f"steps_on_{name}_patches"] = len(steps)
        out[f"mean_depth_{name}_patches"] = float(steps[:, 0].mean()) if len(steps) else float("nan")
        out[f"accepted_per_step_{name}_patches"] = float(steps[:, 1].mean()) if len(steps) else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=["peanut", "eagle2"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--drafter", default="checkpoints/shapes/drafter")
    parser.add_argument("--flat-threshold", type=float, default=6.0)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_target_folder()
    drafter = Drafter.from_pretrained(resolve_folder(args.drafter), target)
    prompts = shapes_heldout_captions(args.prompts)
    flat = np.array([parse_caption(p).background.kind == "flat" for p in prompts])
    sampling = replace(target.sampling_defaults, temperature=args.temperature)
    results = {}
    for name in args.methods:
        method = build_method(load_preset(name), target, drafter, sampling)
        decoded = decode_prompts(method, target, prompts, 0, args.batch_size)
        stats = decoded.stats
        images, _ = vq_decode(target, decoded.tokens, args.batch_size)
        region = depth_by_region(stats, images, target.grid, args.flat_threshold)
        depth = np.array([s.mean_depth for s in stats])
        accepted = np.array([np.mean(s.committed_per_step) - 1 for s in stats])
        rows = np.nanmean(
            np.stack([position_maps([s], target.grid)["tree_depth"] for s in stats]), axis=(0, 2)
        )
        results[name] = {
            "mean_depth_flat": float(depth[flat].mean()),
            "mean_depth_textured": float(depth[~flat].mean()),
            "accepted_per_step_flat": float(accepted[flat].mean()),
            "accepted_per_step_textured": float(accepted[~flat].mean()),
            "mean_depth_by_image_row": [round(float(r), 2) for r in rows],
            "prompts_flat": int(flat.sum()),
            "prompts_textured": int((~flat).sum()),
            **region,
        }
        print(json.dumps({name: results[name]}))


if __name__ == "__main__":
    main()
