"""How sure each embedded target is of its next token: top-1 quantiles, the share below 0.2, entropy.

python -m benchmarks.regime                                  # shapes and grain, 16 held-out captions, T = 1
python -m benchmarks.regime --targets checkpoints/grain/target --captions 32 --out regime.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vdtrain.eval.regime import QUANTILES, token_confidence
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets.shapes import load_target_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--targets", nargs="+", default=["checkpoints/shapes/target", "checkpoints/grain/target"]
    )
    parser.add_argument("--captions", type=int, default=16, help="held-out captions")
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    captions = shapes_heldout_captions(args.captions)
    results = {}
    header = " / ".join(f"{q:.0%}" for q in QUANTILES)
    print(f"| target | stream | top-1 quantiles {header} | top-1 < 0.2 | entropy |")
    print("|---|---|---|---|---|")
    for folder in args.targets:
        target = load_target_folder(folder)
        results[folder] = token_confidence(target, captions, args.seed, temperature=args.temperature)
        for stream in ("conditional", "after_cfg"):
            r = results[folder][stream]
            quantiles = " / ".join(f"{v:.3g}" for v in r["top1_quantiles"].values())
            print(
                f"| {target.name} | {stream} | {quantiles} | {r['share_top1_below_0.2']:.0%} "
                f"| {r['mean_entropy_nats']:.2f} nats |"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
