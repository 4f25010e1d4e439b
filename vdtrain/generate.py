"""``python -m vdtrain.generate``: sample images from a target and record what happened.

Writes ``{index:04d}.png`` per prompt, ``grid.png``, and ``stats.json`` with, per sample, the prompt,
its seed, the generated token ids, timings and (where the target defines one) a quality score. A
prompt the target's metric is not defined for (a COCO caption on the shapes target) gets
``quality: null`` and the reason, as in ``vdtrain.evaluate``; the mean is over the scored samples.

Under ``torchrun`` / ``launch.sh`` every process generates its part of the prompts (``vdtrain.sharding``),
a batch at a time, each finished batch recorded in ``units/``: the same command run again decodes only
the missing batches, and rank 0 writes ``stats.json`` and ``grid.png`` from all of them.
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
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import run_app, sweep_job_folder, user_errors
from vdtrain.config import presets_except
from vdtrain.paths import CONF_DIR
from vdtrain.preflight import check_decoding

if TYPE_CHECKING:
    import numpy as np

    from vdtrain.decode.methods import DecodeConfig
    from vdtrain.decode.sampling import SamplingConfig
    from vdtrain.eval.quality import Scorer
    from vdtrain.sharding import Ranks, UnitStore
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


def run(cfg: DictConfig) -> dict | None:
    """Every rank of a launch generates its part; the main rank returns the summary, the others None."""
    from vdtrain.sharding import decoding_processes

    with decoding_processes(str(cfg.device)) as ranks:
        return run_on(cfg, ranks)


# What decides the samples: a folder of finished units is reused only for the same values.
OUTPUT_SETTINGS = (
    "target",
    "decode",
    "drafter",
    "prompts",
    "num_prompts",
    "caption_column",
    "batch_size",
    "seed",
    "sampling",
)


def command_line(cfg: DictConfig) -> list[str]:
    """The overrides ``cfg`` was composed with: Hydra's record of this run, or the one ``compose`` keeps
    with ``return_hydra_config=True``; none for a configuration made otherwise."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return list(cfg.hydra.overrides.task)
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run_on(cfg: DictConfig, ranks: Ranks) -> dict | None:
    from tqdm import tqdm

    from vdtrain.decode.compiled import prepare_decoding
    from vdtrain.decode.methods import build_method, decode_config
    from vdtrain.decode.metrics import summarize
    from vdtrain.eval.heartbeat import Heartbeat
    from vdtrain.eval.quality import quality_scorer
    from vdtrain.eval.runner import decode_prompts, synchronize
    from vdtrain.images import save_png, tensor_to_images
    from vdtrain.prompts import prompts_for_run
    from vdtrain.sharding import UnitStore, units_of
    from vdtrain.target_settings import decode_keys_given, load_drafter, with_world_knobs
    from vdtrain.targets import target_for_run

    method_cfg = decode_config(with_world_knobs(cfg.decode, cfg.target, decode_keys_given(command_line(cfg))))
    prompts = prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.caption_column)
    target = target_for_run(cfg, apply_dtype=True)
    device = target.token_embedding.weight.device
    sampling = sampling_config(target, cfg.sampling)
    drafter = None
    if method_cfg.needs_drafter:
        if not cfg.drafter:
            raise ValueError(f"method {method_cfg.name!r} needs a drafter: set drafter=<folder>")
        drafter = load_drafter(cfg.drafter, target, cfg.target.get("drafter"))
    elif drafter_given(command_line(cfg)):
        log.warning(
            "drafter=%s is not used: method %s drafts with no drafter (a drafter method: method=eagle2)",
            cfg.drafter,
            method_cfg.name,
        )
    options = prepare_decoding(
        target, drafter, compile=cfg.get("compile", False), cuda_graphs=cfg.get("cuda_graphs", "auto")
    )
    method = build_method(method_cfg, target, drafter, sampling, options)
    scorer = quality_scorer(cfg.target.get("quality"))
    out = Path(ranks.broadcast(str(cfg.out_dir)))  # rank 0's, should a timestamp differ
    store = UnitStore(out / "units")
    store.check_settings(
        {k: OmegaConf.to_container(cfg, resolve=True).get(k) for k in OUTPUT_SETTINGS}, ranks
    )
    mine = ranks.take(units_of(len(prompts), cfg.batch_size))
    log.info("%s on %s: %d prompts (%s: %d), %s", method_cfg.name, device, len(prompts), ranks.describe(),
             sum(b - a for a, b in mine), sampling)  # fmt: skip
    if device.type == "cpu" and method_cfg.name != "ar":
        log.info("%s", CPU_SPEED_NOTE.format(method=method_cfg.name))

    total = sum(b - a for a, b in mine)
    # the bar on a terminal; the heartbeat's line every minute wherever the log goes (a grain decode of 4
    # prompts on a CPU is minutes of one batch)
    bar = tqdm(total=total, desc=method_cfg.name, unit="image", disable=not ranks.is_main)
    with bar, Heartbeat(method_cfg.name, total, bar) as beat:
        for start, stop in mine:
            if store.load(f"{start:06d}") is not None:
                beat.update(stop - start)
                continue
            batch = prompts[start:stop]
            # one batch of the run's planned size (or its short last): prompt i with seed cfg.seed + i
            decoded = decode_prompts(method, target, batch, cfg.seed + start, cfg.batch_size)
            synchronize(device)
            t0 = time.perf_counter()
            images = tensor_to_images(target.tokenizer.decode(decoded.tokens))
            synchronize(device)
            vq_seconds = time.perf_counter() - t0
            samples = []
            for i, (prompt, stats) in enumerate(zip(batch, decoded.stats, strict=True)):
                save_png(images[i], out / f"{start + i:04d}.png")
                record = {
                    "index": start + i,
                    "prompt": prompt,
                    "seed": cfg.seed + start + i,
                    "tokens": decoded.tokens[i].tolist(),
                    "batch_size": len(batch),
                    "batch_latency_s": decoded.seconds,
                    "batch_latency_with_vq_decode_s": decoded.seconds + vq_seconds,
                    **summarize([stats], target.num_image_tokens),
                    "committed_per_step": stats.committed_per_step,
                    "committed_per_skip": stats.committed_per_skip,
                }
                if scorer is not None:
                    record.update(quality_record(scorer, images[i], prompt))
                samples.append(record)
            # written last: the images of a unit without its record are redone
            store.save(f"{start:06d}", {"samples": samples, "stats": decoded.stats, "rank": ranks.rank})
            beat.update(len(batch))
    ranks.barrier()
    if not ranks.is_main:
        return None
    return write_stats(
        cfg,
        out,
        store,
        units_of(len(prompts), cfg.batch_size),
        ranks=ranks,
        target=target,
        sampling=sampling,
        method=method_cfg,
        has_drafter=drafter is not None,
        cuda_graphs=options.step_recorder is not None,
    )


def write_stats(
    cfg: DictConfig,
    out: Path,
    store: UnitStore,
    units: list[tuple[int, int]],
    *,
    ranks: Ranks,
    target: Target,
    sampling: SamplingConfig,
    method: DecodeConfig,
    has_drafter: bool,
    cuda_graphs: bool,
) -> dict:
    """``stats.json`` (and ``grid.png``) from every finished unit, in prompt order."""
    import numpy as np
    from PIL import Image

    from vdtrain.decode.metrics import summarize
    from vdtrain.images import captioned_grid
    from vdtrain.targets.shapes import resolve_folder

    records = [store.load(f"{start:06d}") for start, _ in units]
    missing = [start for (start, _), r in zip(units, records, strict=True) if r is None]
    if missing:
        raise RuntimeError(f"units from prompts {missing[:5]} are missing from {store.folder}")
    samples = [s for r in records for s in r["samples"]]
    busy: dict[int, float] = {}
    for r in records:
        busy[r["rank"]] = busy.get(r["rank"], 0.0) + r["samples"][0]["batch_latency_with_vq_decode_s"]
    summary = {
        "method": method.name,
        "decode": dataclasses.asdict(method),  # every key, its config class's defaults included
        "drafter": str(resolve_folder(cfg.drafter)) if has_drafter else None,
        "target": asdict(target.identity),
        "sampling": asdict(sampling),
        "device": str(target.token_embedding.weight.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "compile": bool(cfg.get("compile", False)),
        "cuda_graphs": cuda_graphs,
        "num_samples": len(samples),
        "world_size": ranks.world,
        "mean_latency_per_image_s": sum(s["batch_latency_s"] / s["batch_size"] for s in samples)
        / len(samples),
        # all processes together: the images over the busiest process's seconds (VQ decode included)
        "images_per_second": len(samples) / max(busy.values()),
        **summarize([st for r in records for st in r["stats"]], target.num_image_tokens),
    }
    if any("quality" in s for s in samples):
        summary.update(quality_summary(samples))
    (out / "stats.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1) + "\n")
    if cfg.save_grid:
        images = [np.asarray(Image.open(out / f"{s['index']:04d}.png").convert("RGB")) for s in samples]
        captioned_grid(images, [s["prompt"] for s in samples]).save(out / "grid.png")
    log.info("wrote %d images and stats.json to %s", len(samples), out)
    return summary


def _kept(cfg: DictConfig) -> str:
    return f"the finished batches are kept in {cfg.out_dir}/units: the same command goes on from them"


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="generate")
@sweep_job_folder("out_dir")
@user_errors("vdtrain.generate", _kept)
def _main(cfg: DictConfig) -> None:
    summary = run(cfg)
    if summary is not None:  # the main rank
        print(json.dumps(summary, indent=2))


def drafter_given(overrides: list[str]) -> bool:
    """The command line names a drafter (not the target's default one)."""
    return any(o.lstrip("+").split("=", 1)[0] == "drafter" for o in overrides)


def method_alias(argv: list[str]) -> list[str]:
    """``method=<name>`` is accepted as a spelling of the Hydra group override ``decode=<name>``."""
    return [f"decode={a.split('=', 1)[1]}" if a.startswith("method=") else a for a in argv]


def without_method(args: list[str]) -> list[str]:
    """The overrides composed for the cheap checks: the method's (``decode=``, ``decode.<key>=``) need its
    parts' config classes, which live beside their torch code, so they are left out (``~decode``) and
    composed after the checks; a preset that does not exist is refused here."""
    chosen = [a.split("=", 1)[1] for a in args if a.startswith("decode=")]
    unknown = [name for name in chosen if name not in presets_except()]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r} (method=); known: {', '.join(presets_except())}")
    return [a for a in args if not a.lstrip("~+").startswith(("decode=", "decode."))] + ["~decode"]


def _register_decode_parts() -> None:
    """conf/decode presets pull their parts' config classes in by their defaults lists: they must be in
    Hydra's ConfigStore before ``conf/generate.yaml`` is composed with a method (a script composing it
    calls ``register_part_schemas`` first, as the tests' conftest does)."""
    from vdtrain.decode.methods import register_part_schemas

    register_part_schemas()


def main() -> None:
    sys.argv = [sys.argv[0], *method_alias(sys.argv[1:])]
    run_app(
        "vdtrain.generate",
        "generate",
        _main,
        check_decoding,
        light=without_method,
        prepare=_register_decode_parts,
    )


if __name__ == "__main__":
    main()
