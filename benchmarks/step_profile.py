"""Where a decode step's kernels go: a ``torch.profiler`` trace of a few steps per method, summarised as
kernels and µs per phase and per kernel name.

    python -m benchmarks.step_profile --device cuda --target llamagen-xl --dtype bf16 --presets eagle2 sjd
    python -m benchmarks.step_profile                  # CPU, shapes target: leaf ATen ops instead of kernels

Two passes per method (AR and each preset), each tracing ``--steps`` steps after ``--skip`` warm ones:

- ``eager``: every phase (draft / verify / accept / commit, and AR's forward) wrapped in a profiler range
  with a device sync at both ends, so each kernel runs inside the range of the phase that launched it.
  ``other`` is what runs outside every phase (loop bookkeeping, AR's sampling); ``forward`` counts the
  kernels inside target and drafter forwards, across phases. A replay runs these same kernels.
- ``graphs`` (CUDA only): the steps recorded as CUDA graphs (``cuda_graphs``, the default on a GPU) and
  replayed; a replay has no phases, so this pass gives the step's kernels, their device µs and the step's
  wall µs (profiler on, a sync at each end of the window).
- ``graph phases`` (CUDA only): the same kernels recorded as consecutive CUDA graphs cut where a phase
  begins and ends (``PhaseSegments``), each replayed inside its phase's range with a sync at both ends:
  the phase split of a replayed step (a launch per segment more than one whole graph).

Every pass lists the five costliest kernels of each phase.

On a CPU the unit is a leaf ATen op (an op that calls no other; views included), timed on the host: the
script's own test. ``benchmarks/README.md`` says how the GPU check runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.step_cost import EMBEDDED, RANDOM, conditions, load
from vdtrain.decode.compiled import DecodeOptions, cuda_graph_recorder
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.phase_ops import launches_kernel
from vdtrain.decode.profiling import PHASES, _wrapped, phase_methods

RANGE = "vdtrain."  # prefix of this script's profiler ranges


class _Done(Exception):
    """Raised from the step hook once the window is traced: the rest of the decode is not needed."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _places(method: Any) -> dict[str, list[tuple[Any, str]]]:
    """The phases to wrap: the engine's (``phase_methods``), or AR's forward alone."""
    if isinstance(method, SpeculativeEngine):
        return phase_methods(method)
    return {"forward": [(method.target, "forward_tokens")]}


@contextmanager
def phase_ranges(method: Any, device: torch.device) -> Iterator[None]:
    """Each phase method runs inside ``record_function("vdtrain.<phase>")``, synced at both ends."""

    def ranged(name: str) -> Callable[[Callable], Callable]:
        def wrap(inner: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:
                _sync(device)
                with record_function(RANGE + name):
                    out = inner(*args, **kwargs)
                    _sync(device)
                return out

            return run

        return wrap

    with ExitStack() as stack:
        for name, places in _places(method).items():
            for obj, attr in places:
                stack.enter_context(_wrapped(obj, attr, ranged(name)))
        yield


class PhaseSegments:
    """A step recorder (``DecodeOptions.step_recorder``) that cuts the recording where a phase of ``method``
    (``bind``) begins or ends: consecutive graphs, replayed in order on the same tensors, each inside
    ``around(label)``. ``new_graph()`` makes a graph with ``capture_begin()``, ``capture_end()`` and
    ``replay()``; the recording runs inside ``capturing(stream)``. A cut where no kernel was launched since
    the last one relabels the open graph instead (no empty graph is replayed); work outside every phase is
    ``other``, AR's forward ``forward``."""

    def __init__(
        self,
        new_graph: Callable[[], Any],
        around: Callable[[str], AbstractContextManager],
        capturing: Callable[[Any], AbstractContextManager] = lambda stream: nullcontext(),
    ) -> None:
        self.new_graph, self.around, self.capturing = new_graph, around, capturing
        self.method: Any = None
        self.labels: list[str] = []  # the last recording's segments, in order

    def bind(self, method: Any) -> PhaseSegments:
        self.method = method
        return self

    def __call__(self, step: Callable[[], Any], stream: Any) -> tuple[Any, Callable[[], None], bool]:
        segments: list[list] = []  # [label, graph, kernels launched in it]
        depth = 0

        def cut(label: str) -> None:
            if segments and segments[-1][2] == 0:
                segments[-1][0] = label
                return
            if segments:
                segments[-1][1].capture_end()
            graph = self.new_graph()
            graph.capture_begin()
            segments.append([label, graph, 0])

        def bounded(label: str) -> Callable[[Callable], Callable]:
            def wrap(inner: Callable) -> Callable:
                def run(*args: Any, **kwargs: Any) -> Any:
                    nonlocal depth
                    depth += 1
                    if depth == 1:
                        cut(label)
                    try:
                        return inner(*args, **kwargs)
                    finally:
                        depth -= 1
                        if depth == 0:
                            cut("other")

                return run

            return wrap

        with ExitStack() as stack:
            stack.enter_context(self.capturing(stream))
            for label, places in _places(self.method).items():
                if label == "forward" and isinstance(self.method, SpeculativeEngine):
                    continue  # a speculative step's forwards run inside its phases
                for obj, attr in places:
                    stack.enter_context(_wrapped(obj, attr, bounded(label)))
            stack.enter_context(_Launches(segments))
            cut("other")
            result = step()
            with warnings.catch_warnings():  # an empty last graph is ended, then dropped
                warnings.simplefilter("ignore")
                segments[-1][1].capture_end()
        if segments[-1][2] == 0 and len(segments) > 1:
            segments.pop()
        self.labels = [label for label, _, _ in segments]

        def replay() -> None:
            for label, graph, _ in segments:
                with self.around(label):
                    graph.replay()

        return result, replay, False


class _Launches(TorchDispatchMode):
    """Counts the kernel-launching ops of the open segment (``PhaseSegments``)."""

    def __init__(self, segments: list[list]) -> None:
        super().__init__()
        self.segments = segments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            self.segments[-1][2] += 1
        return func(*args, **(kwargs or {}))


class _PooledGraph:
    """A CUDA graph captured into a shared memory pool, so later segments read what earlier ones wrote."""

    def __init__(self, pool: Any) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture_begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def capture_end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


def cuda_phase_segments(device: torch.device) -> PhaseSegments:
    """``PhaseSegments`` of CUDA graphs in one memory pool, captured as ``record_cuda_graph`` captures (no
    compiling, cuBLAS workspaces cleared around it), each replay in its phase's profiler range with a sync
    at both ends, so its kernels fall inside it."""
    pool = torch.cuda.graph_pool_handle()

    @contextmanager
    def around(label: str) -> Iterator[None]:
        _sync(device)
        with record_function(RANGE + label):
            yield
            _sync(device)

    @contextmanager
    def capturing(stream: Any) -> Iterator[None]:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
        torch.cuda.synchronize(device)
        clear()
        # StepGraph gives only record_cuda_graph a stream of its own; a capture needs a side stream.
        side = stream if stream is not None else torch.cuda.Stream(device)
        with torch.compiler.set_stance("fail_on_recompile"), torch.cuda.stream(side):
            yield
        clear()

    return PhaseSegments(lambda: _PooledGraph(pool), around, capturing)


def trace(method: Any, cond, generators, skip: int, steps: int, device: torch.device, phases: bool):
    """The profiler over steps ``skip + 1 .. skip + steps`` of one decode (the decode stops there), with
    the wall seconds of that window."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    seen, window = 0, [0.0, 0.0]

    def on_step(*_: object) -> None:
        nonlocal seen
        seen += 1
        if seen == skip:
            prof.start()
            _sync(device)
            window[0] = time.perf_counter()
        elif seen == skip + steps:
            _sync(device)
            window[1] = time.perf_counter()
            prof.stop()
            raise _Done

    with ExitStack() as stack:
        if phases:
            stack.enter_context(phase_ranges(method, device))
        try:
            method.generate(cond, generators, on_step=on_step, planned_batch=len(cond))
        except _Done:
            return prof, window[1] - window[0]
    raise ValueError(f"the decode ended after {seen} steps, before step {skip + steps}")


def _units(prof, device: torch.device) -> list:
    """What a step launches: device activities (kernels, copies, sets) on a GPU; leaf ATen ops on a CPU."""
    events = prof.events()
    if device.type == "cuda":  # the GPU-side spans of this script's ranges are no work
        return [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(RANGE)]
    return [
        e
        for e in events
        if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
    ]


def _duration(e) -> float:
    return e.time_range.end - e.time_range.start


PER_PHASE = 5  # costliest kernel names listed per phase


def summarise(prof, device: torch.device, steps: int, wall_s: float, top: int) -> dict[str, Any]:
    """Per step: units, their µs (device time on a GPU, host time on a CPU), the window's wall µs; units
    and µs by phase (innermost range holding the unit's start) and by name (the ``top`` costliest), and
    the ``PER_PHASE`` costliest names of each phase."""
    ranges = [e for e in prof.events() if e.name.startswith(RANGE) and e.device_type == DeviceType.CPU]
    units = _units(prof, device)
    phase = defaultdict(lambda: [0, 0.0])
    names = defaultdict(lambda: [0, 0.0])
    phase_names: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for u in units:
        start, us = u.time_range.start, _duration(u)
        holding = [r for r in ranges if r.time_range.start <= start <= r.time_range.end]
        outer = [r for r in holding if r.name != RANGE + "forward"]
        where = min(outer, key=_duration).name[len(RANGE) :] if outer else "other"
        for key in {where, *(["forward"] if len(outer) < len(holding) else [])}:
            phase[key][0] += 1
            phase[key][1] += us
            phase_names[key][u.name][0] += 1
            phase_names[key][u.name][1] += us
        names[u.name][0] += 1
        names[u.name][1] += us
    per = lambda c: {"units": c[0] / steps, "us": c[1] / steps}  # noqa: E731
    costliest = lambda table, n: sorted(table.items(), key=lambda kv: -kv[1][1])[:n]  # noqa: E731
    order = [p for p in (*PHASES, "other", "forward") if p in phase]
    return {
        "units": len(units) / steps,
        "us": sum(_duration(u) for u in units) / steps,
        "wall_us": 1e6 * wall_s / steps,
        "phases": {p: per(phase[p]) for p in order},
        "names": [{"name": n, **per(c)} for n, c in costliest(names, top)],
        "phase_names": {
            p: [{"name": n, **per(c)} for n, c in costliest(phase_names[p], PER_PHASE)] for p in order
        },
    }


PASSES = ("eager", "graphs", "graph phases")  # the last two on a GPU only


def profile_method(target, drafter, name: str, cond, args, mode: str) -> dict[str, Any]:
    """One pass (``PASSES``) of one method; the recorded ones after a decode that records every step."""
    device = target.device
    segments = cuda_phase_segments(device) if mode == "graph phases" else None
    recorder = {"eager": None, "graphs": cuda_graph_recorder, "graph phases": lambda _: segments}[mode]
    options = DecodeOptions(step_recorder=None if recorder is None else recorder(target))
    sampling = target.sampling_defaults
    if args.temperature is not None:
        sampling = replace(sampling, temperature=args.temperature)
    method = build_method(load_preset(name), target, None if name == "ar" else drafter, sampling, options)
    if segments is not None:
        segments.bind(method)
    gens = lambda: [torch.Generator(device).manual_seed(args.seed + i) for i in range(len(cond))]  # noqa: E731
    if mode != "eager":
        method.generate(cond, gens(), planned_batch=len(cond))  # records every step shape
    prof, wall = trace(method, cond, gens(), args.skip, args.steps, device, phases=mode == "eager")
    return summarise(prof, device, args.steps, wall, args.top)


def table(results: dict[str, dict[str, Any]], unit: str) -> str:
    """Markdown: units and µs per step by phase, then the costliest names."""
    lines = [
        f"| method | pass | {unit} | µs | wall µs | "
        + " | ".join(f"{p} ({unit}/µs)" for p in (*PHASES, "other", "forward"))
        + " |"
    ]
    lines.append("|" + "---|" * (5 + len(PHASES) + 2))
    for method, passes in results.items():
        for mode, s in passes.items():
            cells = [
                f"{s['phases'][p]['units']:.0f} / {s['phases'][p]['us']:.0f}" if p in s["phases"] else "—"
                for p in (*PHASES, "other", "forward")
            ]
            lines.append(
                f"| {method} | {mode} | {s['units']:.0f} | {s['us']:.0f} | {s['wall_us']:.0f} | "
                + " | ".join(cells)
                + " |"
            )

    def named(ns: list[dict[str, Any]]) -> str:
        return "; ".join(
            f"{n['name'][:60]} {n['units']:.1f}×{n['us'] / max(n['units'], 1e-9):.1f} µs" for n in ns
        )

    for method, passes in results.items():
        for mode, s in passes.items():
            lines.append(f"\n{method}, {mode}: " + named(s["names"]))
            lines += [f"- {p}: {named(ns)}" for p, ns in s["phase_names"].items() if ns]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="shapes", choices=[*EMBEDDED, *RANDOM])
    parser.add_argument(
        "--presets", nargs="+", default=["eagle2", "sjd"], help="conf/decode presets; AR is always first"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--temperature", type=float, default=None, help="default: the target's")
    parser.add_argument("--drafter", default=None, help="default: checkpoints/<world>/drafter")
    parser.add_argument("--skip", type=int, default=3, help="steps decoded before the traced window")
    parser.add_argument("--steps", type=int, default=4, help="steps traced per method and pass")
    parser.add_argument("--top", type=int, default=12, help="kernel names listed per method and pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    if args.skip < 1 or args.steps < 1:
        parser.error("--skip and --steps must be >= 1")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    target, drafter = load(args.target, device, args.drafter, args.seed, args.dtype)
    cond = conditions(target, args.target, args.batch, args.batch, args.seed)[0]
    passes = PASSES if device.type == "cuda" else PASSES[:1]
    results: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name in ["ar", *args.presets]:
            results[name] = {}
            for mode in passes:
                results[name][mode] = profile_method(target, drafter, name, cond, args, mode)
                print(f"{name} {mode}: {results[name][mode]['units']:.0f} per step", flush=True)
    unit = "kernels" if device.type == "cuda" else "leaf ATen ops"
    print("\n" + table(results, unit))
    out = {
        "settings": {
            **vars(args),
            "unit": unit,
            "torch": torch.__version__,
            "command": " ".join(
                ["python -m benchmarks.step_profile", *(argv if argv is not None else sys.argv[1:])]
            ),
        },
        "methods": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
