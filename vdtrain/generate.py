"""``python -m vdtrain.generate``: sample images from a target and record what happened.

Writes ``{index:04d}.png`` per prompt, ``grid.png``, and ``stats.json`` with, per sample, the prompt,
its seed, the generated token ids, timings and (where the target defines one) a quality score. A
prompt the target's metric is not defined for (a COCO caption on the shapes target) gets
``quality: null`` and the reason, as in ``vdtrain.evaluate``; the mean is over the scored samples.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from vdtrain.cli import run_app, user_errors
from vdtrain.preflight import check_decoding

if TYPE_CHECKING:
    import numpy as np

    from vdtrain.decode.sampling import SamplingConfig
    from vdtrain.eval.quality import Scorer
    from vdtrain.targets import Target

log = logging.getLogger(__name__)
# Why a speculative method can be slower than AR here (README.md and docs/decoding.md say the same).
CPU_SPEED_NOTE = (
    "on a CPU: {method}'s S (image tokens per target step, in stats.json) is the gain a GPU step would see; "
    "the wall-clock here can be slower than AR's, because a CPU's target step costs in proportion to the "
    "tokens it verifies and the drafter's passes add to it, where a GPU's step costs about the same for one "
    "token or many"
)


def sampling_config(target: Target, overrides: DictConfig | dict) -> SamplingConfig:
    given = {k: v for k, v in dict(overrides).items() if v is not None}
    return replace(target.sampling_defaults, **given)


def quality_record(scorer: Scorer, image: np.ndarray, prompt: str) -> dict:
    """``{"quality": score}``, or ``{"quality": None, "quality_unavailable": why}`` when the metric is not
    defined for this prompt."""
    from vdtrain.eval.quality import Unavailable

    try:
        return {"quality": scorer(image, prompt)}
    except Unavailable as why:
        return {"quality": None, "quality_unavailable": str(why)}


def quality_summary(samples: list[dict]) -> dict:
    """The mean over the samples that could be scored, and how many that was."""
    scored = [s["quality"] for s in samples if s["quality"] is not None]
    summary: dict = {"mean_quality": sum(scored) / len(scored) if scored else None, "num_scored": len(scored)}
    if len(scored) < len(samples):
        reasons = sorted({s["quality_unavailable"] for s in samples if s["quality"] is None})
        summary["quality_unavailable"] = "; ".join(reasons)
    return summary


def run(cfg: DictConfig) -> dict:
    import torch
    from tqdm import tqdm

    from vdtrain.decode.compiled import prepare_decoding
    from vdtrain.decode.methods import build_method, decode_config
    from vdtrain.decode.metrics import summarize
    from vdtrain.drafter import Drafter
    from vdtrain.eval.quality import quality_scorer
    from vdtrain.eval.runner import synchronize
    from vdtrain.images import captioned_grid, save_png, tensor_to_images
    from vdtrain.prompts import prompts_for_run
    from vdtrain.targets import target_for_run
    from vdtrain.targets.shapes import resolve_folder

    method_cfg = decode_config(cfg.decode)
    prompts = prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.caption_column)
    target = target_for_run(cfg, apply_dtype=True)
    device = target.token_embedding.weight.device
    sampling = sampling_config(target, cfg.sampling)
    drafter = None
    if method_cfg.needs_drafter:
        if not cfg.drafter:
            raise ValueError(f"method {method_cfg.name!r} needs a drafter: set drafter=<folder>")
        drafter = Drafter.from_pretrained(resolve_folder(cfg.drafter), target)
    options = prepare_decoding(
        target, drafter, compile=cfg.get("compile", False), cuda_graphs=cfg.get("cuda_graphs", "auto")
    )
    method = build_method(method_cfg, target, drafter, sampling, options)
    scorer = quality_scorer(cfg.target.get("quality"))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("%s on %s: %d prompts, %s", method_cfg.name, device, len(prompts), sampling)
    if device.type == "cpu" and method_cfg.name != "ar":
        log.info("%s", CPU_SPEED_NOTE.format(method=method_cfg.name))

    samples, images_all, all_stats = [], [], []
    bar = tqdm(total=len(prompts), desc=method_cfg.name, unit="image")
    for start in range(0, len(prompts), cfg.batch_size):
        batch = prompts[start : start + cfg.batch_size]
        seeds = [cfg.seed + start + i for i in range(len(batch))]
        generators = [torch.Generator(device).manual_seed(s) for s in seeds]
        cond = target.encode_captions(batch)
        synchronize(device)
        t0 = time.perf_counter()
        result = method.generate(cond, generators, planned_batch=cfg.batch_size)
        tokens = result.tokens
        synchronize(device)
        t1 = time.perf_counter()
        images = tensor_to_images(target.tokenizer.decode(tokens))
        synchronize(device)
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
                **summarize([result.stats[i]], target.num_image_tokens),
                "committed_per_step": result.stats[i].committed_per_step,
                "committed_per_skip": result.stats[i].committed_per_skip,
            }
            if scorer is not None:
                record.update(quality_record(scorer, images[i], prompt))
            samples.append(record)
        images_all.extend(images)
        all_stats.extend(result.stats)
        bar.update(len(batch))
    bar.close()

    summary = {
        "method": method_cfg.name,
        "decode": dataclasses.asdict(method_cfg),  # every key, its config class's defaults included
        "drafter": str(resolve_folder(cfg.drafter)) if drafter is not None else None,
        "target": asdict(target.identity),
        "sampling": asdict(sampling),
        "device": str(device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "compile": bool(cfg.get("compile", False)),
        "cuda_graphs": options.step_recorder is not None,
        "num_samples": len(samples),
        "mean_latency_per_image_s": sum(s["batch_latency_s"] / s["batch_size"] for s in samples)
        / len(samples),
        **summarize(all_stats, target.num_image_tokens),
    }
    if scorer is not None:
        summary.update(quality_summary(samples))
    (out / "stats.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1) + "\n")
    if cfg.save_grid:
        captioned_grid(images_all, prompts).save(out / "grid.png")
    log.info("wrote %d images and stats.json to %s", len(samples), out)
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="generate")
@user_errors("vdtrain.generate")
def _main(cfg: DictConfig) -> None:
    summary = run(cfg)
    print(json.dumps(summary, indent=2))


def method_alias(argv: list[str]) -> list[str]:
    """``method=<name>`` is accepted as a spelling of the Hydra group override ``decode=<name>``."""
    return [f"decode={a.split('=', 1)[1]}" if a.startswith("method=") else a for a in argv]


def main() -> None:
    sys.argv = [sys.argv[0], *method_alias(sys.argv[1:])]
    run_app("vdtrain.generate", "generate", _main, check_decoding)


if __name__ == "__main__":
    main()
