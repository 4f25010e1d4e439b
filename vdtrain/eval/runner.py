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

import functools
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vdtrain.decode.compiled import DecodeOptions, prepare_decoding
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import ARMethod, DecodeConfig, build_method, load_preset
from vdtrain.decode.metrics import position_maps as stats_position_maps
from vdtrain.decode.metrics import summarize
from vdtrain.decode.run import DecodeStats
from vdtrain.drafters.base import Drafter
from vdtrain.durations import duration
from vdtrain.eval.heartbeat import Heartbeat
from vdtrain.eval.papers import projected_speedup
from vdtrain.eval.quality import REFERENCE_METRICS, Partial, QualityConfig, QualityScorer, add_partials
from vdtrain.eval.table import EvalRow
from vdtrain.eval.timing import Spread, interleaved, paired_speedup
from vdtrain.images import save_png, tensor_to_images
from vdtrain.sharding import Ranks, UnitStore, units_of
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


@dataclass
class UnitRecord:
    """One unit (a batch of prompts, from ``start``) decoded by one method at one temperature: what the
    merge into a row needs. Quality comes as summable partials, so no process holds a row's images."""

    start: int
    tokens: torch.Tensor  # [n, h·w], on the CPU
    stats: list[DecodeStats]
    seconds: float  # decoding only
    vq_seconds: float
    rank: int  # the process that decoded it (throughput per process)
    image_size: tuple[int, int]
    quality: dict[str, Partial | str]
    floor: dict[str, Partial | str] | None = None  # AR's rows: the noise floor's reference partials
    startup: float | None = None  # the first unit a process decoded: what its cold decode cost extra
    images: np.ndarray | None = None  # uint8 [n, H, W, 3] where kept (``keep_images``)


def unit_key(method: str, temperature: float, start: int) -> str:
    return f"{method}_T{temperature:g}/{start:06d}"


def merge_row(
    records: Sequence[UnitRecord],
) -> tuple[Decoded, float, dict[str, Partial | str], dict[str, Partial | str] | None, float | None]:
    """A row's units in prompt order → its decode, VQ seconds, summed quality and floor partials, and
    the worst start-up of a process."""
    records = sorted(records, key=lambda r: r.start)
    decoded = Decoded(
        torch.cat([r.tokens for r in records]),
        [s for r in records for s in r.stats],
        sum(r.seconds for r in records),
        [r.seconds for r in records],
    )
    quality = {name: add_partials([r.quality[name] for r in records]) for name in records[0].quality}
    floor = None
    if records[0].floor is not None:
        floor = {name: add_partials([r.floor[name] for r in records]) for name in records[0].floor}  # type: ignore[index]
    startups = [r.startup for r in records if r.startup is not None]
    return decoded, sum(r.vq_seconds for r in records), quality, floor, max(startups, default=None)


def throughput(records: Sequence[UnitRecord]) -> float:
    """Images per second of all processes together: the images over the busiest process's decode time."""
    busy: dict[int, float] = {}
    for r in records:
        busy[r.rank] = busy.get(r.rank, 0.0) + r.seconds
    return sum(len(r.tokens) for r in records) / max(busy.values())


def evaluate(
    target: Target,
    drafter: Drafter | Mapping[str, Drafter] | None,
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
    ar_runs: dict[tuple[float, int], UnitRecord] | None = None,
    decode_overrides: Mapping[str, Any] | None = None,
    ranks: Ranks | None = None,
    store: UnitStore | None = None,
    keep_images: int | None = None,
    merge_only: bool = False,
    keep_decoded: bool = True,
    speed_repeats: int = 0,
) -> EvalResult | None:
    """Rows, per-position maps and images for AR and every method (preset names or typed configs) at every
    temperature; relaxed methods are left out at T = 0 with ``exact_only_at_zero``.

    ``quality`` None: consistency for shapes captions, else the real-image metrics (``QualityConfig``).
    ``image_dir`` saves ``<method>_T<t>/<index:04d>.png``. ``warmup`` decodes untimed first (start-up,
    capture and compilation go to ``startup_seconds``); ``cuda_graphs`` records every step, ``compile``
    wraps the forwards (``prepare_decoding``). ``ar_runs`` caches AR's units for a caller that evaluates
    again (``EvalAfterEpoch``); ``decode_overrides`` are the target's own knobs. Prompts go in units of
    ``batch_size`` (``vdtrain.sharding``): with ``ranks`` each process decodes its part, merged in prompt
    order whatever the world size; ``store`` saves finished units and loads them instead of decoding
    (then only the main rank merges, the others return None); ``merge_only`` decodes nothing;
    ``keep_images`` keeps that many images per row in memory; ``keep_decoded`` False keeps
    ``EvalResult.decoded`` empty, so a merge holds one row's stats at a time. ``drafter`` may map method
    names to drafters (``vdtrain.eval.serving.drafters_for``): each method decodes with its own. The
    speedup is the median of ``speed_repeats`` interleaved rounds of the first batch (``timed_speedups``),
    measured by the main process (the apps' configs ask for 5); 0 (the default: only counts are read, or
    one ratio is enough) and a merge keep the whole run's one ratio.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate (the prompt set is empty)")
    ranks = ranks or Ranks()
    configs = method_configs(methods, decode_overrides)
    needy = [c.name for c in configs if c.needs_drafter]
    missing = [n for n in needy if drafter is None or (isinstance(drafter, Mapping) and n not in drafter)]
    if missing:
        raise ValueError(f"methods {missing} need a drafter; none was given")
    if isinstance(drafter, Mapping):
        distinct = list({id(d): d for d in drafter.values()}.values())
    else:
        distinct = [drafter]
    if compile and len(distinct) > 1:
        raise ValueError(
            "compile=true compiles one drafter, but these methods decode with different drafters: "
            "evaluate each drafter's methods separately"
        )
    options = prepare_decoding(target, next(iter(distinct), None), compile=compile, cuda_graphs=cuda_graphs)
    scorer = QualityScorer(quality, target.token_embedding.weight.device, target.tokenizer)
    names = scorer.metrics_for(prompts)
    wants_floor = scorer.wants_reference(prompts)
    baseline = load_preset("ar")
    runs = [(t, c) for t in temperatures for c in [baseline, *configs]]
    if exact_only_at_zero:
        skipped = sorted({c.name for t, c in runs if t == 0 and not c.exact})
        if skipped:
            log.info("T = 0: leaving out the relaxed methods %s (meaningless under greedy decoding)", skipped)
        runs = [(t, c) for t, c in runs if t != 0 or c.exact]
    mine = ranks.take(units_of(len(prompts), batch_size))
    started = time.monotonic()
    log.info(
        "evaluation: %s at T = %s on %d prompts (%s: %d)",
        ", ".join(dict.fromkeys(c.name for _, c in runs)),
        ", ".join(f"{t:g}" for t in temperatures),
        len(prompts),
        ranks.describe(),
        sum(stop - start for start, stop in mine),
    )
    work = UnitWork(
        target,
        drafter,
        prompts,
        seed=seed,
        batch_size=batch_size,
        scorer=scorer,
        names=names,
        options=options,
        image_dir=image_dir,
        keep_images=keep_images,
    )
    done: dict[tuple[str, float], list[UnitRecord]] = {}  # this rank's units, where not in the store
    first_round: dict[tuple[str, float], float] = {}  # the first batch's seconds, where decoded here
    hold = store is None or ar_runs is not None
    mine_total = sum(stop - start for start, stop in mine)
    bar = tqdm(total=len(runs) * mine_total, desc="evaluate", unit="image", disable=not progress)
    with torch.no_grad(), bar:
        for temperature, config in runs:
            bar.set_description(f"{config.name} T={temperature:g}")
            is_ar = config is baseline
            records, todo = [], []
            for start, stop in mine:
                record = None
                if is_ar and ar_runs is not None:
                    record = ar_runs.get((float(temperature), start))
                if record is None and store is not None:
                    record = store.load(unit_key(config.name, temperature, start))
                if record is None or (is_ar and wants_floor and record.floor is None):
                    todo.append((start, stop))
                else:
                    records += [record] if hold else []
                    bar.update(stop - start)
            if todo and merge_only:
                raise ValueError(
                    f"merge only, but {len(todo)} unit(s) of {config.name} at T = {temperature:g} are not "
                    "finished: run without merge=true to decode them"
                )
            if todo:
                with Heartbeat(f"{config.name} T={temperature:g}", sum(b - a for a, b in todo), bar) as beat:
                    for record in work.run(
                        config, temperature, todo, warmup, is_ar and wants_floor, beat, ranks
                    ):
                        if store is not None:
                            store.save(unit_key(config.name, temperature, record.start), record)
                        if record.start == 0:
                            first_round[config.name, float(temperature)] = record.seconds
                        records += [record] if hold else []
            if is_ar and ar_runs is not None:
                ar_runs.update({(float(temperature), r.start): r for r in records})
            done[config.name, float(temperature)] = records
    all_units = units_of(len(prompts), batch_size)
    if store is not None:
        ranks.barrier()
        if not ranks.is_main:
            return None

        def records_of(key: tuple[str, float]) -> list[UnitRecord]:  # one row at a time in memory
            records = [store.load(unit_key(key[0], key[1], start)) for start, _ in all_units]
            if any(r is None for r in records):
                raise RuntimeError(
                    f"units of {key} are missing from {store.folder} after every rank finished"
                )
            return records
    else:
        gathered = ranks.gather(done)

        def records_of(key: tuple[str, float]) -> list[UnitRecord]:
            return [r for part in gathered for r in part[key]]

    timed = speed_repeats > 0 and not merge_only and ranks.is_main
    # one unit here: each run's decode of the first batch followed the one before, warmed up
    reusable = first_round if warmup and mine == all_units[:1] else {}
    spreads = timed_speedups(work, runs, speed_repeats, reusable) if timed else {}
    result = merge(
        records_of, runs, scorer, prompts, target, ranks.world, keep_decoded=keep_decoded, spreads=spreads
    )
    log.info("evaluation done in %s", duration(time.monotonic() - started))
    return result


class UnitWork:
    """Decodes units of prompts with one method and scores them: what one process does for a row."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | Mapping[str, Drafter] | None,
        prompts: Sequence[str],
        *,
        seed: int,
        batch_size: int,
        scorer: QualityScorer,
        names: Sequence[str],
        options: DecodeOptions,
        image_dir: str | os.PathLike[str] | None,
        keep_images: int | None,
    ) -> None:
        self.target, self.drafter, self.prompts, self.seed = target, drafter, prompts, seed
        self.batch_size, self.scorer, self.names, self.options = batch_size, scorer, names, options
        self.image_dir, self.keep_images = image_dir, keep_images

    def method(self, config: DecodeConfig, temperature: float) -> ARMethod | SpeculativeEngine:
        """``config`` built to decode at ``temperature`` with its drafter."""
        sampling = replace(self.target.sampling_defaults, temperature=temperature)
        drafter = self.drafter.get(config.name) if isinstance(self.drafter, Mapping) else self.drafter
        return build_method(config, self.target, drafter, sampling, self.options)

    def run(
        self,
        config: DecodeConfig,
        temperature: float,
        units: Sequence[tuple[int, int]],
        warmup: bool,
        floor: bool,
        progress: Heartbeat,
        ranks: Ranks,
    ) -> Iterator[UnitRecord]:
        """Each unit's record as it is done; the first unit decodes twice with ``warmup``, untimed first."""
        target, bs = self.target, self.batch_size
        method = self.method(config, temperature)
        first = units[0]
        cold = (
            warm_up(method, target, self.prompts[first[0] : first[1]], self.seed + first[0], bs)
            if warmup
            else None
        )
        for start, stop in units:
            part = self.prompts[start:stop]
            decoded = decode_prompts(method, target, part, self.seed + start, bs, progress)
            images, vq_seconds = vq_decode(target, decoded.tokens, bs)
            quality = self.scorer.partials(images, part, self.names)
            record = UnitRecord(
                start,
                decoded.tokens.cpu(),
                decoded.stats,
                decoded.seconds,
                vq_seconds,
                ranks.rank,
                images.shape[1:3],
                quality,
                startup=startup_seconds(target, self.options, cold, decoded)
                if (start, stop) == first
                else None,
            )
            if floor:
                reference = noise_floor_images(
                    method, temperature, target, part, self.seed + start, bs, images
                )
                record.floor = self.scorer.partials(
                    reference, part, [n for n in self.names if n in REFERENCE_METRICS]
                )
            if self.keep_images is None or start < self.keep_images:
                record.images = images
            if self.image_dir is not None:
                folder = image_folder(self.image_dir, config.name, temperature)
                for index, image in enumerate(images):
                    save_png(image, folder / f"{start + index:04d}.png")
            yield record


def timed_speedups(
    work: UnitWork,
    runs: Sequence[tuple[float, DecodeConfig]],
    repeats: int,
    first_round: Mapping[tuple[str, float], float] | None = None,
) -> dict[tuple[str, float], Spread]:
    """Per (method, T): the speedup over ``repeats`` interleaved rounds of the first batch's decode by AR
    and every method of that temperature, after an untimed one each (``vdtrain.eval.timing``). Where
    ``first_round`` has every method of a temperature (the evaluation's own warm decodes of that batch,
    one after another), they are round 1 and the warm-up."""
    out: dict[tuple[str, float], Spread] = {}
    prompts = work.prompts[: work.batch_size]
    for temperature in dict.fromkeys(t for t, _ in runs):
        configs = [c for t, c in runs if t == temperature]  # AR first
        known, keys = first_round or {}, [(c.name, float(temperature)) for c in configs]
        reused = {name: known[name, t] for name, t in keys} if all(k in known for k in keys) else None
        decoded = repeats - 1 if reused else repeats + 1
        total = decoded * len(configs) * len(prompts)
        with Heartbeat(f"timing {len(configs)} methods T={temperature:g}", total) as beat:
            decodes = {
                c.name: functools.partial(_seconds, work.method(c, temperature), work, prompts, beat)
                for c in configs
            }
            seconds = interleaved(decodes, repeats, reused)
        baseline = configs[0].name
        for name in list(decodes)[1:]:
            out[name, float(temperature)] = paired_speedup(seconds[baseline], seconds[name])
    return out


def _seconds(
    method: ARMethod | SpeculativeEngine, work: UnitWork, prompts: Sequence[str], beat: Heartbeat
) -> float:
    return decode_prompts(method, work.target, prompts, work.seed, work.batch_size, beat).seconds


def merge(
    records_of: Callable[[tuple[str, float]], Sequence[UnitRecord]],
    runs: Sequence[tuple[float, DecodeConfig]],
    scorer: QualityScorer,
    prompts: list[str],
    target: Target,
    world_size: int,
    *,
    keep_decoded: bool = True,
    spreads: Mapping[tuple[str, float], Spread] | None = None,
) -> EvalResult:
    """The rows from every unit of every run (``records_of`` a (method, T)), in prompt order, AR's row
    first at each temperature; a row's speedup is its ``spreads`` median where timed, else the whole
    run's ratio."""
    spreads = spreads or {}
    result = EvalResult([], {}, {}, list(prompts))
    device = device_description(target.token_embedding.weight.device)
    for temperature, config in runs:
        key = (config.name, float(temperature))
        records = sorted(records_of(key), key=lambda r: r.start)
        decoded, vq_seconds, quality, floor, startup = merge_row(records)
        if config.tree.kind == "none":  # AR, the baseline: runs first at every temperature
            ar, ar_vq_seconds, ar_quality = decoded, vq_seconds, quality
            reference = floor
        else:
            reference = ar_quality
        summary = summarize(decoded.stats, target.num_image_tokens)
        spread = spreads.get(key)
        speedup = spread.median if spread is not None else ar.seconds / decoded.seconds
        result.rows.append(
            EvalRow(
                method=config.name,
                temperature=float(temperature),
                **summary,
                speedup=speedup,
                speedup_low=None if spread is None else spread.low,
                speedup_high=None if spread is None else spread.high,
                speedup_rounds=0 if spread is None else spread.rounds,
                paper_speedup=projected_speedup(config.name, summary["S"] / speedup),
                speedup_with_vq_decode=(ar.seconds + ar_vq_seconds) / (decoded.seconds + ar_vq_seconds),
                method_seconds=decoded.seconds,
                ar_seconds=ar.seconds,
                startup_seconds=startup,
                device=device,
                world_size=world_size,
                images_per_second=throughput(records),
                identical_to_ar=bool(torch.equal(decoded.tokens, ar.tokens)) if temperature == 0 else None,
                quality=scorer.finish(quality, reference, records[0].image_size),
            )
        )
        result.position_maps[key] = stats_position_maps(decoded.stats, target.grid)
        kept = [r.images for r in records if r.images is not None]
        if kept:
            result.images[key] = np.concatenate(kept)
        if keep_decoded:
            result.decoded[key] = decoded
    return result
