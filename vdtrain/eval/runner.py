"""Every method against AR on the same prompts, seeds, process and device: one row per (method, T).

For each temperature, AR decodes the prompts first (the baseline: its time is the speedup's numerator,
its tokens the T = 0 reference), then each method. Only decoding is timed: captions are encoded before
the timer starts, and on a GPU the device is synchronised at both ends. The VQ decode, which AR and every
method pay alike, is timed once per temperature and reported as a second speedup. Prompt ``i`` is always
sampled with seed ``seed + i``, whatever its batch, so rows compare the same samples.

Where a metric compares with AR's images (``frechet_ar``), every row is scored against AR's images at
its temperature, and AR's own row against AR decoded once more, untimed, with seeds ``seed +
FLOOR_SEED_OFFSET + i``: the distance two independent AR draws of the same prompts have, the metric's
noise floor. At T = 0 that second decode is skipped: greedy decoding ignores the seeds.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vdtrain.decode.compiled import DecodeOptions, prepare_decoding
from vdtrain.decode.engine import DecodeStats, SpeculativeEngine
from vdtrain.decode.methods import ARMethod, DecodeConfig, build_method, load_preset
from vdtrain.decode.metrics import position_maps as stats_position_maps
from vdtrain.decode.metrics import summarize
from vdtrain.drafter import Drafter
from vdtrain.durations import duration
from vdtrain.eval.heartbeat import Heartbeat
from vdtrain.eval.papers import projected_speedup
from vdtrain.eval.quality import QualityConfig, QualityScorer
from vdtrain.eval.table import EvalRow
from vdtrain.images import save_png, tensor_to_images
from vdtrain.targets.base import Target

log = logging.getLogger(__name__)

FLOOR_SEED_OFFSET = 10_000  # AR's noise-floor decode: prompt i with seed + FLOOR_SEED_OFFSET + i


@dataclass
class Decoded:
    tokens: torch.Tensor  # [N, h·w]
    stats: list[DecodeStats]
    seconds: float  # decoding only
    batch_seconds: list[float]  # per batch, in order


@dataclass
class EvalResult:
    rows: list[EvalRow]  # one per (method, temperature); "ar" rows included (speedup 1.0)
    position_maps: dict[tuple[str, float], dict[str, np.ndarray]]  # (method, T) -> {name: [h, w]}
    images: dict[tuple[str, float], np.ndarray]  # (method, T) -> uint8 [N, H, W, 3], prompt order
    prompts: list[str]
    # (method, T) -> tokens and per-prompt stats: the acceptance report (vdtrain/eval/acceptance.py)
    # teacher-forces the drafter on AR's tokens and counts accepted lengths step by step
    decoded: dict[tuple[str, float], Decoded] = field(default_factory=dict)


def device_description(device: torch.device) -> str:
    """Where speeds were measured: ``cuda:0 (NVIDIA H200)``, ``cpu (x86_64, 2 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer read afterwards covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_prompts(
    method: ARMethod | SpeculativeEngine,
    target: Target,
    prompts: Sequence[str],
    seed: int,
    batch_size: int,
    progress: tqdm | Heartbeat | None = None,
) -> Decoded:
    """Decode ``prompts`` in batches with ``method`` (prompt ``i`` with seed ``seed + i``); ``progress``
    is told of every batch done."""
    device = target.token_embedding.weight.device
    tokens, stats, seconds = [], [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        cond = target.encode_captions(batch)
        generators = [torch.Generator(device).manual_seed(seed + start + i) for i in range(len(batch))]
        synchronize(device)
        t0 = time.perf_counter()
        result = method.generate(cond, generators, planned_batch=batch_size)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
        tokens.append(result.tokens)
        stats.extend(result.stats)
        if progress is not None:
            progress.update(len(batch))
    return Decoded(torch.cat(tokens), stats, sum(seconds), seconds)


def starts_up(target: Target, options: DecodeOptions) -> bool:
    """Whether a method's first decode of a batch shape does work later ones skip: records its step
    (CUDA graphs) or compiles."""
    return options.starts_up or getattr(target.transformer, "_vdtrain_compiled", False)


def warm_up(
    method: ARMethod | SpeculativeEngine, target: Target, prompts: Sequence[str], seed: int, batch_size: int
) -> Decoded:
    """The method's first, untimed decode: the first batch where the method ``starts_up`` (the timed run
    then replays what it recorded and compiled), else one prompt, so that a GPU's first calls (CUDA
    context, library handles) land on no method's time."""
    if starts_up(target, method.options):
        return decode_prompts(method, target, prompts[:batch_size], seed, batch_size)
    return decode_prompts(method, target, prompts[:1], seed, 1)


def startup_seconds(
    target: Target, options: DecodeOptions, cold: Decoded | None, timed: Decoded
) -> float | None:
    """What the method's first decode of the first batch cost beyond the timed one of the same prompts:
    capture, compilation, warm-up steps. None without a warm-up or where nothing starts up."""
    if cold is None or not starts_up(target, options):
        return None
    return max(0.0, cold.batch_seconds[0] - timed.batch_seconds[0])


def vq_decode(target: Target, tokens: torch.Tensor, batch_size: int) -> tuple[np.ndarray, float]:
    """Images (uint8 [N, H, W, 3]) and the seconds the VQ decoder took."""
    device = target.token_embedding.weight.device
    images = []
    synchronize(device)
    t0 = time.perf_counter()
    for start in range(0, len(tokens), batch_size):
        images.append(target.tokenizer.decode(tokens[start : start + batch_size]))
    synchronize(device)
    seconds = time.perf_counter() - t0
    return tensor_to_images(torch.cat(images)), seconds


def noise_floor_images(
    method: ARMethod,
    temperature: float,
    target: Target,
    prompts: Sequence[str],
    seed: int,
    batch_size: int,
    ar_images: np.ndarray,
) -> np.ndarray:
    """AR's images of the same prompts with seeds ``seed + FLOOR_SEED_OFFSET + i`` (untimed): what
    ``frechet_ar`` of AR's own row compares with. Greedy decoding ignores the seeds, so at T = 0 they
    are AR's images themselves, and no second decode is run."""
    if temperature == 0:
        return ar_images
    decoded = decode_prompts(method, target, prompts, seed + FLOOR_SEED_OFFSET, batch_size)
    return vq_decode(target, decoded.tokens, batch_size)[0]


def method_configs(
    methods: Sequence[str | DecodeConfig], overrides: Mapping[str, Any] | None = None
) -> list[DecodeConfig]:
    """Typed configs for preset names and configs, AR left out (it always runs as the baseline). A name
    gets the target's own knobs for it (``overrides``: ``target.decode``) over its preset."""
    overrides = overrides or {}
    configs = [load_preset(m, overrides.get(m)) if isinstance(m, str) else m for m in methods]
    configs = [c for c in configs if c.tree.kind != "none"]
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"methods named more than once: {repeated} (give each config its own name)")
    return configs


def image_folder(image_dir: str | os.PathLike[str], method: str, temperature: float) -> Path:
    return Path(image_dir) / f"{method}_T{temperature:g}"


def evaluate(
    target: Target,
    drafter: Drafter | None,
    prompts: list[str],
    methods: Sequence[str | DecodeConfig],
    temperatures: Sequence[float],
    *,
    exact_only_at_zero: bool = True,
    seed: int = 0,
    batch_size: int = 8,
    quality: QualityConfig | None = None,
    image_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    warmup: bool = True,
    compile: bool = False,
    cuda_graphs: bool | str | None = "auto",
    ar_runs: dict[float, tuple[Decoded, np.ndarray, float, np.ndarray | None]] | None = None,
    decode_overrides: Mapping[str, Any] | None = None,
) -> EvalResult:
    """Rows, per-position maps and images for AR and every method at every temperature.

    ``methods`` are preset names of ``conf/decode`` or typed configs. At T = 0 with
    ``exact_only_at_zero``, relaxed (lossy) methods are left out: greedy decoding makes them meaningless.
    ``quality`` None scores shapes-world captions by consistency and other prompts by the real-image
    metrics (each "not available" unless configured, see ``QualityConfig``). With ``image_dir``, every
    image is saved as ``<image_dir>/<method>_T<t>/<prompt index:04d>.png``. ``warmup`` first decodes
    untimed with each method (``warm_up``): GPU start-up costs, step capture and compilation stay out of
    the timings, and the row's ``startup_seconds`` says what they cost. ``cuda_graphs`` (``auto``: on a GPU)
    records every method's step, AR's too; ``compile`` wraps the target's and the drafter's forwards in
    ``torch.compile`` (in place, ``vdtrain.decode.compiled.prepare_decoding``). ``ar_runs`` (per
    temperature: AR's decode, images, VQ seconds and noise-floor images or None) is filled on first use
    and reused after: a caller evaluating the same frozen target on the same prompts again
    (``EvalAfterEpoch``) decodes AR, and its noise floor, once.
    ``decode_overrides`` (the target config's ``decode``) sets the target's own knobs of named presets.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate (the prompt set is empty)")
    configs = method_configs(methods, decode_overrides)
    needy = [c.name for c in configs if c.needs_drafter]
    if needy and drafter is None:
        raise ValueError(f"methods {needy} need a drafter; none was given")
    options = prepare_decoding(target, drafter, compile=compile, cuda_graphs=cuda_graphs)
    scorer = QualityScorer(quality, target.token_embedding.weight.device, target.tokenizer)
    wants_floor = scorer.wants_reference(prompts)
    baseline = load_preset("ar")
    runs = [(t, c) for t in temperatures for c in [baseline, *configs]]
    if exact_only_at_zero:
        skipped = sorted({c.name for t, c in runs if t == 0 and not c.exact})
        if skipped:
            log.info("T = 0: leaving out the relaxed methods %s (meaningless under greedy decoding)", skipped)
        runs = [(t, c) for t, c in runs if t != 0 or c.exact]
    result = EvalResult([], {}, {}, list(prompts))
    started = time.monotonic()
    log.info(
        "evaluation: %s at T = %s on %d prompts",
        ", ".join(dict.fromkeys(c.name for _, c in runs)),
        ", ".join(f"{t:g}" for t in temperatures),
        len(prompts),
    )
    bar = tqdm(total=len(runs) * len(prompts), desc="evaluate", unit="image", disable=not progress)
    with torch.no_grad(), bar:
        for temperature, config in runs:
            bar.set_description(f"{config.name} T={temperature:g}")
            sampling = replace(target.sampling_defaults, temperature=temperature)
            cold, floor, method = None, None, None
            if config is baseline and ar_runs is not None and temperature in ar_runs:
                # the same frozen target and prompts
                decoded, images, vq_seconds, floor = ar_runs[temperature]
                bar.update(len(prompts))
            else:
                method = build_method(config, target, drafter, sampling, options)
                with Heartbeat(f"{config.name} T={temperature:g}", len(prompts), bar) as beat:
                    cold = warm_up(method, target, prompts, seed, batch_size) if warmup else None
                    decoded = decode_prompts(method, target, prompts, seed, batch_size, beat)
                images, vq_seconds = vq_decode(target, decoded.tokens, batch_size)
            if config is baseline:  # runs first at every temperature
                ar, ar_vq_seconds, ar_images = decoded, vq_seconds, images
                if wants_floor and floor is None:
                    method = method or build_method(config, target, drafter, sampling, options)
                    with Heartbeat(f"AR noise floor T={temperature:g}", len(prompts)):
                        floor = noise_floor_images(
                            method, temperature, target, prompts, seed, batch_size, images
                        )
                if ar_runs is not None:
                    ar_runs[temperature] = (decoded, images, vq_seconds, floor)
            summary = summarize(decoded.stats, target.num_image_tokens)
            speedup = ar.seconds / decoded.seconds
            result.rows.append(
                EvalRow(
                    method=config.name,
                    temperature=float(temperature),
                    **summary,
                    speedup=speedup,
                    paper_speedup=projected_speedup(config.name, summary["S"] / speedup),
                    speedup_with_vq_decode=(ar.seconds + ar_vq_seconds) / (decoded.seconds + ar_vq_seconds),
                    method_seconds=decoded.seconds,
                    ar_seconds=ar.seconds,
                    startup_seconds=startup_seconds(target, options, cold, decoded),
                    device=device_description(target.token_embedding.weight.device),
                    identical_to_ar=bool(torch.equal(decoded.tokens, ar.tokens))
                    if temperature == 0
                    else None,
                    quality=scorer.score(images, prompts, floor if config is baseline else ar_images),
                )
            )
            key = (config.name, float(temperature))
            result.position_maps[key] = stats_position_maps(decoded.stats, target.grid)
            result.images[key] = images
            result.decoded[key] = decoded
            if image_dir is not None:
                folder = image_folder(image_dir, config.name, temperature)
                for index, image in enumerate(images):
                    save_png(image, folder / f"{index:04d}.png")
    log.info("evaluation done in %s", duration(time.monotonic() - started))
    return result
