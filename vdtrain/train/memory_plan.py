"""The memory one training step and the after-epoch evaluation need on each GPU, planned before a job is
launched, without allocating the models (docs/training.md, "Memory plan").

How. The target and the drafter are built on the meta device (shapes, no bytes) and their tensors turned
into fake ones (torch's ``FakeTensorMode``). fit's own step then runs on them: ``DrafterModule.prepare``
(the target's pass under ``inference_mode``, the taps kept), the drafter's passes and its chunked loss
(``drafter.loss_chunks``), backward and AdamW's first step, under CPU autocast where ``trainer.precision``
is bf16. A dispatch mode (``LiveBytes``) counts every storage an op makes until it dies: its peak is the
step's. Tracing fit's own code rather than a formula keeps the plan right as kinds change (eagle3's
unrolled steps, the block kind's own loss, the loss's chunks) and costs seconds for a 7B target on a
CPU; shape arithmetic alone would restate every kind's passes. What no single process shows is arithmetic
on the drafter's parameter count P: the strategy's copies (DDP's gradient buckets; ZeRO's bf16 weights, fp32
master copy, moments and gradients in 1/N shards, its buckets, ZeRO-3's gathered layer) and the evaluation's
buffers. CPU autocast stands in for CUDA's (matmuls bf16, softmax, norms fp32); no allocator slack.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.drafters.base import Drafter
from vdtrain.targets.base import Condition, Target

GIB = 2**30
STRATEGIES = ("ddp", "deepspeed_stage_2", "deepspeed_stage_3")
# Lightning's DeepSpeedStrategy defaults (elements): the bf16 buckets ZeRO reduces and gathers through.
ZERO_BUCKET = 200_000_000


class PlanUnavailable(ValueError):
    """A step the plan cannot trace: a kind whose loss takes shapes from its data (fake tensors have none)."""


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops make, live and at their peak: an op's output is new unless it shares a
    storage with an input (a view, an in-place op) or was counted before; it is freed when its storage
    dies. Tensors made before the mode is entered (the weights) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if _tensor(t)}
        for t in tree_flatten(out)[0]:
            if not _tensor(t):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.sizes:
                continue
            self.sizes[key] = storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live


def _tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode) -> None:
    """Swap ``module``'s meta parameters and buffers for fake CPU tensors of ``mode`` in place: ops run on
    them under CPU autocast and allocate nothing."""
    convert = mode.fake_tensor_converter.from_meta_and_device
    cpu = torch.device("cpu")
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.device.type == "meta":
                m._parameters[name] = torch.nn.Parameter(convert(mode, p, cpu), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                m._buffers[name] = convert(mode, b, cpu)


def module_bytes(module: torch.nn.Module, trainable: bool | None = None) -> int:
    """Bytes of ``module``'s parameters (only those whose ``requires_grad`` is ``trainable``, if given) and,
    without ``trainable``, its buffers."""
    params = [p for p in module.parameters() if trainable is None or p.requires_grad == trainable]
    buffers = list(module.buffers()) if trainable is None else []
    return sum(t.numel() * t.element_size() for t in [*params, *buffers])


def planning_condition(target: Target, batch: int) -> Condition:
    """A condition of ``batch`` full-length prompts in the target's own form: prompt ids for the
    token-prompt families (Chameleon, Janus, Emu3), caption features for LlamaGen."""
    if hasattr(target, "condition_from_ids"):
        return target.condition_from_ids([[1] * target.prefix_length] * batch)
    width = target.gpt.config.caption_dim  # type: ignore[attr-defined]
    rows = (batch, target.prefix_length)
    return Condition(torch.zeros(*rows, width), torch.ones(rows, dtype=torch.bool))


@dataclass
class StepTrace:
    """What tracing one step of a single process found, in bytes."""

    params: int  # the drafter's trainable parameters (count, not bytes)
    target_weights: int  # the frozen target at its dtype (with its caption encoder, if it has one)
    drafter_weights: int  # the drafter's own weights, fp32 (the optimiser's)
    target_pass: int  # the target's pass: its peak beyond the weights (live layer, kept states and taps)
    states: int  # what the target's pass hands the drafter (final-norm states and taps, input dtype)
    drafter_pass: int  # the drafter's passes, loss and backward: peak beyond the states, gradients included
    gradients: int  # the fp32 gradients backward leaves
    optimizer: int  # AdamW's state after its first step (two fp32 moments)
    optimizer_step: int  # the optimiser step's peak beyond gradients and weights (moments and temporaries)


@contextmanager
def _captions(target: Target) -> Iterator[None]:
    """``target.encode_captions`` answers with ``planning_condition``: no tokenizer or text encoder runs."""
    target.encode_captions = lambda captions: planning_condition(target, len(captions))  # type: ignore[method-assign]
    try:
        yield
    finally:
        del target.encode_captions


def trace_step(
    target: Target,
    drafter: Drafter,
    train: DrafterTrainConfig,
    batch: int,
    precision: str = "32-true",
    fused_adamw: bool = False,
) -> StepTrace:
    """One training step of ``DrafterModule`` on ``target`` and ``drafter`` (built on the meta device,
    ``target`` at its training dtype), traced under ``FakeTensorMode`` (see the module docstring)."""
    from vdtrain.train.module import DrafterModule

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    module = DrafterModule(target, drafter, train, OptimConfig())
    fake_copy(target, mode)
    fake_copy(drafter, mode)
    half = precision.split("-")[0] in ("bf16", "16")  # fp16 autocast: the same bytes as bf16
    module.input_dtype = lambda: torch.bfloat16 if half else torch.float32  # type: ignore[method-assign]
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=half)
    params = [p for p in drafter.parameters() if p.requires_grad]
    tracker = LiveBytes()
    with mode, _captions(target), tracker:
        tokens = torch.randint(target.vocab_size, (batch, target.num_image_tokens))
        data = {"tokens": tokens, "caption": [""] * batch}
        generator = torch.Generator().manual_seed(0)
        with autocast:
            tokens, mask, states = module.training_inputs(data, generator)
        target_pass, kept = tracker.peak, tracker.live
        tracker.reset_peak()
        try:
            with autocast:
                loss, _ = module.loss_on(tokens, mask, states, generator, train.feature_noise)
        except (DynamicOutputShapeException, DataDependentOutputException) as err:
            raise PlanUnavailable(
                f"drafter.kind={drafter.config.kind}: its loss takes shapes from its data ({err.func}), "
                "which the memory plan's fake tensors cannot follow"
            ) from None
        loss.backward()
        del loss, tokens, mask, states
        drafter_pass = tracker.peak - kept
        gradients = sum(p.grad.nbytes for p in params if p.grad is not None)
        before = tracker.live
        tracker.reset_peak()
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw or None)
        optimizer.step()
        optimizer_step = tracker.peak - before
        moments = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    return StepTrace(
        params=sum(p.numel() for p in params),
        target_weights=module_bytes(target),
        drafter_weights=module_bytes(drafter, trainable=True),
        target_pass=target_pass,
        states=kept,
        drafter_pass=drafter_pass,
        gradients=gradients,
        optimizer=moments,
        optimizer_step=optimizer_step,
    )


@dataclass
class EvalTrace:
    """The after-epoch evaluation's buffers, in bytes (see ``trace_eval``)."""

    kv_cache: int  # the target's KV cache for both CFG streams (2 × batch) over prefix, image and tree
    drafter_cache: int  # the drafter's cache for the same rows
    prefill: int  # the largest forward of a decode: the prefill's peak beyond the caches (its logits too)
    verify: int  # one verification forward over the tree's rows, beyond the caches
    graph_pool: int  # the CUDA-graph pool of the recorded step (its verification forward's allocations)


def trace_eval(target: Target, drafter: Drafter, batch: int, tree_nodes: int) -> EvalTrace:
    """The evaluation's memory at ``batch`` prompts (with CFG 2 × ``batch`` rows) and a tree of ``tree_nodes``
    rows: the caches are allocated fake and measured; the prefill and one verification forward over the
    tree's rows are traced as ``trace_step`` traces. A recorded step (``cuda_graphs``) keeps its
    allocations in a private pool: modelled as one more verification forward."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_copy(target, mode)
    fake_copy(drafter, mode)
    rows = target.sampling_defaults.streams * batch  # CFG's conditional and unconditional streams
    with torch.inference_mode(), mode:
        cache = target.new_cache(rows, tree_nodes)
        dcache = drafter.new_cache(rows, target.max_seq_len + tree_nodes)
        cond = planning_condition(target, rows)
        with LiveBytes() as tracker:
            target.prefill(cond, cache)
        prefill = tracker.peak
        index = torch.arange(tree_nodes).expand(rows, -1)
        visibility = torch.ones(rows, tree_nodes, target.num_image_tokens, dtype=torch.bool)
        tokens = torch.zeros(rows, tree_nodes, dtype=torch.long)
        with LiveBytes() as tracker:
            target.forward_tokens(cond, tokens, index, cache, target.image_slot(index), visibility)
        verify = tracker.peak
    drafter_cache = 0 if dcache is None else dcache.kv.nbytes
    return EvalTrace(cache.kv.nbytes, drafter_cache, prefill, verify, verify)


@dataclass
class Plan:
    """Bytes per GPU, by part, for one strategy (``StepPlan.per_strategy``)."""

    strategy: str
    world: int
    parts: dict[str, int] = field(default_factory=dict)
    peak_step: int = 0  # the training step's peak
    peak_eval: int = 0  # the after-epoch evaluation's peak
    peak: int = 0


def strategy_plan(step: StepTrace, ev: EvalTrace | None, strategy: str, world: int, precision: str) -> Plan:
    """Per GPU under ``strategy`` over ``world`` GPUs, from one process's traces.

    ``ddp`` (``auto``: one GPU): the trace as it is, plus DDP's gradient buckets (a second fp32 copy of the
    gradients: Lightning leaves ``gradient_as_bucket_view`` off) when ``world`` > 1. ZeRO (DeepSpeed under
    bf16: the drafter's weights in bf16, an fp32 master copy): stage 2 shards the master copy, the moments
    and the fp32 gradients over ``world`` and reduces bf16 gradients through a bucket of at most
    ``ZERO_BUCKET`` elements; stage 3 shards the bf16 weights too, but gathers a layer whole for its
    forward and backward: a drafter is one layer, so all of it is gathered at the step's peak. The frozen
    target is not the module DeepSpeed wraps: every GPU holds all of it under every strategy."""
    if strategy not in (*STRATEGIES, "auto"):
        raise ValueError(f"strategy must be one of {STRATEGIES} or auto, got {strategy!r}")
    P, n = step.params, world
    half = precision.split("-")[0] in ("bf16", "16")
    fp32 = 4 * P
    if strategy.startswith("deepspeed"):
        weights = 2 * P if half else fp32
        master = fp32 // n if half else 0
        # the full gradients as backward makes them, the fp32 shard kept, the reduce bucket
        grads = weights + fp32 // n + 2 * min(ZERO_BUCKET, P)
        optimizer = 2 * fp32 // n
        gathered = 0
        if strategy.endswith("3"):
            gathered, weights = weights, weights // n  # the one layer gathered whole for its passes
        drafter_weights = weights + master + gathered
        step_temporaries = fp32 // n  # DeepSpeed steps its fp32 shard: one shard of temporaries
    else:
        drafter_weights, optimizer = step.drafter_weights, step.optimizer
        grads = step.gradients + (fp32 if n > 1 else 0)  # DDP's buckets: a second copy
        step_temporaries = step.optimizer_step - step.optimizer
    parts = {
        "target weights": step.target_weights,
        "drafter weights": drafter_weights,
        "gradients": grads,
        "optimizer": optimizer,
        "target pass": step.target_pass,
        "drafter pass": step.states + step.drafter_pass - step.gradients,
    }
    resident = step.target_weights + drafter_weights + optimizer
    step_peak = resident + max(step.target_pass, parts["drafter pass"] + grads, grads + step_temporaries)
    plan = Plan(strategy, world, parts, peak_step=step_peak)
    if ev is not None:
        parts["eval"] = ev.kv_cache + ev.drafter_cache + max(ev.prefill, ev.verify) + ev.graph_pool
        plan.peak_eval = resident + parts["eval"]
    plan.peak = max(plan.peak_step, plan.peak_eval)
    return plan


def plan_step(
    build: Callable[[], tuple[Target, Drafter]],
    train: DrafterTrainConfig,
    batch: int,
    precision: str,
    strategies: list[tuple[str, int]],
    *,
    eval_batch: int | None = None,
    tree_nodes: int = 59,
    fused_adamw: bool = False,
) -> list[Plan]:
    """The plan of each (strategy, world) in ``strategies``: ``build`` makes the target (at its training
    dtype) and the drafter on the meta device, once per trace (a trace swaps their tensors)."""
    step = trace_step(*build(), train, batch, precision, fused_adamw)
    ev = trace_eval(*build(), eval_batch, tree_nodes) if eval_batch else None
    return [strategy_plan(step, ev, name, world, precision) for name, world in strategies]


def describe(plans: list[Plan]) -> str:
    """The plans as a markdown table per GPU, in GiB (MiB when every peak is under 1 GiB)."""
    names = list(plans[0].parts)
    unit, size = ("GiB", GIB) if max(p.peak for p in plans) >= GIB else ("MiB", 2**20)
    lines = [
        f"| strategy | GPUs | {' | '.join(names)} | step peak | eval peak | peak ({unit}) |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]
    for p in plans:
        values = [p.parts[k] for k in names] + [p.peak_step, p.peak_eval, p.peak]
        cells = " | ".join(f"{v / size:.2f}" for v in values)
        lines.append(f"| {p.strategy} | {p.world} | {cells} |")
    return "\n".join(lines)


# --- fit's plan: python -m vdtrain.fit ... plan=true, and preflight's check ---------------------------
def fit_world(cfg) -> int:
    """GPUs (processes) of a fit run: ``trainer.devices`` (a count, a list, or -1 / auto: every visible
    GPU) × ``trainer.num_nodes``."""
    devices = cfg.trainer.devices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if devices in (-1, "auto"):
        devices = max(1, torch.cuda.device_count())
    count = len(devices) if not isinstance(devices, int) else devices
    return count * int(cfg.trainer.num_nodes)


def fit_strategy(cfg, world: int) -> str:
    """``trainer.strategy`` as the plan names it: ddp_cpu is ddp; auto is ddp over several devices."""
    name = str(cfg.trainer.strategy)
    return "ddp" if name == "ddp_cpu" or (name == "auto" and world > 1) else name


def fit_tree_nodes(cfg) -> int:
    """The largest tree the after-epoch evaluation's methods verify (their presets with the target's own
    knobs); 1 for methods without a tree."""
    from vdtrain.decode.methods import load_preset
    from vdtrain.target_settings import world_knobs

    knobs = world_knobs(cfg.target)
    sizes = [getattr(load_preset(m, knobs.get(m)).tree, "total_tokens", 1) for m in cfg.eval.methods]
    return max([1, *sizes])


def plan_for_fit(cfg) -> Plan:
    """The plan of a composed fit config: its target (built on the meta device from its config, at
    ``trainer.target_dtype``), drafter, batch, precision, strategy and GPUs, and its after-epoch evaluation
    when ``eval.enabled``."""
    from omegaconf import OmegaConf

    from vdtrain.targets.registry import inference_dtype, load_target
    from vdtrain.train.fit_parts import build_drafter, frozen_dtype

    def build() -> tuple[Target, Drafter]:
        target = load_target(OmegaConf.to_container(cfg.target, resolve=True), "meta")
        target = target.use_dtype(inference_dtype(frozen_dtype(cfg)))
        return target, build_drafter(cfg, target).to("meta")

    train = DrafterTrainConfig(**OmegaConf.to_container(cfg.drafter, resolve=True))
    precision = str(cfg.trainer.precision)
    fused = cfg.trainer.accelerator in ("gpu", "cuda") and precision != "16-mixed"
    eval_batch = cfg.eval.batch_size if cfg.eval.enabled else None
    tree = fit_tree_nodes(cfg) if cfg.eval.enabled else 1
    world = fit_world(cfg)
    strategy = (fit_strategy(cfg, world), world)
    return plan_step(
        build,
        train,
        cfg.data.batch_size,
        precision,
        [strategy],
        eval_batch=eval_batch,
        tree_nodes=tree,
        fused_adamw=fused,
    )[0]


def device_memory(cfg) -> float | None:
    """Bytes of one device's memory the plan must fit: ``trainer.device_memory_gib``, else on a GPU run
    the first GPU's total as torch.cuda reports it; None (no check) on a CPU without the setting."""
    if cfg.trainer.device_memory_gib is not None:
        return float(cfg.trainer.device_memory_gib) * GIB
    if cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def what_to_change(plan: Plan, target_dtype: str) -> str:
    """The setting that shrinks the plan's largest part that a setting can shrink."""
    if plan.peak_eval > plan.peak_step:
        return "lower eval.batch_size (or set eval.enabled=false)"
    sharding = {"ddp": "use trainer=deepspeed_stage_2", "deepspeed_stage_2": "use trainer=deepspeed_stage_3"}
    hints = {
        "target pass": "lower data.batch_size",
        "drafter pass": "lower data.batch_size (or drafter.ttt_steps, an unrolled kind's), or raise "
        "drafter.loss_chunks",
        "gradients": sharding.get(plan.strategy),
        "optimizer": sharding.get(plan.strategy),
        "drafter weights": sharding.get(plan.strategy),
        "target weights": "set trainer.target_dtype=bf16" if target_dtype == "fp32" else None,
    }
    ranked = sorted((k for k in hints if hints[k]), key=lambda k: -plan.parts[k])
    return hints[ranked[0]] if ranked else "lower data.batch_size"


def check_fits(plan: Plan, limit: float, source: str, target_dtype: str = "bf16") -> None:
    """Refuse, in one line naming what to change, a plan whose peak exceeds ``limit`` bytes."""
    if plan.peak <= limit:
        return
    largest = sorted(plan.parts.items(), key=lambda kv: -kv[1])[:3]
    shown = ", ".join(f"{k} {v / GIB:.1f}" for k, v in largest)
    raise ValueError(
        f"the memory plan's peak is {plan.peak / GIB:.1f} GiB per GPU ({shown} GiB; {plan.strategy} on "
        f"{plan.world}), over the {limit / GIB:.1f} GiB of {source}: {what_to_change(plan, target_dtype)} "
        "(python -m vdtrain.fit ... plan=true prints the plan)"
    )
