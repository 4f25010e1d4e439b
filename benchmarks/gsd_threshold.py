"""Calibrate GSD's ``max_distance`` for a target: SJD vs GSD at several thresholds, side by side.

    python -m benchmarks.gsd_threshold                                  # shipped shapes target, T = 1
    python -m benchmarks.gsd_threshold --distances 0.5 1.5 2 3 --prompts 100 --device cuda

The preset's 0.5 (squared L2 between target input embeddings) comes from the published code's
embeddings; another target spreads its embeddings differently. This prints the quantiles of each
token's nearest-neighbour distance (how many tokens a threshold can group at all), then S, grouped
(relaxed) acceptances per image and consistency for SJD and for GSD at each threshold.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from vdtrain.decode.methods import load_preset
from vdtrain.eval.runner import evaluate
from vdtrain.eval.table import to_markdown
from vdtrain.prompts import prompts_for_run
from vdtrain.targets import load_target_folder

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def nearest_neighbour_distances(embeddings: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 distance to its closest other row."""
    dist = torch.cdist(embeddings.float(), embeddings.float()).pow(2)
    return dist.fill_diagonal_(float("inf")).min(1).values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=None, help="target folder (default: the shipped shapes target)")
    parser.add_argument("--distances", nargs="+", type=float, default=[0.5, 1.4, 1.6, 2.0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target_folder(args.target, torch.device(args.device))
    nearest = nearest_neighbour_distances(target.token_embedding.weight).cpu()
    levels = torch.quantile(nearest, torch.tensor(QUANTILES))
    print("nearest-neighbour squared distance, quantiles:")
    print("  " + ", ".join(f"{q:.0%}: {v:.3f}" for q, v in zip(QUANTILES, levels.tolist(), strict=True)))
    gsd = load_preset("gsd")
    methods = ["sjd"] + [
        replace(gsd, name=f"gsd_{d:g}", acceptance=replace(gsd.acceptance, max_distance=d))
        for d in args.distances
    ]
    for d in args.distances:
        share = (nearest < d).float().mean()
        print(f"  max_distance {d:g}: {share:.0%} of tokens have a neighbour within it")
    prompts = prompts_for_run(None, args.prompts)
    result = evaluate(target, None, prompts, methods, [args.temperature], batch_size=args.batch_size)
    print(to_markdown(result.rows))


if __name__ == "__main__":
    main()
