"""Images per second of ``data_prep.self_generate`` with AR and with exact methods, side by side.

    python -m benchmarks.self_generate_speed                      # shipped shapes target, eagle2, CPU
    python -m benchmarks.self_generate_speed --methods eagle1 eagle2 --samples 64 --device cuda

Each method writes the same captions' shard set with the same seeds, in turns (AR, each method, AR,
...; ``--repeats`` rounds), so the machine's load falls on all of them alike; the median per method is
printed. Exact methods draw from the target's distribution, so this is what they gain on training data.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vdtrain.data.prepare import prepare_self_generate
from vdtrain.decode.compiled import prepare_decoding
from vdtrain.decode.methods import load_preset
from vdtrain.drafters.base import Drafter
from vdtrain.eval.runner import device_description
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import load_target_folder
from vdtrain.targets.shapes import resolve_folder


def images_per_second(target, captions, method, drafter, batch_size: int, folder: Path) -> float:
    config = None if method == "ar" else load_preset(method)
    options = None if config is None else prepare_decoding(target, drafter, compile=False)
    start = time.perf_counter()
    prepare_self_generate(target, captions, folder, batch_size=batch_size, method=config,
                          drafter=drafter, options=options, progress=False, overwrite=True)  # fmt: skip
    return len(captions) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="checkpoints/shapes/target")
    parser.add_argument("--drafter", default="checkpoints/shapes/drafter")
    parser.add_argument("--methods", nargs="+", default=["eagle2"], help="exact presets of conf/decode")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    target = load_target_folder(args.target, args.device).eval()
    drafter = Drafter.from_pretrained(resolve_folder(args.drafter), target).to(args.device).eval()
    captions = shapes_heldout_captions(args.samples)
    rates: dict[str, list[float]] = {m: [] for m in ["ar", *args.methods]}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for _ in range(args.repeats):
            for method in rates:
                rate = images_per_second(
                    target, captions, method, drafter, args.batch_size, Path(tmp) / method
                )
                rates[method].append(rate)
    ar = statistics.median(rates["ar"])
    where = device_description(torch.device(args.device))
    print(f"{args.samples} shapes captions, batch {args.batch_size}, {where}")
    print(f"| method | images/s (median of {args.repeats}) | vs AR |\n|---|---|---|")
    for method, values in rates.items():
        print(f"| {method} | {statistics.median(values):.2f} | {statistics.median(values) / ar:.2f}× |")


if __name__ == "__main__":
    main()
