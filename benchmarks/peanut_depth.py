"""PEANUT's adapted tree depth on easy (flat) versus hard (textured) image regions.

    python -m benchmarks.peanut_depth --prompts 100

Decodes held-out shapes captions with the ``peanut`` preset and reports the mean drafted tree depth
d̄ and the mean accepted length per step, grouped by the caption's background: flat backgrounds
(large uniform regions) against stripes, gradients and noise. EAGLE-2 drafts a fixed shape, so its
depth is the same for both groups.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import torch

from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.metrics import position_maps
from vdtrain.drafter import Drafter
from vdtrain.eval.runner import decode_prompts
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.shapes.scene import parse_caption
from vdtrain.targets import load_target_folder
from vdtrain.targets.shapes import resolve_folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=["peanut", "eagle2"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--drafter", default="checkpoints/shapes/drafter")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_target_folder()
    drafter = Drafter.load(resolve_folder(args.drafter), target)
    prompts = shapes_heldout_captions(args.prompts)
    flat = np.array([parse_caption(p).background.kind == "flat" for p in prompts])
    sampling = replace(target.sampling_defaults, temperature=args.temperature)
    results = {}
    for name in args.methods:
        method = build_method(load_preset(name), target, drafter, sampling)
        stats = decode_prompts(method, target, prompts, 0, args.batch_size).stats
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
        }
        print(json.dumps({name: results[name]}))


if __name__ == "__main__":
    main()
