"""Speculative decoding vs AR, side by side: same prompts, seeds, process and device.

    python benchmarks/decode.py                                   # shipped shapes target + drafter, CPU
    python benchmarks/decode.py --prompts 100 --methods eagle1 eagle2 --temperatures 0 1
    python benchmarks/decode.py --device cuda --batch-size 1 --out docs/decode_benchmark.json

For each temperature it decodes every prompt with AR, then with each method, and prints S, τ, d̄, TPF,
caption consistency (shapes captions) and the latency speedup (AR time / method time, without and with
the VQ decode that both pay). At T = 0 it also checks that every method reproduced AR's tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from vdtrain.decode.methods import DecodeConfig, build_method
from vdtrain.decode.metrics import summarize
from vdtrain.drafter import Drafter
from vdtrain.prompts import read_captions, shapes_heldout_captions
from vdtrain.quality import quality_scorer
from vdtrain.shapes.build import tensor_to_images
from vdtrain.targets import load_target_folder
from vdtrain.targets.shapes import resolve_folder

CONF = Path(__file__).resolve().parents[1] / "conf" / "decode"


def method_config(name: str) -> DecodeConfig:
    node = OmegaConf.merge(OmegaConf.structured(DecodeConfig), OmegaConf.load(CONF / f"{name}.yaml"))
    return OmegaConf.to_object(node)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_method(method, target, prompts, seed, batch_size, device):
    """Tokens, per-prompt stats and decoding seconds (captions are encoded outside the timer)."""
    tokens, stats, seconds = [], [], 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        cond = target.encode_captions(batch)
        gens = [torch.Generator(device).manual_seed(seed + start + i) for i in range(len(batch))]
        sync(device)
        t0 = time.perf_counter()
        result = method.generate(cond, gens)
        sync(device)
        seconds += time.perf_counter() - t0
        tokens.append(result.tokens)
        stats.extend(result.stats)
    return torch.cat(tokens), stats, seconds


def vq_decode(target, tokens, batch_size, device) -> tuple[np.ndarray, float]:
    """Images (uint8) and the seconds the VQ decoder took."""
    images = []
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(tokens), batch_size):
        images.append(target.tokenizer.decode(tokens[start : start + batch_size]))
    sync(device)
    seconds = time.perf_counter() - t0
    return tensor_to_images(torch.cat(images)), seconds


def quality(scorer, images: np.ndarray, prompts: list[str]) -> float | None:
    if scorer is None:
        return None
    return float(np.mean([scorer(img, p) for img, p in zip(images, prompts, strict=True)]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=None, help="target folder (default: the shipped shapes target)")
    parser.add_argument("--drafter", default="checkpoints/shapes/drafter", help="drafter folder")
    parser.add_argument("--methods", nargs="+", default=["eagle1", "eagle2"], help="presets in conf/decode")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=100, help="held-out shapes captions to use")
    parser.add_argument("--prompt-file", default=None, help="caption file instead of shapes captions")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    target = load_target_folder(args.target, device)
    drafter = Drafter.load(resolve_folder(args.drafter), target)
    # Methods without a drafter model (SJD, GSD) simply ignore it.
    prompts = read_captions(args.prompt_file) if args.prompt_file else shapes_heldout_captions(args.prompts)
    prompts = prompts[: args.prompts]
    # Caption consistency is defined for the shapes world's own captions only.
    scorer = None if args.prompt_file else quality_scorer("shapes_consistency")
    n = target.num_image_tokens
    rows = []
    for temperature in args.temperatures:
        sampling = replace(target.sampling_defaults, temperature=temperature)
        ar_tokens, _, ar_s = run_method(
            build_method(method_config("ar"), target, None, sampling),
            target,
            prompts,
            args.seed,
            args.batch_size,
            device,
        )
        ar_images, vq_s = vq_decode(target, ar_tokens, args.batch_size, device)
        ar_quality = quality(scorer, ar_images, prompts)
        for name in args.methods:
            method = build_method(method_config(name), target, drafter, sampling)
            tokens, stats, secs = run_method(method, target, prompts, args.seed, args.batch_size, device)
            images, _ = vq_decode(target, tokens, args.batch_size, device)
            row = {
                "method": name,
                "temperature": temperature,
                **summarize(stats, n),
                "speedup": ar_s / secs,
                "speedup_with_vq_decode": (ar_s + vq_s) / (secs + vq_s),
                "ar_seconds": ar_s,
                "method_seconds": secs,
                "identical_to_ar": bool(torch.equal(tokens, ar_tokens)) if temperature == 0 else None,
                "quality": quality(scorer, images, prompts),
                "ar_quality": ar_quality,
            }
            rows.append(row)
            print(json.dumps(row))
    header = (
        "| method | T | S | τ | d̄ | TPF | latency speedup | with VQ decode | = AR tokens | quality (AR) |"
    )
    cfg_scale = target.sampling_defaults.cfg_scale
    print(f"\n{len(prompts)} prompts, batch {args.batch_size}, {device}, cfg {cfg_scale}\n")
    print(header)
    print("|" + "---|" * 10)
    for r in rows:
        same = {None: "–", True: "yes", False: "NO"}[r["identical_to_ar"]]
        qual = "–" if r["quality"] is None else f"{r['quality']:.3f} ({r['ar_quality']:.3f})"
        print(
            f"| {r['method']} | {r['temperature']:g} | {r['S']:.2f} | {r['tau']:.2f} | {r['mean_depth']:.2f} "
            f"| {r['TPF']:.2f} | {r['speedup']:.2f}× | {r['speedup_with_vq_decode']:.2f}× | {same} | {qual} |"
        )
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        Path(args.out).write_text(json.dumps({"settings": settings, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
