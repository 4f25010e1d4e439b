"""Speculative decoding vs AR, side by side: same prompts, seeds, process and device.

    python benchmarks/decode.py                                   # shipped shapes target + drafter, CPU
    python benchmarks/decode.py --target grain --methods eagle2 lantern   # the grain world, its own knobs
    python benchmarks/decode.py --prompts 100 --methods eagle1 eagle2 --temperatures 0 1
    python benchmarks/decode.py --device cuda --batch-size 1 --out docs/decode_benchmark.json

A command-line wrapper over ``vdtrain.eval.runner.evaluate`` (``python -m vdtrain.evaluate`` is the
full app: prompt sets, quality metrics, plots, images). For each temperature it decodes every prompt
with AR, then with each method, and prints S, τ, d̄, TPF, caption consistency (shapes captions) and the
latency speedup (AR time / method time, without and with the VQ decode that both pay). At T = 0 it
runs the exact methods only and checks that each reproduced AR's tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vdtrain.eval.runner import device_description, evaluate
from vdtrain.eval.table import to_json, to_markdown
from vdtrain.paths import CONF_DIR
from vdtrain.prompts import prompts_for_run
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target",
        default="shapes",
        help="a conf/target name (its knobs and drafter apply) or a target folder",
    )
    parser.add_argument(
        "--drafter", default=None, help="drafter folder, .ckpt or Hub id (default: the target config's)"
    )
    parser.add_argument("--methods", nargs="+", default=["eagle1", "eagle2"], help="presets in conf/decode")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=100, help="number of prompts")
    parser.add_argument(
        "--prompt-file", default=None, help="caption file or vendored set instead of shapes captions"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    is_config = (CONF_DIR / "target" / f"{args.target}.yaml").is_file()
    config = target_config(args.target) if is_config else {"kind": "folder", "folder": args.target}
    target = load_target(config, torch.device(args.device))
    drafter = args.drafter or config.get("drafter")
    if drafter is None:
        parser.error(f"--target {args.target} names no drafter of its own: give --drafter")
    result = evaluate(
        target,
        load_drafter(drafter, target, config.get("drafter")),  # drafter-free methods (SJD, GSD) ignore it
        prompts_for_run(args.prompt_file, args.prompts),
        args.methods,
        args.temperatures,
        seed=args.seed,
        batch_size=args.batch_size,
        decode_overrides=world_knobs(config),
    )
    device = target.token_embedding.weight.device
    print(f"\n{len(result.prompts)} prompts, batch {args.batch_size}, {device_description(device)}, ", end="")
    print(f"cfg {target.sampling_defaults.cfg_scale}\n")
    print(to_markdown(result.rows))
    if args.out:
        settings = {
            "command": " ".join(["python benchmarks/decode.py", *sys.argv[1:]]),
            **{k: v for k, v in vars(args).items() if k != "out"},
            "device": device_description(device),
        }
        Path(args.out).write_text(to_json(result.rows, settings))


if __name__ == "__main__":
    main()
