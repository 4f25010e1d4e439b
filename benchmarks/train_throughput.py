"""What one drafter-training step costs: samples/s, image tokens/s, the frozen target's share, the drafter's
time by phase, model FLOP utilisation, the graph breaks of its compiled part and the peak memory of its loss,
for ``fit``'s own step (``DrafterModule``: online features with 10% null rows, feature noise, the drafter's
passes, its loss, backward and AdamW) on random-weight targets, for ``eagle1`` drafters (one teacher-forced
pass) and ``eagle3`` drafters (``--ttt-steps`` unrolled passes over fused layers).

    python -m benchmarks.train_throughput                              # CPU: a small LlamaGen-shaped target
    python -m benchmarks.train_throughput --reference-loss --threads 1 # ... beside the loss it replaced
    python -m benchmarks.train_throughput --device cuda --targets llamagen-b llamagen-xl \\
        --drafters eagle1 eagle3 --modes eager compiled zero2 --batch 8 32 --out train_throughput.json

Modes: ``eager``; ``compiled`` (``trainer.compile``: the drafter's passes and loss under ``torch.compile``);
``zero2`` (DeepSpeed ZeRO stage 2 in one process, as ``trainer=deepspeed_stage_2`` runs each rank; GPU only).
``--dtype bf16`` runs the target in bf16 and the drafter under bf16 autocast (``precision: bf16-mixed``).
Captions are random condition rows (a real run adds the text encoder's pass, not counted here). The first
``--warmup`` steps (compilation included) are left out. AdamW is fused on a GPU, as ``fit``'s.

Columns: step time; ``target``: the feature pass; ``drafter``: the rest, split into its phases
(``PhaseClock``: CUDA events on a GPU, so nothing inside a step waits for the clock): ``forward`` (the
drafter's passes, and the feature noise), ``head+loss`` (the frozen head's logits and the loss, whose
gradient to the drafter's features ``head_token_loss`` computes here; compiled, it is one graph with the
passes, counted under ``forward``), ``backward``, ``optimizer``; samples/s and image tokens/s; model TFLOP/s
(``step_flops``: 2 per weight per row for the target's pass, 6 for the drafter's trained weights per pass, 4
for its frozen head per scored row of each pass, whose input gradient is needed, 2 for the head on the
target's features, 4 for an eagle3 fusion, plus attention at 4·d per visible query-key pair, three times for
the drafter's backward; an eagle3 step makes ``ttt_steps`` passes, each as costly as a teacher-forced one)
and MFU against the device's dense bf16 peak (known GPUs only: H100 / H200 989 TFLOP/s, A100 312); the graph
breaks ``torch._dynamo.explain`` finds in the compiled part (``DrafterModule.drafter_loss``); the loss's
peak memory (``loss_cost``: its forward and backward alone, on one batch's drafter passes; ``loss_peak_bytes``
says how it is read on a CPU and a GPU) and, with ``--reference-loss``, the same for the loss before the
chunked head loss (tests/reference_losses.py), both timed alternately. Goal on an H100 / H200 at XL shape:
the drafter ≤ 35% of the step, MFU ≥ 35%.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.profiler._memory_profiler import Action

from benchmarks.step_cost import EMBEDDED, RANDOM, load, random_llamagen
from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import LossInputs
from vdtrain.drafters.losses import image_target_mask
from vdtrain.drafters.rows import chain_rows
from vdtrain.eval.runner import device_description, synchronize
from vdtrain.targets import cast_for_inference
from vdtrain.targets.base import Target, split_taps
from vdtrain.targets.llamagen import LlamaGenTarget
from vdtrain.train.memory_plan import planning_condition
from vdtrain.train.module import DrafterModule

# A LlamaGen-shaped target small enough for a CPU: GPT-B's vocabulary and caption rows, 4 layers of 256.
SMALL = {"n_layer": 4, "n_head": 4, "dim": 256}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
MODES = ("eager", "compiled", "zero2")


@dataclass
class Row:
    target: str
    drafter: str
    mode: str
    dtype: str
    batch: int
    steps: int
    step_ms: float
    target_ms: float
    drafter_ms: float
    drafter_share: float
    # The drafter's part by phase (``PhaseClock``): its passes; the head and loss (None when compiled: the
    # passes and the loss are one graph, counted under forward); backward; the optimizer step.
    forward_ms: float
    loss_ms: float | None
    backward_ms: float
    optimizer_ms: float
    samples_per_s: float
    tokens_per_s: float
    tflops: float
    mfu: float | None
    graph_breaks: int | None  # in the compiled part of the step (``DrafterModule.drafter_loss``)
    loss_peak_mb: float | None  # the loss's forward and backward alone (``loss_peak_bytes``)
    reference_loss_peak_mb: float | None  # the same for tests/reference_losses.py (--reference-loss)
    reference_loss_ms: float | None  # its forward and backward, timed beside the loss's (``loss_ms_pair``)
    chunked_loss_ms: float | None


class RandomCaptions:
    """A caption encoder of the target's shape that returns random rows: the benchmark times training, not
    the text encoder."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width, self.device = rows, width, device

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.randn(len(captions), self.rows, self.width, device=self.device)
        return features, torch.ones(len(captions), self.rows, dtype=torch.bool, device=self.device)


def build(
    name: str,
    device: torch.device,
    dtype: str,
    seed: int,
    kind: str = "eagle1",
    layers: int | None = None,
) -> tuple[Target, Drafter]:
    """The random-weight target, or an embedded world's (grain, shapes), (cast to ``dtype``; ``layers``: a
    random one's decoder layers) with random
    condition rows for captions, and a fresh ``kind`` drafter."""
    if name == "small":
        target, drafter = random_llamagen(name, device, seed, SMALL)
    else:  # step_cost's random targets: LlamaGen sizes, the Chameleon layouts, Janus-Pro
        target, drafter = load(name, device, None, seed, "fp32", layers)
    if name in EMBEDDED:  # a trained world: its own (small) caption encoder
        pass
    elif isinstance(target, LlamaGenTarget):
        gpt = target.gpt.config
        target.caption_encoder = RandomCaptions(target.prefix_length, gpt.caption_dim, device)
    else:  # a token-prompt target: full-length prompts of one id, its tokenizer not needed
        target.encode_captions = lambda captions: planning_condition(target, len(captions))
    if kind != drafter.config.kind:
        drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind)).to(device).start_from(target)
    return cast_for_inference(target, dtype), drafter.float().attach(target).train()  # fp32 (autocast)


def matmul_weights(module: torch.nn.Module) -> int:
    """The weights a row is multiplied by: 2-D parameters (norm scales and biases are not matmuls)."""
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


def causal_pairs(rows: int) -> int:
    """Query-key pairs of causal attention over ``rows``: row ``s`` sees ``s + 1`` keys. Every unrolled
    step sees as many (``UnrollCache``: ``s - j + 1`` teacher keys and ``j`` ancestors)."""
    return rows * (rows + 1) // 2


def scored_rows(target: Target, unrolled: int) -> list[int]:
    """Rows per sample whose logits each drafter pass scores: eagle1 (``unrolled`` 0) the ``N`` image rows;
    eagle3 step ``j`` those whose chain starts at or after the prefix (``unrolled_loss``)."""
    prefix, image = target.prefix_length, target.num_image_tokens
    rows = image_target_mask(prefix, image)
    if not unrolled:
        return [int(rows.sum())]
    return [int((rows & chain_rows(prefix, rows.shape[0], j)).sum()) for j in range(unrolled)]


def step_flops(target: Target, drafter: Drafter, batch: int, unrolled: int = 1) -> float:
    """Model FLOPs of one training step (see the module docstring): what the model computes, 2 per
    multiply-add. ``unrolled``: an eagle3 drafter's ``ttt_steps`` (ignored for eagle1, one pass). A block
    drafter counts as one teacher-forced pass: its ``train_roots`` blocks of query rows are left out."""
    seq = target.prefix_length + target.num_image_tokens
    rows = seq - 1  # drafter rows: slot s pairs f_s with the token at s + 1
    width = target.hidden_size
    head = target.vocab_size * width
    fused = drafter.fuse.weight.numel() if drafter.taps else 0
    trained = matmul_weights(drafter) - fused
    passes = scored_rows(target, unrolled if drafter.taps else 0)
    # Per pass: the trained layer forward and backward; the head forward and its input gradient.
    per_pass = 6 * trained * rows + 3 * 4 * width * causal_pairs(rows)
    drafter_flops = sum(per_pass + 4 * head * n for n in passes)
    drafter_flops += 4 * fused * seq  # fusion: forward and weight gradient (the tapped layers need none)
    drafter_flops += 2 * head * target.num_image_tokens  # the target's logits, once
    return float(batch * (target_pass_flops(target) + drafter_flops))


def target_pass_flops(target: Target) -> float:
    """Model FLOPs of the target's feature pass over one sample (``step_flops``'s target part)."""
    decoder = target.transformer
    prefix, seq = target.prefix_length, target.prefix_length + target.num_image_tokens
    caption = getattr(decoder, "cls_embedding", None)  # LlamaGen projects its caption rows
    # Attention: QKᵀ and AV, 2·d each per visible query-key pair.
    flops = 2 * matmul_weights(decoder.layers) * seq
    flops += 2 * matmul_weights(caption) * prefix if caption is not None else 0
    return float(flops + len(decoder.layers) * 4 * target.hidden_size * causal_pairs(seq))


def projection(names: list[str], kinds: list[str], ttt_steps: int, mfu: float) -> str:
    """Model FLOPs of one sample's step at each target's full depth (built on the meta device: no weights)
    and what a GPU running them at ``mfu`` of the H100's / H200's dense bf16 peak would take: ms per sample
    and GPU-hours per 100k samples, with the target pass's share of the FLOPs."""
    peak = PEAK_BF16_TFLOPS["H100"] * 1e12
    lines = [
        f"model FLOPs per sample at full depth; time at {mfu:.0%} MFU of an H100 / H200 ({peak / 1e12:.0f} "
        "dense bf16 TFLOP/s)",
        "| target | drafter | layers | TFLOP / sample | target share | ms / sample | GPU-h / 100k samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for kind in kinds:
            target, drafter = build(name, torch.device("meta"), "bf16", 0, kind)
            unroll = drafter.unroll_steps(ttt_steps)
            total = step_flops(target, drafter, 1, 1 if unroll is None else unroll)
            seconds = total / (mfu * peak)
            label = kind if unroll is None else f"{kind} k={unroll}"
            share, hours = target_pass_flops(target) / total, seconds * 1e5 / 3600
            lines.append(
                f"| {name} | {label} | {target.num_layers} | {total / 1e12:.2f} | {share:.0%} | "
                f"{seconds * 1e3:.1f} | {hours:.2f} |"
            )
    return "\n".join(lines)


@contextlib.contextmanager
def timed(clock: list[float], device: torch.device) -> Iterator[None]:
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    clock.append(time.perf_counter() - start)


class PhaseClock:
    """The phases of a step: CUDA events on a GPU (nothing inside the step waits for them), the host clock
    on a CPU. ``collect`` after the step's own synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any, Any]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        yield
        self.marks.append((name, start, self._now()))

    def wrap(self, owner: object, attribute: str, name: str) -> None:
        """Count every call of ``owner.attribute`` as phase ``name``."""
        call = getattr(owner, attribute)

        def timed_call(*args, **kwargs):
            with self.phase(name):
                return call(*args, **kwargs)

        setattr(owner, attribute, timed_call)

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last ``collect``."""
        spent: dict[str, float] = defaultdict(float)
        for name, start, end in self.marks:
            spent[name] += start.elapsed_time(end) / 1e3 if self.cuda else end - start
        self.marks.clear()
        return spent


def loss_peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The most bytes ``run`` had allocated at once beyond what was allocated when it started. A GPU: the
    caching allocator's peak. A CPU: every allocation and free of tensor memory, as torch's profiler
    records them (``profile_memory``: the CPU allocator reports each one), replayed in order."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as profile:
        run()
    live = peak = 0
    for _, action, _, size in profile._memory_profile().timeline:  # the timeline export_memory_timeline draws
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def reference_losses() -> ModuleType:
    """tests/reference_losses.py: the loss before the chunked head loss, kept as the tests' reference."""
    path = Path(__file__).resolve().parents[1] / "tests" / "reference_losses.py"
    spec = importlib.util.spec_from_file_location("reference_losses", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_score(
    reference: ModuleType, module: DrafterModule, steps: list[torch.Tensor], hidden: torch.Tensor, cond_mask
) -> tuple[torch.Tensor, dict]:
    """``DrafterModule.score`` as the reference loss computes it."""
    cfg, drafter = module.train_cfg, module.drafter
    mask = image_target_mask(cond_mask, hidden.shape[1] - cond_mask.shape[1])
    if drafter.unroll_steps(cfg.ttt_steps) is None:
        return reference.drafter_loss(steps[0], hidden[:, 1:], drafter.logits, mask, cfg.w_cls, cfg.cls_loss)
    chains = [chain_rows(cond_mask, mask.shape[1], j) for j in range(len(steps))]
    w_feature = cfg.w_feature if drafter.feature_loss else 0.0
    return reference.unrolled_loss(
        steps,
        hidden[:, 1:],
        drafter.normed,
        drafter.head_logits,
        mask,
        chains,
        cfg.ttt_decay,
        w_feature,
        cfg.cls_loss,
    )


@dataclass
class LossCost:
    peak_mb: float | None
    reference_peak_mb: float | None
    ms: float | None
    reference_ms: float | None


def loss_cost(
    module: DrafterModule, batch: dict, autocast, device: torch.device, reference: ModuleType | None
) -> LossCost:
    """The loss alone, forward and backward, on one batch's drafter passes: its peak memory and, with the
    ``reference`` loss, the reference's, and both timed alternately (best of 3)."""
    size = len(batch["caption"])
    tokens, cond_mask, states = module.prepare(batch, torch.zeros(size, dtype=torch.bool))
    hidden, tapped = split_taps(states, module.target.hidden_size, len(module.drafter.taps))
    with autocast, torch.no_grad():
        passes = module.drafter_passes(tokens, cond_mask, hidden, tapped)
    steps = [f_hat.detach().requires_grad_() for f_hat in passes]
    prefix = cond_mask.shape[1]

    def chunked() -> None:
        with autocast:
            loss, _ = module.score(steps, hidden, prefix)
        loss.backward()

    def whole() -> None:
        with autocast:
            loss, _ = reference_score(reference, module, steps, hidden, cond_mask)
        loss.backward()

    runs = {"chunked": chunked} if reference is None else {"chunked": chunked, "reference": whole}
    peaks = {name: loss_peak_bytes(run, device) / 2**20 for name, run in runs.items()}
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(3 if reference is not None else 0):
        for name, run in runs.items():
            with timed(times[name], device):
                run()
    best = {name: min(spent) * 1e3 for name, spent in times.items()}
    return LossCost(peaks["chunked"], peaks.get("reference"), best.get("chunked"), best.get("reference"))


def graph_breaks(module: DrafterModule, batch: dict, autocast) -> int:
    """Graph breaks ``torch._dynamo.explain`` finds in what ``trainer.compile`` compiles (the drafter's
    passes and loss) on one batch."""
    size = len(batch["caption"])
    tokens, cond_mask, states = module.prepare(batch, torch.zeros(size, dtype=torch.bool))
    hidden, tapped = split_taps(states, module.target.hidden_size, len(module.drafter.taps))
    with autocast:
        roots = module.drafter.training_roots(tokens.shape[1], None, tokens.device)
        inputs = LossInputs(tokens, cond_mask, hidden, hidden, tapped, roots)
        explained = torch._dynamo.explain(module.drafter_loss)(inputs)
    torch._dynamo.reset()
    return explained.graph_break_count


class Runner:
    """``fit``'s step for one row (target, mode, dtype, batch, drafter kind): ``step`` runs one, ``row`` sums
    them up. ``measure`` steps the rows that differ only by mode in turn, so a shared machine's load falls on
    each alike."""

    def __init__(
        self,
        name: str,
        mode: str,
        dtype: str,
        batch: int,
        device: torch.device,
        seed: int,
        kind: str,
        ttt_steps: int,
        max_steps: int,
        *,
        layers: int | None = None,
        features: str = "online",
    ) -> None:
        self.name = name if layers is None else f"{name} ({layers} layers)"
        self.mode, self.dtype, self.batch, self.device = mode, dtype, batch, device
        self.ttt_steps = ttt_steps
        target, drafter = build(name, device, dtype, seed, kind, layers)
        train = DrafterTrainConfig(kind=kind, ttt_steps=ttt_steps)
        module = DrafterModule(
            target,
            drafter,
            train,
            OptimConfig(),
            features=features,
            max_steps=max_steps,
            compile=mode == "compiled",
        )
        module.to(device)
        module.on_fit_start()  # places the target, as fit does
        self.module = module
        params = [p for p in module.drafter.parameters() if p.requires_grad]
        fused = device.type == "cuda"  # as DrafterModule.configure_optimizers
        optimizer = torch.optim.AdamW(params, lr=OptimConfig().lr, fused=fused or None)
        if mode == "zero2":
            import deepspeed  # GPU only: ZeRO shards the optimizer state across ranks (here one)

            for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0"}.items():
                os.environ.setdefault(key, value)
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
            config = {
                "train_micro_batch_size_per_gpu": batch,
                "zero_optimization": {"stage": 2},
                "bf16": {"enabled": dtype == "bf16"},
            }
            # torch's AdamW handed over, as Lightning's strategy hands fit's: DeepSpeed's own AdamW is a
            # CUDA op that a wheel built without ops would compile at first use.
            engine, *_ = deepspeed.initialize(model=module.drafter, optimizer=optimizer, config=config)
            self.backward, self.optimize = engine.backward, engine.step
        else:

            def optimize() -> None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            self.backward, self.optimize = torch.Tensor.backward, optimize
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(target.vocab_size, (batch, target.num_image_tokens), generator=generator)
        self.data = {"tokens": tokens.to(device), "caption": [""] * batch}
        if features == "offline":  # data_prep.features' shards: the target ran once, before training
            cond = target.encode_captions(self.data["caption"])
            with torch.no_grad():
                feats = target.sequence_features(cond, self.data["tokens"], drafter.taps)
            self.data.update(feats=feats, feats_mask=cond.mask)
        self.autocast = torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bf16")
        self.clock = PhaseClock(device)
        self.step_times: list[float] = []
        self.phases: list[dict[str, float]] = []

    def time_phases(self) -> None:
        """From now on, ``step`` times the module's phases (the wrappers are host code: dynamo would not
        trace them, so nothing is traced or compiled after this but what ``trainer.compile`` compiles)."""
        self.clock.wrap(self.module, "prepare", "target")
        self.clock.wrap(self.module, "loss_on", "drafter_passes_and_loss")
        if self.times_loss():  # compiled, the passes and the loss are one graph
            self.clock.wrap(self.module, "score", "loss")

    def times_loss(self) -> bool:
        """Whether ``head+loss`` is a phase of its own: eager, and not a kind's own loss (the block kind's
        scores its rows inside it, counted under forward)."""
        own = type(self.module.drafter).training_loss is not Drafter.training_loss
        return self.mode != "compiled" and not own

    def step(self, i: int) -> None:
        with timed(self.step_times, self.device):
            with self.autocast:
                loss, _ = self.module.loss(self.data, torch.Generator().manual_seed(i))
            with self.clock.phase("backward"):
                self.backward(loss)
            with self.clock.phase("optimizer"):
                self.optimize()
        self.phases.append(self.clock.collect())

    def row(self, warmup: int, breaks: int | None, cost: LossCost) -> Row:
        steps = len(self.step_times) - warmup
        step_s = sum(self.step_times[warmup:]) / steps
        spent = {name: sum(p.get(name, 0.0) for p in self.phases[warmup:]) / steps for name in PHASES}
        target, drafter = self.module.target, self.module.drafter
        unroll = drafter.unroll_steps(self.ttt_steps)  # None: teacher-forced, one pass
        unrolled = 1 if unroll is None else unroll
        flops = step_flops(target, drafter, self.batch, unrolled) / step_s
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_description(self.device)), None)
        loss_s = spent["loss"] if self.times_loss() else None
        kind = drafter.config.kind
        return Row(
            self.name,
            kind if unroll is None else f"{kind} k={unrolled}",
            self.mode,
            self.dtype,
            self.batch,
            steps,
            step_s * 1e3,
            spent["target"] * 1e3,
            (step_s - spent["target"]) * 1e3,
            (step_s - spent["target"]) / step_s,
            (spent["drafter_passes_and_loss"] - (loss_s or 0.0)) * 1e3,
            None if loss_s is None else loss_s * 1e3,
            spent["backward"] * 1e3,
            spent["optimizer"] * 1e3,
            self.batch / step_s,
            self.batch * target.num_image_tokens / step_s,
            flops / 1e12,
            flops / 1e12 / peak if peak and self.device.type == "cuda" else None,
            breaks,
            cost.peak_mb,
            cost.reference_peak_mb,
            cost.reference_ms,
            cost.ms,
        )


PHASES = ("target", "drafter_passes_and_loss", "loss", "backward", "optimizer")


def measure(
    name: str,
    modes: list[str],
    dtype: str,
    batch: int,
    steps: int,
    warmup: int,
    device: torch.device,
    seed: int,
    kind: str = "eagle1",
    ttt_steps: int = DrafterTrainConfig.ttt_steps,
    reference: ModuleType | None = None,
    layers: int | None = None,
    features: str = "online",
) -> list[Row]:
    """One row per mode, their steps taken in turn. The graph breaks and the loss's cost are the code's,
    whatever the mode: measured once, on the first mode's module, before any step; the loss's cost not for
    a kind with a loss of its own (the block kind's), which scores rows ``score`` does not."""
    runners = [
        Runner(
            name,
            mode,
            dtype,
            batch,
            device,
            seed,
            kind,
            ttt_steps,
            steps + warmup,
            layers=layers,
            features=features,
        )
        for mode in modes
    ]
    first = runners[0]
    breaks = graph_breaks(first.module, first.data, first.autocast)
    if type(first.module.drafter).training_loss is Drafter.training_loss:
        cost = loss_cost(first.module, first.data, first.autocast, device, reference)
    else:
        cost = LossCost(None, None, None, None)
    for runner in runners:
        runner.time_phases()
    for i in range(warmup + steps):
        for runner in runners:
            runner.step(i)
    return [runner.row(warmup, breaks, cost) for runner in runners]


def zero2_runs(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("deepspeed") is not None


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table(rows: list[Row], device: torch.device) -> str:
    lines = [
        f"device: {device_description(device)}, torch {torch.__version__}",
        "| target | drafter | mode | dtype | batch | step ms | target ms | drafter ms (share) | forward ms "
        "| head+loss ms | backward ms | optimizer ms | samples/s | TFLOP/s | MFU | graph breaks "
        "| loss peak MB (reference) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = "–" if r.mfu is None else f"{r.mfu:.0%}"
        reference = "" if r.reference_loss_peak_mb is None else f" ({r.reference_loss_peak_mb:.1f})"
        lines.append(
            f"| {r.target} | {r.drafter} | {r.mode} | {r.dtype} | {r.batch} | {r.step_ms:.1f} | "
            f"{r.target_ms:.1f} | {r.drafter_ms:.1f} ({r.drafter_share:.0%}) | {r.forward_ms:.1f} | "
            f"{_ms(r.loss_ms)} | {r.backward_ms:.1f} | {r.optimizer_ms:.1f} | {r.samples_per_s:.1f} | "
            f"{r.tflops:.2f} | {mfu} | {'–' if r.graph_breaks is None else r.graph_breaks} | "
            f"{_ms(r.loss_peak_mb)}{reference} |"
        )
    compared = {
        (r.target, r.drafter, r.dtype, r.batch): r for r in rows if r.reference_loss_peak_mb is not None
    }
    for r in compared.values():  # the loss's cost is measured once for all modes
        lines.append(
            f"{r.drafter} batch {r.batch}: the loss's peak memory "
            f"{r.loss_peak_mb / r.reference_loss_peak_mb:.2f}x the reference's; its forward and backward "
            f"{r.chunked_loss_ms:.1f} ms, the reference's {r.reference_loss_ms:.1f} ms "
            f"({r.reference_loss_ms / r.chunked_loss_ms:.2f}x)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", default=["small"], choices=["small", *EMBEDDED, *RANDOM])
    parser.add_argument(
        "--features",
        default="online",
        choices=["online", "offline"],
        help="offline: the target's features computed once, as data_prep.features' shards (target ms ~0)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="random targets: only this many decoder layers (a CPU run)"
    )
    parser.add_argument("--drafters", nargs="+", default=["eagle1"], choices=["eagle1", "eagle3", "block"])
    parser.add_argument("--ttt-steps", type=int, default=DrafterTrainConfig.ttt_steps, help="eagle3's unroll")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES)
    parser.add_argument("--dtype", nargs="+", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--reference-loss",
        action="store_true",
        help="also measure the loss before the chunked head loss (tests/reference_losses.py) side by side",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    parser.add_argument(
        "--project",
        type=float,
        default=None,
        metavar="MFU",
        help="instead: the FLOPs per sample at full depth and the time at this MFU on an H100 / H200",
    )
    args = parser.parse_args(argv)
    if args.project is not None:
        print(projection(args.targets, args.drafters, args.ttt_steps, args.project))
        return []
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = args.dtype or (["bf16"] if device.type == "cuda" else ["fp32"])  # CPUs run bf16 slowly
    reference = reference_losses() if args.reference_loss else None
    modes = [m for m in args.modes if m != "zero2" or zero2_runs(device)]
    if len(modes) < len(args.modes):
        print("zero2: skipped (DeepSpeed ZeRO needs a GPU and the deepspeed package)")
    rows = []
    for name in args.targets:
        for dtype in dtypes:
            for batch in args.batch:
                for kind in args.drafters:
                    measured = measure(
                        name,
                        modes,
                        dtype,
                        batch,
                        args.steps,
                        args.warmup,
                        device,
                        args.seed,
                        kind,
                        args.ttt_steps,
                        reference,
                        args.layers,
                        args.features,
                    )
                    rows += measured
                    for row in measured:
                        print(
                            f"{name} {row.drafter} {row.mode} {dtype} batch {batch}: "
                            f"{row.step_ms:.1f} ms/step, drafter {row.drafter_share:.0%}",
                            flush=True,
                        )
    print(table(rows, device))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": device_description(device),
                    "torch": torch.__version__,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
