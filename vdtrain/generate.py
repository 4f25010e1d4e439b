"""``python -m vdtrain.generate``: sample images from a target and record what happened.

Writes ``{index:04d}.png`` per prompt, ``grid.png``, and ``stats.json`` with, per sample, the prompt,
its seed, the generated token ids, timings and (where the target defines one) a quality score.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.images import captioned_grid, save_png
from vdtrain.prompts import read_captions, shapes_heldout_captions
from vdtrain.quality import quality_scorer
from vdtrain.shapes.build import tensor_to_images
from vdtrain.targets import Target, load_target

log = logging.getLogger(__name__)

METHODS = {"ar": generate_ar}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sampling_config(target: Target, overrides: DictConfig | dict) -> SamplingConfig:
    given = {k: v for k, v in dict(overrides).items() if v is not None}
    return replace(target.sampling_defaults, **given)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg: DictConfig) -> dict:
    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r}; available: {sorted(METHODS)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    target = load_target(OmegaConf.to_container(cfg.target), device)
    sampling = sampling_config(target, cfg.sampling)
    prompts = read_captions(cfg.prompts) if cfg.prompts else shapes_heldout_captions(cfg.num_prompts)
    prompts = prompts[: cfg.num_prompts]
    scorer = quality_scorer(cfg.target.get("quality"))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("%s on %s: %d prompts, %s", cfg.method, device, len(prompts), sampling)

    samples, images_all = [], []
    for start in tqdm(range(0, len(prompts), cfg.batch_size), desc=cfg.method):
        batch = prompts[start : start + cfg.batch_size]
        seeds = [cfg.seed + start + i for i in range(len(batch))]
        generators = [torch.Generator(device).manual_seed(s) for s in seeds]
        cond = target.encode_captions(batch)
        _sync(device)
        t0 = time.perf_counter()
        tokens = METHODS[cfg.method](target, cond, sampling, generators)
        _sync(device)
        t1 = time.perf_counter()
        images = tensor_to_images(target.tokenizer.decode(tokens))
        _sync(device)
        t2 = time.perf_counter()
        for i, (prompt, seed) in enumerate(zip(batch, seeds, strict=True)):
            index = start + i
            save_png(images[i], out / f"{index:04d}.png")
            record = {
                "index": index,
                "prompt": prompt,
                "seed": seed,
                "tokens": tokens[i].tolist(),
                "batch_size": len(batch),
                "batch_latency_s": t1 - t0,
                "batch_latency_with_vq_decode_s": t2 - t0,
            }
            if scorer is not None:
                record["quality"] = scorer(images[i], prompt)
            samples.append(record)
        images_all.extend(images)

    summary = {
        "method": cfg.method,
        "target": asdict(target.identity),
        "sampling": asdict(sampling),
        "device": str(device),
        "num_samples": len(samples),
        "mean_latency_per_image_s": sum(s["batch_latency_s"] / s["batch_size"] for s in samples)
        / len(samples),
    }
    if scorer is not None:
        summary["mean_quality"] = sum(s["quality"] for s in samples) / len(samples)
    (out / "stats.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1) + "\n")
    if cfg.save_grid:
        captioned_grid(images_all, prompts).save(out / "grid.png")
    log.info("wrote %d images and stats.json to %s", len(samples), out)
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    summary = run(cfg)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
