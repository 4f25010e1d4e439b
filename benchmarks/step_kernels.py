"""What the step kernels cost: ATen ops per step outside the forwards, the ops that take the most time
there, and each kernel's call time eager and compiled (``vdtrain.decode.kernels``).

    python -m benchmarks.step_kernels                      # eagle2 on the shapes target, B = 1, CPU
    python -m benchmarks.step_kernels --preset sjd --batch 4 --backend inductor
    python -m benchmarks.step_kernels --target llamagen-b --calls 0   # real vocabulary; op table only
    python -m benchmarks.step_kernels --phases                 # kernels per step by phase, AR and presets

``--phases`` prints, for AR and every preset (or ``--presets``), the kernel-launching ATen ops per step
by region (``vdtrain.decode.phase_ops``) at LlamaGen-XL depth: 36 layers of width 64 and an 8×8 grid
(neither width nor grid changes the count), random weights, LlamaGen's sampling (CFG on, top-k 1000 of
16 384), B = 1, eager.

Without it, one decode (of held-out captions on the shapes target, of random caption features on the
random-weight targets of ``benchmarks.step_cost``) runs under a dispatch-level counter (forwards
excluded: the target's ``forward_tokens`` and the drafter's ``forward`` / ``logits``, as in
``PhaseTimer``) that also times each op outside the forwards (wall time around the call: on a CPU the
kernel's time, on a GPU only its launch), and records the first arguments each kernel of the engine and
its builder was called with. Each kernel is then called again with those arguments ``--calls`` times,
eagerly and compiled (after a warm-up call that compiles it), and the mean time per call is printed.
Kernels that change tensors in place (the commit) are timed on the same arguments again; their values do
not matter for the timing.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.step_cost import (
    EMBEDDED,
    RANDOM,
    _generators,
    _now,
    conditions,
    drafter_for,
    load,
    random_llamagen,
)
from vdtrain.decode.kernels import compiled_step_kernels
from vdtrain.decode.methods import build_method, load_preset, preset_names
from vdtrain.decode.phase_ops import KernelWeights, PhaseOps, count_phase_ops
from vdtrain.decode.profiling import phase_methods

# LlamaGen-XL's depth at a width that decodes fast on a CPU: the kernel count does not depend on width.
# An 8×8 image grid (XL's is 16×16) for 4× fewer steps: the count per step does not depend on it either.
XL_DEPTH = {"n_layer": 36, "dim": 64, "n_head": 2, "block_size": 64}


class _Ops(TorchDispatchMode):
    """ATen ops outside the forwards, per engine step, and the seconds spent in each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.in_forward, self.ops, self.marks = 0, 0, [0]
        self.seconds: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_forward:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[str(func.overloadpacket)] += time.perf_counter() - start
        return out

    def on_step(self, *_: object) -> None:
        self.marks.append(self.ops)
        if len(self.marks) == 2:  # the first step (it holds the prefill) ends: time from here on
            self.seconds.clear()


def _excluded(mode: _Ops, method: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        mode.in_forward += 1
        try:
            return method(*args, **kwargs)
        finally:
            mode.in_forward -= 1

    return run


def _recorder(label: str, method: Callable, seen: dict, calls: Counter) -> Callable:
    """``method`` that keeps its first arguments in ``seen[label]`` and counts its calls."""

    def run(*args: Any, **kwargs: Any) -> Any:
        seen.setdefault(label, (args, kwargs))
        calls[label] += 1
        return method(*args, **kwargs)

    return run


def _kernels(engine: Any) -> dict[str, tuple[Any, str, Callable[..., Any]]]:
    """``Owner.name`` → (owner, attribute, the kernel as a function of its call's arguments) of every step
    kernel of the engine, its builder, and the row functions the engine's module calls (``rows.*``)."""
    found = {}
    for owner in (engine, engine.builder):
        for name in dir(type(owner)):
            kernel = getattr(type(owner), name, None)
            if hasattr(kernel, "step_kernel"):
                found[f"{type(owner).__name__}.{name}"] = (owner, name, functools.partial(kernel, owner))
    module = sys.modules[type(engine).__module__]
    for name, kernel in vars(module).items():
        if hasattr(kernel, "step_kernel") and not isinstance(kernel, type):
            found[f"rows.{name}"] = (module, name, kernel)
    return found


def xl_depth_phase_ops(
    presets: list[str],
    seed: int = 0,
    cache_dir: str | None = None,
    grid: int = 8,
    temperature: float | None = None,
) -> dict[str, PhaseOps]:
    """Kernel ops per step by region for each preset (``ar`` included) at XL depth, B = 1, eager;
    ``cache_dir`` holds LANTERN's neighbour tables (default: the preset's); a ``grid`` × ``grid`` image;
    at ``temperature`` (None: LlamaGen's sampling; T = 0 runs other code)."""
    shape = {**XL_DEPTH, "block_size": grid * grid}
    target, drafter = random_llamagen("llamagen-xl", torch.device("cpu"), seed, shape)
    sampling = target.sampling_defaults
    if temperature is not None:
        sampling = replace(sampling, temperature=temperature)
    cond = conditions(target, "llamagen-xl", 1, 1, seed)[0]
    out = {}
    for name in presets:
        overrides = {"acceptance": {"cache_dir": cache_dir}} if cache_dir and name != "ar" else None
        config = load_preset(name, overrides)
        drafts = drafter_for(config, "llamagen-xl", target, drafter) if config.needs_drafter else None
        method = build_method(config, target, drafts, sampling)
        out[name] = count_phase_ops(method, cond, _generators(torch.device("cpu"), seed, 0, 1))
    return out


def phase_table(counts: dict[str, PhaseOps], weights: KernelWeights | None = None) -> str:
    """Markdown: per step, the total, the target's layers (and per layer), everything beyond them, and
    each region outside the layers; then the vocabulary-wide selections (64-bit ones in brackets) and the
    step and what lies beyond the layers weighed in ordinary kernels (``PhaseOps.weighted``)."""
    weights = weights or KernelWeights.load()
    outside = [r for r in next(iter(counts.values())).regions if r != "layers"]
    cols = ["method", "total", "layers", "per layer", "beyond layers", *outside]
    cols += ["selections (64-bit)", "weighted", "weighted beyond layers"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, c in counts.items():
        cells = [name, f"{c.total:.0f}", f"{c.regions['layers']:.0f}", f"{c.per_layer:.1f}"]
        cells += [f"{c.beyond_layers:.0f}", *(f"{c.regions[r]:.0f}" for r in outside)]
        weighted = c.weighted(weights)
        cells += [f"{c.vocabulary_selections:.0f} ({c.selections.get(64, 0):.0f})", f"{weighted:.0f}"]
        cells.append(f"{weighted - c.regions['layers']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="eagle2")
    parser.add_argument("--phases", action="store_true", help="the kernel table by phase at XL depth")
    parser.add_argument("--presets", nargs="+", default=None, help="--phases: these (default: all, AR first)")
    parser.add_argument("--temperature", type=float, default=None, help="--phases: default LlamaGen's (1)")
    parser.add_argument("--target", default="shapes", choices=[*EMBEDDED, *RANDOM])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled calls")
    parser.add_argument(
        "--calls", type=int, default=200, help="timed calls per kernel and mode (0: no kernel table)"
    )
    parser.add_argument("--top", type=int, default=12, help="rows of the op-time table")
    parser.add_argument("--drafter", default=None, help="default: checkpoints/<world>/drafter")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.phases:
        presets = args.presets or ["ar", *(n for n in preset_names() if n != "ar")]
        weights = KernelWeights.load()
        print("Kernel-launching ATen ops per step (views and metadata left out), LlamaGen-XL depth")
        print("(36 layers of width 64, an 8×8 grid), random weights, CFG on, B = 1, eager, steps after")
        print("the first; weighted: a vocabulary-wide selection as its price in ordinary kernels")
        print(f"({weights.source}):\n")
        print(phase_table(xl_depth_phase_ops(presets, args.seed, temperature=args.temperature), weights))
        return
    device = torch.device(args.device)
    target, drafter = load(args.target, device, args.drafter, args.seed)
    config = load_preset(args.preset)
    drafts = drafter_for(config, args.target, target, drafter) if config.needs_drafter else None
    engine = build_method(config, target, drafts, target.sampling_defaults)
    cond = conditions(target, args.target, args.batch, args.batch, args.seed)[0]
    gens = _generators(device, args.seed, 0, args.batch)

    counter, seen, calls = _Ops(), {}, Counter()
    kernels = _kernels(engine)
    for label, (owner, name, _) in kernels.items():
        setattr(owner, name, _recorder(label, getattr(owner, name), seen, calls))
    for owner, name in phase_methods(engine)["forward"]:
        setattr(owner, name, _excluded(counter, getattr(owner, name)))
    with torch.no_grad(), counter:
        engine.generate(cond, gens, on_step=counter.on_step, planned_batch=len(cond))
    # The wrappers go (the timed calls trace the kernels as decoding does): an instance's, and a module's
    # function put back.
    for owner, name, kernel in kernels.values():
        if isinstance(owner, types.ModuleType):
            setattr(owner, name, kernel)
        else:
            delattr(owner, name)
    for owner, name in phase_methods(engine)["forward"]:
        delattr(owner, name)
    steps = [b - a for a, b in pairwise(counter.marks[1:])]  # every step but the first (the prefill)
    ops = sum(steps) / len(steps)
    print(
        f"{args.preset}, B = {args.batch}, {args.target} target, {args.device}: "
        f"{len(steps)} steps after the first,"
    )
    print(f"{ops:.0f} ATen ops per step outside the forwards\n")

    per_step = len(steps)  # the times after the last step (reading the stats) are a small overstatement
    total = sum(counter.seconds.values())
    print(f"Time in ops outside the forwards: {total / per_step * 1e3:.2f} ms per step\n")
    print("| op | ms per step | share |")
    print("|---|---|---|")
    for op, seconds in counter.seconds.most_common(args.top):
        print(f"| {op} | {seconds / per_step * 1e3:.3f} | {seconds / total:.0%} |")
    if args.calls == 0:
        return
    print()

    print("| kernel | calls per step | eager µs | compiled µs |")
    print("|---|---|---|---|")
    for label, (_, _, kernel) in sorted(kernels.items()):
        if label not in seen:
            continue
        a, k = seen[label]
        times = []
        for enabled in (False, True):
            with torch.no_grad(), compiled_step_kernels(enabled, args.backend):
                kernel(*a, **k)  # warm-up (compiles when enabled)
                start = _now(device)
                for _ in range(args.calls):
                    kernel(*a, **k)
                times.append((_now(device) - start) / args.calls * 1e6)
        print(f"| {label} | {calls[label] / (len(steps) + 1):.1f} | {times[0]:.0f} | {times[1]:.0f} |")


if __name__ == "__main__":
    main()
