"""What one speculative step costs, in AR steps: r = time per verified step ÷ time per AR step.

    python -m benchmarks.step_cost                                  # shapes target, 3 presets, batch 1, CPU
    python -m benchmarks.step_cost --presets eagle1 eagle2 peanut sjd vvs --batch 1 16 --out step_cost.json
    python -m benchmarks.step_cost --device cuda --targets shapes llamagen-b llamagen-l llamagen-xl \\
        --batch 1 16 --compile --out step_cost_gpu.json

For each target × preset × batch × mode (eager; with ``--compile`` also ``steps``, the step kernels
compiled, and ``compiled``, what ``compile=true`` gives: the forwards too, and on a GPU the whole step
recorded as one CUDA graph for graph-safe methods, whose phases and host time then read "—"; on a GPU
then ``unrecorded``, the same without recording steps) it decodes
the same prompts with the same seeds with AR and with the method (one untimed warm-up each) and reports:

- the AR step time (between consecutive target forwards: forward + sampling);
- the speculative step time, split into draft / verify / accept / commit / other (loop bookkeeping),
  all in AR steps, and ``host``: the step's time outside target and drafter forwards, in AR steps;
- r, efficiency 1/r, S (image tokens per target forward), projected speedup S/r and the measured
  speedup (AR decode time ÷ method decode time on the same prompts, prefill included);
- "paper S/r": the speedup at the S the method family's paper reports on LlamaGen-XL
  (``conf/papers.yaml``, ``vdtrain.eval.papers``), "—" where no paper figure applies.

The first step (it holds the prefill) is left out of every per-step figure; a VVS step that skips the
target is charged to the verified step after it, so S/r stays the speedup. Random-weight LlamaGen-B/-L/-XL
shaped targets (``llamagen-b`` …: vocabulary 16384, 16×16 image tokens, 120 caption rows, a random
drafter of the same shape) give r at real sizes, but their S is meaningless: their S/r uses the shapes
target's S for the same preset, batch and mode when this run measured it, and is labelled a projection.
docs/decoding.md ("Step cost") explains the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path

import torch

from benchmarks.step_cost_guard import check as check_references
from vdtrain.decode.compiled import DecodeOptions, cuda_graph_recorder, prepare_decoding
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import DecodeConfig, build_method, load_preset, preset_names
from vdtrain.decode.profiling import PHASES, PhaseTimer, StepTimes
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import block_kind
from vdtrain.eval.papers import projected_speedup
from vdtrain.eval.runner import device_description
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM
from vdtrain.models.chameleon_vqgan import ChameleonVQConfig, ChameleonVQGAN
from vdtrain.models.janus import JanusConfig, JanusGenerator
from vdtrain.models.llamagen_gpt import GPT_PRESETS, GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQConfig, VQModel
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import cast_for_inference, load_target_folder
from vdtrain.targets.base import Condition, Target
from vdtrain.targets.chameleon import (
    FAMILY_SAMPLING,
    ChameleonLayout,
    ChameleonTarget,
    ChameleonTokenizer,
    Guidance,
)
from vdtrain.targets.janus import SAMPLING as JANUS_SAMPLING
from vdtrain.targets.janus import JanusTarget, JanusTokens
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

# The embedded worlds shipped under checkpoints/ (target/ and drafter/ in each): shapes, the confident one,
# and grain, the visual-AR regime (docs/grain_world.md); both take the shapes world's held-out captions.
EMBEDDED = {"shapes": "checkpoints/shapes", "grain": "checkpoints/grain"}
# Random-weight targets of the released LlamaGen t2i shapes (GPT_PRESETS: layers, width, heads).
RANDOM_TARGETS = {"llamagen-b": "GPT-B", "llamagen-l": "GPT-L", "llamagen-xl": "GPT-XL"}


@dataclass(frozen=True)
class ChameleonShape:
    """A random-weight Chameleon-layout target: its decoder, the family's layout (``ChameleonLayout``), the
    code grid's side (codes per row and column; the 16× VQGAN stand-in makes images of 16 px a code), an
    end-of-row column or not, the prompt rows and the codebook (the head's image vocabulary)."""

    config: ChameleonConfig
    family: str = "lumina_mgpt"
    side: int = 32
    newline: bool = True
    prefix: int = 64  # prompt rows (bos + template + a caption + boi, size, size)
    codes: int = 8192


# Random-weight Chameleon-family targets: Lumina-mGPT-7B-512's decoder (Chameleon-7B: 32 layers, width
# 4096, vocabulary 65536; 32×32 codes + an end-of-row column) and a small one of the same layout for CPUs;
# the released image shapes of Lumina-mGPT-7B-768 and Anole-7B (Chameleon-7B's decoder) and Emu3-Gen
# (Llama-8B: 14336-wide MLP, 8 kv heads, vocabulary 184 622; 90×90 codes of a 32 768 codebook + an end-of-row
# column), with conf/target/{lumina_mgpt,anole,emu3}.yaml's prefix_length.
RANDOM_CHAMELEON = {
    "chameleon-7b": ChameleonShape(ChameleonConfig()),
    "chameleon-small": ChameleonShape(
        ChameleonConfig(
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
        )
    ),
    "lumina-mgpt-7b-768": ChameleonShape(ChameleonConfig(), side=48, prefix=256),
    "anole-7b": ChameleonShape(ChameleonConfig(), family="anole", newline=False, prefix=128),
    "emu3-8b": ChameleonShape(
        ChameleonConfig(
            vocab_size=184622, intermediate_size=14336, num_key_value_heads=8, rope_theta=1e6, qk_norm=False
        ),
        family="emu3",
        side=90,
        prefix=128,
        codes=32768,
    ),
}
# The VQ-16 of the random LlamaGen and Janus targets: the released codebook size (16 384) and downsampling
# (16 px a token) at a tiny width. Only its codebook is read (LANTERN, VVS); nothing is decoded.
RANDOM_VQ = VQConfig(ch=8, ch_mult=(1, 1, 1, 1, 1), num_res_blocks=1, z_channels=8, norm_groups=4)
# A random-weight Janus-Pro-7B (DeepSeek-LLM-7B's decoder: 30 layers, width 4096, a text vocabulary of
# 102 400 that embeds the prompt; image tokens in and out through the generation modules over the VQ-16
# codebook of 16 384 codes, 24 × 24 tokens at 384 px), as ``janus_io.janus_config`` reads the release.
RANDOM_JANUS = {
    "janus-pro-7b": JanusConfig(
        lm=ChameleonConfig(vocab_size=102400, num_hidden_layers=30, rms_norm_eps=1e-6, qk_norm=False),
        codebook_size=16384,
        code_dim=8,
        aligner_depth=2,
        head_width=4096,
        grid=24,
        vq=RANDOM_VQ,
    )
}
JANUS_PREFIX = 64  # prompt rows: bos, the chat template around a caption, <begin_of_image>
# Special ids of the release's tokenizer (bos, pad, <begin_of_image>); any id works with random weights.
JANUS_TOKENS = JanusTokens(bos=100000, pad=100002, boi=100016)
RANDOM = [*RANDOM_TARGETS, *RANDOM_CHAMELEON, *RANDOM_JANUS]  # every random-weight target
# LlamaGen's t2i sampling defaults (conf/target/llamagen_t2i_xl_stage1.yaml): CFG doubles the batch.
LLAMAGEN_SAMPLING = SamplingConfig(cfg_scale=7.5, temperature=1.0, top_k=1000, top_p=1.0)


@dataclass
class Row:
    target: str
    preset: str
    batch: int
    mode: str  # eager | steps (step kernels compiled) | compiled (compile=true: forwards and kernels)
    ar_step_ms: float
    step_ms: float
    r: float
    phases: dict[str, float]  # draft / verify / accept / commit / other, in AR steps
    host: float  # step time outside target and drafter forwards, in AR steps
    s: float  # this target's image tokens per target forward
    efficiency: float  # 1 / r
    projected_speedup: float | None  # S / r
    s_from: str | None  # whose S the projection uses (None: none measured)
    paper_speedup: float | None  # S_paper / r, the paper's S for the preset's family (None: no figure)
    measured_speedup: float  # AR decode time / method decode time, same prompts
    verified_steps: int
    startup_s: float  # the method's first decode of the first batch beyond a warm one (capture, compile)
    ar_startup_s: float  # the same for AR


# --- targets ------------------------------------------------------------------------------------------
def random_llamagen(
    size: str, device: torch.device, seed: int, shape: dict[str, int] | None = None
) -> tuple[Target, Drafter]:
    """A LlamaGen t2i-shaped target and drafter with random weights (no files needed): a released size,
    or the layers, width and heads in ``shape``."""
    torch.manual_seed(seed)
    config = replace(
        GPTConfig(), **(shape or GPT_PRESETS[RANDOM_TARGETS[size]])
    )  # vocab 16384, 120 + 256 rows
    vq = VQModel(RANDOM_VQ).eval()
    with torch.device(device):  # XL's 775M parameters initialised where they run
        gpt = LlamaGenGPT(config).eval()
    tokenizer = VQTokenizer(vq, image_size=16 * config.grid_size)  # VQ-16: 16 px per token
    target = LlamaGenTarget(gpt, tokenizer, None, size, LLAMAGEN_SAMPLING).to(device)
    drafter = Drafter.make(DrafterConfig.for_target(target)).to(device).eval()
    return target, drafter.attach(target)


def random_chameleon(
    size: str, device: torch.device, seed: int, shape: dict[str, int] | None = None
) -> tuple[Target, Drafter]:
    """A Chameleon-layout target (``RANDOM_CHAMELEON``: Lumina-mGPT, Anole, Emu3 shapes) and drafter with
    random weights, built on ``device`` (7B: 28 GB fp32); ``shape``: ``ChameleonConfig`` fields to change
    (fewer layers, a narrower decoder for a CPU test)."""
    torch.manual_seed(seed)
    spec = RANDOM_CHAMELEON[size]
    with torch.device(device):
        lm = ChameleonLM(replace(spec.config, **(shape or {}))).eval()
    # Released special ids of Lumina-mGPT (boi 8197, end of row 8803, size tokens 8804 + n); codes at ids
    # 4 .. 4 + codes; any ids do for random weights (Anole's and Emu3's layouts reuse them).
    size_ids = (8804 + spec.side // 2, 8804 + spec.side // 2)
    prefix = (8197,) if spec.family == "anole" else (8197, *size_ids)
    null = (0, 8197) if spec.family == "anole" else prefix
    guidance = Guidance((1.2,)) if spec.family == "anole" else Guidance()  # Anole's three streams
    newline = 8803 if spec.newline else None
    layout = ChameleonLayout(
        spec.family, (spec.side, spec.side), 0, prefix, null, newline, "{text}", guidance
    )
    # A small VQGAN with the released codebook size: only its codebook is read (LANTERN, VVS).
    vqgan = ChameleonVQGAN(
        ChameleonVQConfig(
            embed_dim=8, num_embeddings=spec.codes, latent_channels=32, base_channels=32, num_res_blocks=1
        )
    )
    family_sampling = FAMILY_SAMPLING.get(spec.family, FAMILY_SAMPLING["lumina_mgpt"])
    target = ChameleonTarget(
        lm,
        ChameleonTokenizer(vqgan, 16 * spec.side, newline_column=spec.newline),
        layout,
        torch.arange(4, 4 + vqgan.config.num_embeddings),
        None,
        name=size,
        prefix_length=spec.prefix,
        sampling_defaults=SamplingConfig(**family_sampling),  # Lumina-mGPT: CFG 3, top-k 2000
    ).to(device)
    drafter = Drafter.make(DrafterConfig.for_target(target)).to(device).eval()
    return target, drafter.attach(target)


def random_janus(
    size: str, device: torch.device, seed: int, shape: dict[str, int] | None = None
) -> tuple[Target, Drafter]:
    """A Janus-Pro-shaped target and drafter with random weights, built on ``device`` (7B: 28 GB fp32);
    ``shape``: fields of its decoder's ``ChameleonConfig`` to change, as in ``random_chameleon`` (the image
    head keeps the decoder's width, as the release's)."""
    torch.manual_seed(seed)
    config = RANDOM_JANUS[size]
    lm = replace(config.lm, **(shape or {}))
    with torch.device(device):
        generator = JanusGenerator(replace(config, lm=lm, head_width=lm.hidden_size)).eval()
    vq = VQModel(config.vq).eval()
    target = JanusTarget(
        generator,
        VQTokenizer(vq, config.image_size),
        JANUS_TOKENS,
        None,
        name=size,
        prefix_length=JANUS_PREFIX,
        sampling_defaults=SamplingConfig(**JANUS_SAMPLING),  # CFG 5, no top-k or top-p
    ).to(device)
    drafter = Drafter.make(DrafterConfig.for_target(target)).to(device).eval()
    return target, drafter.attach(target)


def load(
    name: str,
    device: torch.device,
    drafter_folder: str | None,
    seed: int,
    dtype: str = "fp32",
    layers: int | None = None,
) -> tuple[Target, Drafter]:
    """The target and its drafter on ``device``, the target cast to ``dtype`` (``target.dtype``'s cast)
    and the drafter moved to it; ``layers``: a random target with only that many decoder layers."""
    if layers is not None and name not in RANDOM:
        raise ValueError(f"layers={layers}: only a random-weight target ({', '.join(RANDOM)}) can be cut")
    if name in EMBEDDED:
        target = load_target_folder(f"{EMBEDDED[name]}/target", device)
        drafter = load_drafter(drafter_folder or f"{EMBEDDED[name]}/drafter", target).to(device).eval()
    elif name in RANDOM_CHAMELEON or name in RANDOM_JANUS:
        build = random_chameleon if name in RANDOM_CHAMELEON else random_janus
        target, drafter = build(name, device, seed, {"num_hidden_layers": layers} if layers else None)
    else:
        shape = {**GPT_PRESETS[RANDOM_TARGETS[name]], "n_layer": layers} if layers else None
        target, drafter = random_llamagen(name, device, seed, shape)
    target = cast_for_inference(target, dtype)
    return target, drafter.to(target.dtype)


def drafter_for(config: DecodeConfig, name: str, target: Target, drafter: Drafter) -> Drafter:
    """The drafter a preset drafts with: ``drafter``, unless the preset's tree drafts blocks and it drafts
    none; then the embedded world's block drafter (``checkpoints/<world>/drafter_block``), or a
    random-weight one for the other targets (its op counts and r do not depend on its weights)."""
    if not config.drafts_blocks or drafter.block_slots:
        return drafter
    if name in EMBEDDED:
        block = load_drafter(f"{EMBEDDED[name]}/drafter_block", target)
    else:
        torch.manual_seed(0)
        block = Drafter.make(DrafterConfig.for_target(target, kind=block_kind())).attach(target)
    return block.to(target.token_embedding.weight.device, target.dtype).eval()


def conditions(target: Target, name: str, prompts: int, batch: int, seed: int) -> list[Condition]:
    """The same prompts for AR and every method, in batches of ``batch``."""
    if name in EMBEDDED:
        captions = shapes_heldout_captions(prompts)
        return [target.encode_captions(captions[i : i + batch]) for i in range(0, prompts, batch)]
    g = torch.Generator().manual_seed(seed)
    if isinstance(target, (ChameleonTarget, JanusTarget)):  # random caption ids (the word range)
        if isinstance(target, ChameleonTarget):
            first, last, words = [target.layout.bos], list(target.layout.image_prefix), (9000, 60000)
        else:
            first, last, words = [target.tokens.bos], [target.tokens.boi], (1000, 90000)
        size = target.prefix_length - len(first) - len(last)
        ids = torch.randint(*words, (prompts, size), generator=g).tolist()
        full = [[*first, *row, *last] for row in ids]
        return [target.condition_from_ids(full[i : i + batch]) for i in range(0, prompts, batch)]
    rows, dim = target.prefix_length, target.gpt.config.caption_dim  # type: ignore[attr-defined]
    out = []
    for i in range(0, prompts, batch):
        n = min(batch, prompts - i)
        features = torch.randn(n, rows, dim, generator=g).to(target.device)
        out.append(Condition(features, torch.ones(n, rows, dtype=torch.bool, device=target.device)))
    return out


# --- timing -------------------------------------------------------------------------------------------
def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _generators(device: torch.device, seed: int, start: int, n: int) -> list[torch.Generator]:
    return [torch.Generator(device).manual_seed(seed + start + i) for i in range(n)]


@contextmanager
def forward_times(target: Target) -> Iterator[list[float]]:
    """Timestamps of every ``target.forward_tokens`` call: AR makes one per step."""
    stamps: list[float] = []
    original = target.forward_tokens

    def stamped(*args, **kwargs):
        stamps.append(_now(target.device))
        return original(*args, **kwargs)

    target.forward_tokens = stamped
    try:
        yield stamps
    finally:
        del target.forward_tokens


class ARClock:
    """AR's step time from its step hook: a synchronised clock read at the first and the last step only,
    so the steps between run as they would unobserved (AR reads nothing from the device)."""

    def __init__(self, device: torch.device, steps: int) -> None:
        self.device, self.steps, self.count, self.marks = device, steps, 0, []

    def on_step(self) -> None:
        self.count += 1
        if self.count in (1, self.steps):
            self.marks.append(_now(self.device))

    def seconds_per_step(self) -> float:
        return (self.marks[1] - self.marks[0]) / (self.steps - 1)


class _Enough(Exception):
    """Raised from a step hook once the steps to time have run: the rest of the decode is not needed."""


def run_steps(method, cond: Condition, generators, on_step=None, steps: int | None = None):
    """``method.generate``, or only its first ``steps`` steps (then None: a partial decode has no result).
    The decode stops between two steps, so a recorded step is never cut."""
    if steps is None:
        return method.generate(cond, generators, on_step=on_step, planned_batch=len(cond))
    seen = 0

    def hook(*args: object) -> None:
        nonlocal seen
        if on_step is not None:
            on_step(*args)
        seen += 1
        if seen >= steps:
            raise _Enough

    try:
        return method.generate(cond, generators, on_step=hook, planned_batch=len(cond))
    except _Enough:
        return None


def time_ar(
    target: Target,
    conds: Sequence[Condition],
    seed: int,
    sampling,
    options: DecodeOptions,
    steps: int | None = None,
) -> tuple[float, float, float]:
    """(seconds per AR step, whole decode seconds (NaN when ``steps`` cuts the decodes), start-up
    seconds)."""
    method = build_method(load_preset("ar"), target, None, sampling, options)
    first = _generators(target.device, seed, 0, len(conds[0]))
    t0 = _now(target.device)
    run_steps(method, conds[0], first, None, steps)  # warm-up: records the step, compiles
    cold = _now(target.device) - t0
    per_step, total, start, warm = [], 0.0, 0, None
    for cond in conds:
        gens = _generators(target.device, seed, start, len(cond))
        clock = ARClock(target.device, target.num_image_tokens - 1 if steps is None else steps)
        t0 = _now(target.device)
        run_steps(method, cond, gens, clock.on_step, steps)
        total += _now(target.device) - t0
        warm = total if warm is None else warm
        per_step.append(clock.seconds_per_step())
        start += len(cond)
    return sum(per_step) / len(per_step), total if steps is None else math.nan, max(0.0, cold - warm)


class StepClock:
    """``PhaseTimer``'s interface with step times only, for steps the engine records as CUDA graphs: a
    replay has no phases to time, and a capture must not be interrupted by synchronisation. Whether a
    step was verified (a VVS step may skip the target) comes from the engine's step log."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine, self.device, self.marks = engine, engine.target.device, [0.0]

    def __enter__(self) -> StepClock:
        self.marks = [_now(self.device)]
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def on_step(self, *_: object) -> None:
        self.marks.append(_now(self.device))

    def steps(self) -> tuple[StepTimes | None, list[StepTimes]]:
        verified = self.engine.run.verified_steps()
        unknown = {p: math.nan for p in PHASES}
        marks = pairwise(self.marks)
        out = [StepTimes(b - a, unknown, math.nan, v) for (a, b), v in zip(marks, verified, strict=True)]
        return (out[0] if out else None), out[1:]


def embedded_knobs(name: str) -> dict:
    """An embedded world's own decoding knobs (``decode`` in conf/target/<name>.yaml), as every app uses
    them (``vdtrain.target_settings``); none for the random targets."""
    return world_knobs(target_config(name)) if name in EMBEDDED else {}


def time_method(
    target,
    drafter,
    preset: str,
    conds,
    seed: int,
    sampling,
    options: DecodeOptions,
    knobs: dict | None = None,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Per verified step: seconds, phases, forwards (NaN for recorded steps); S and whole-decode
    seconds (NaN when ``max_steps`` cuts the decodes). ``knobs``: the target's own settings per preset
    (``embedded_knobs``)."""
    config = load_preset(preset, (knobs or {}).get(preset))
    method = build_method(config, target, drafter, sampling, options)
    t0 = _now(target.device)
    run_steps(method, conds[0], _generators(target.device, seed, 0, len(conds[0])), None, max_steps)
    cold = _now(target.device) - t0  # the warm-up decode: records steps, compiles
    steps, stats, total, start, warm = [], [], 0.0, 0, None
    for cond in conds:
        gens = _generators(target.device, seed, start, len(cond))
        recorded = getattr(method, "recorder", None) is not None
        with StepClock(method) if recorded else PhaseTimer(method) as timer:
            t0 = _now(target.device)
            result = run_steps(method, cond, gens, timer.on_step, max_steps)
            total += _now(target.device) - t0
        warm = total if warm is None else warm
        steps += timer.steps()[1]
        stats += result.stats if result is not None else []
        start += len(cond)
    verified_steps = max(1, sum(s.verified for s in steps))
    out = {p: sum(s.phases[p] for s in steps) / verified_steps for p in PHASES}
    out["other"] = sum(s.other for s in steps) / verified_steps
    out["step"] = sum(s.seconds for s in steps) / verified_steps
    out["forward"] = sum(s.forward for s in steps) / verified_steps
    out["verified_steps"] = verified_steps
    out["s"] = (
        sum(target.num_image_tokens / s.target_forwards for s in stats) / len(stats) if stats else math.nan
    )
    out["total"] = total if stats else math.nan
    out["startup"] = max(0.0, cold - warm)
    return out


def make_row(name: str, preset: str, batch: int, mode: str, ar, m, s_shapes) -> Row:
    """One table row from the AR timing (step, total, start-up) and the method's ``time_method``
    figures."""
    ar_step, ar_total, ar_startup = ar
    r = m["step"] / ar_step
    return Row(
        target=name,
        preset=preset,
        batch=batch,
        mode=mode,
        ar_step_ms=1e3 * ar_step,
        step_ms=1e3 * m["step"],
        r=r,
        phases={p: m[p] / ar_step for p in (*PHASES, "other")},
        host=(m["step"] - m["forward"]) / ar_step,
        s=m["s"],
        efficiency=1 / r,
        projected_speedup=None if s_shapes is None else s_shapes / r,
        s_from=None if s_shapes is None else "shapes",
        paper_speedup=projected_speedup(preset, r),
        measured_speedup=ar_total / m["total"],
        verified_steps=int(m["verified_steps"]),
        startup_s=m["startup"],
        ar_startup_s=ar_startup,
    )


MODES = ("eager", "steps", "graphs", "compiled")


def default_modes(device: torch.device, compile: bool) -> list[str]:
    """eager (and on a GPU graphs: cuda_graphs=true, the default there); ``--compile`` adds compile=true
    (on a GPU on top of graphs; on a CPU after ``steps``, the step kernels alone compiled)."""
    if device.type == "cuda":
        return ["eager", "graphs", *(["compiled"] if compile else [])]
    return ["eager", *(["steps", "compiled"] if compile else [])]


def measure(args: argparse.Namespace) -> list[Row]:
    """Every row, printed as it is measured. Mode ``compiled`` is what ``compile=true`` gives
    (``prepare_decoding``: compiled forwards, on a GPU inside recorded steps, elsewhere with compiled
    step kernels); it wraps modules in place, so it runs on a fresh copy of the target (the same weights:
    the same file or seed), after the last copy is freed."""
    device = torch.device(args.device)
    rows: list[Row] = []
    shapes_s: dict[tuple[str, int, str], float] = {}  # S of the shapes target, for the projections
    modes = args.modes or default_modes(device, args.compile)
    for name in args.targets:
        target = drafter = None
        knobs = embedded_knobs(name)
        for mode in modes:
            if target is None or mode in ("compiled", "graphs"):
                del target, drafter
                target, drafter = load(name, device, args.drafter, args.seed, args.dtype, args.layers)
                if mode == "compiled":
                    options = prepare_decoding(target, drafter, compile=True)
                elif mode == "graphs":
                    options = DecodeOptions(step_recorder=cuda_graph_recorder(target))
            if mode in ("eager", "steps"):  # mode steps: the step kernels compiled, the forwards eager
                options = DecodeOptions(compile_steps="inductor" if mode == "steps" else None)
            sampling = target.sampling_defaults
            if args.temperature is not None:
                sampling = replace(sampling, temperature=args.temperature)
            if args.top_k is not None:
                sampling = replace(sampling, top_k=args.top_k)
            for batch in args.batch:
                conds = conditions(target, name, max(args.prompts, batch), batch, args.seed)
                with torch.no_grad():
                    ar = time_ar(target, conds, args.seed, sampling, options, args.steps)
                    for preset in args.presets:
                        drafts = drafter_for(load_preset(preset), name, target, drafter)
                        m = time_method(
                            target, drafts, preset, conds, args.seed, sampling, options, knobs, args.steps
                        )
                        if name == "shapes":
                            shapes_s[(preset, batch, mode)] = m["s"]
                        s_shapes = shapes_s.get((preset, batch, mode))
                        rows.append(make_row(name, preset, batch, mode, ar, m, s_shapes))
                        print(table(rows[-1:], header=len(rows) == 1), flush=True)
            if mode in ("compiled", "graphs"):  # the next mode starts from a clean copy
                target = drafter = None
        del target, drafter
    return rows


def table(rows: Sequence[Row], header: bool = True) -> str:
    """Markdown rows; phase columns and host in AR steps; S/r marked * when S is another target's."""
    cols = "target | preset | B | mode | AR step ms | step ms | r | draft | verify | accept | commit | other"
    cols += " | host | S | 1/r | S/r | paper S/r | measured | start-up s | AR start-up s"
    lines = [f"| {cols} |", "|" + "---|" * (cols.count("|") + 1)] if header else []
    for w in rows:
        p = w.phases
        cell = lambda x: "—" if math.isnan(x) else f"{x:.2f}"  # noqa: E731  (recorded steps: no phases)
        if w.projected_speedup is None:
            projected = "—"
        else:
            projected = f"{w.projected_speedup:.2f}" + ("" if w.s_from == w.target else f"* ({w.s_from} S)")
        lines.append(
            f"| {w.target} | {w.preset} | {w.batch} | {w.mode} | {w.ar_step_ms:.2f} | {w.step_ms:.2f} "
            f"| {w.r:.2f} | {cell(p['draft'])} | {cell(p['verify'])} | {cell(p['accept'])} "
            f"| {cell(p['commit'])} | {cell(p['other'])} | {cell(w.host)} | {cell(w.s)} | {w.efficiency:.3f} "
            f"| {projected} | {'—' if w.paper_speedup is None else f'{w.paper_speedup:.2f}'} "
            f"| {cell(w.measured_speedup)} | {w.startup_s:.1f} | {w.ar_startup_s:.1f} |"
        )
    return "\n".join(lines)


def _no_nan(value):
    """JSON has no NaN: the phases of recorded steps become null."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (the guard's: ``EXCEEDED`` when a row passed its
    reference)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", default=["shapes"], choices=[*EMBEDDED, *RANDOM])
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["eagle1", "eagle2", "sjd"],
        help="conf/decode presets (not ar); all: every one",
    )
    parser.add_argument("--batch", nargs="+", type=int, default=[1], help="prompts per batch")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per row (at least one batch)")
    parser.add_argument("--temperature", type=float, default=None, help="default: the target's")
    parser.add_argument("--top-k", type=int, default=None, help="sampling top-k (default: the target's)")
    parser.add_argument(
        "--drafter",
        default=None,
        help="an embedded world's drafter folder (default: checkpoints/<world>/drafter)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="target.dtype")
    parser.add_argument(
        "--compile", action="store_true", help="also time compile=true (CPU: the step kernels alone first)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=None, help="explicit modes (default: see default_modes)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default on a CPU: 1; on a GPU: torch's)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="time only the first N steps of each decode (default: whole decodes); S and measured then "
        "read —",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="random targets: only this many decoder layers (CPU tests)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.presets == ["all"]:
        args.presets = [name for name in preset_names() if name != "ar"]
    if "ar" in args.presets:
        parser.error("ar is the reference every row is divided by; leave it out of --presets")
    if min(args.batch) < 1 or args.prompts < 1:
        parser.error("--batch and --prompts must be >= 1")
    if args.steps is not None and args.steps < 4:
        parser.error("--steps must be >= 4: two warm-up steps, the recorded one, then one timed")
    if args.layers is not None and (args.layers < 1 or not set(args.targets) <= set(RANDOM)):
        parser.error(f"--layers needs a number >= 1 and random-weight targets only ({', '.join(RANDOM)})")
    if args.threads or args.device == "cpu":
        # A 4-layer target decodes fastest on one thread of a CPU shared with other processes.
        torch.set_num_threads(args.threads or 1)

    rows = measure(args)
    device = device_description(torch.device(args.device))
    print(f"\n{device}; phases, host and r in AR steps; * S from another target\n")
    print(table(rows))
    if args.out:
        settings = {
            "command": " ".join(
                ["python -m benchmarks.step_cost", *(sys.argv[1:] if argv is None else argv)]
            ),
            **{k: v for k, v in vars(args).items() if k != "out"},
            "device": device,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        rows_json = [_no_nan(asdict(w)) for w in rows]
        Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows_json}, indent=1) + "\n")
    if args.top_k is not None:  # the references hold the targets' own sampling
        return 0
    return check_references(rows, vars(args))  # conf/benchmarks/step_cost_reference.yaml


if __name__ == "__main__":
    sys.exit(main())
