"""Kernel-launching ATen ops per decoding step, split by where they run (issue #33's kernel budget).

A replayed GPU step is bound by how many kernels it launches, not by bytes, so the budget is counted in
ATen ops that launch a kernel: views and metadata ops (``view``, ``expand``, ``split``, ``empty`` ...)
are left out, and ``F.rms_norm`` counts as one op: a CUDA build of torch (2.8 on) runs it as one fused
kernel while a CPU build dispatches its pieces. Each op is charged to the innermost region it runs in: a
decoder layer of the target (``layers``), the rest of a target forward (``forward``: embeddings, mask,
RoPE gather, final norm, head), the drafter (``drafter``), the engine's phases (``draft`` / ``verify`` /
``accept`` / ``commit``, as in ``profiling.phase_methods``) or ``other`` (the loop, and AR's sampling and
RNG). ``benchmarks.step_kernels --phases`` prints the table; docs/decoding.md, "Kernels per step", has it
and the budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vdtrain.decode.profiling import PHASES, phase_methods

_aten = torch.ops.aten
# Ops that return new storage but launch no kernel: allocations and reinterpretations.
_METADATA = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten._unsafe_view.default,
        _aten.lift_fresh.default,
        _aten.detach.default,
        _aten.alias.default,
    }
)
# Functions a CUDA build runs as one kernel whose CPU build dispatches several ops.
_ONE_KERNEL_ON_GPU = frozenset({F.rms_norm, torch.rms_norm})
REGIONS = ("layers", "forward", "drafter", *PHASES, "other")


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches a kernel on a GPU: not a view (every output aliases an input without
    writing it) and not a metadata op."""
    if func in _METADATA or func.is_view:
        return False
    returns = func._schema.returns
    return not returns or not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class PhaseOps:
    """Mean kernel ops per step (the first step, which holds the prefill, left out) by region, and the
    target's decoder layer count."""

    regions: dict[str, float]
    num_layers: int
    steps: int

    @property
    def total(self) -> float:
        return sum(self.regions.values())

    @property
    def per_layer(self) -> float:
        return self.regions["layers"] / self.num_layers

    @property
    def beyond_layers(self) -> float:
        """Everything but the target's decoder layers: what a method adds to AR's layer work."""
        return self.total - self.regions["layers"]


class _OneKernel(TorchFunctionMode):
    """Charges each call of ``_ONE_KERNEL_ON_GPU`` as one op and hides its pieces from ``_Regions``."""

    def __init__(self, regions: _Regions) -> None:
        super().__init__()
        self.regions = regions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _ONE_KERNEL_ON_GPU:
            return func(*args, **(kwargs or {}))
        self.regions.counts[self.regions.stack[-1]] += 1
        self.regions.hidden += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.regions.hidden -= 1


class _Regions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.stack = ["other"]
        self.hidden = 0
        self.counts: Counter[str] = Counter()
        self.marks: list[Counter[str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.hidden and launches_kernel(func):
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def on_step(self, *_: object) -> None:
        self.marks.append(self.counts.copy())

    def wrap(self, region: str) -> Callable[[Callable], Callable]:
        def wrap(method: Callable) -> Callable:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.stack.append(region)
                try:
                    return method(*args, **kwargs)
                finally:
                    self.stack.pop()

            return counted

        return wrap


def decoder_layers(target: Any) -> nn.ModuleList:
    """The target's decoder layers: the longest ``ModuleList`` in its transformer."""
    lists = [m for m in target.transformer.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len)


def _places(method: Any) -> dict[str, list[tuple[Any, str]]]:
    """Region → (object, method name) of a speculative engine, or of AR (the target forward only)."""
    if not hasattr(method, "builder"):
        return {"forward": [(method.target, "forward_tokens")]}
    places = phase_methods(method)
    forwards = places.pop("forward")
    places["forward"] = forwards[:1]
    places["drafter"] = forwards[1:]
    return places


@contextmanager
def _instance_wrapped(obj: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        delattr(obj, name)


def count_phase_ops(method: Any, cond: Any, generators: Sequence[torch.Generator | None]) -> PhaseOps:
    """One ``method.generate`` (eager) under the region counter: mean kernel ops per step by region."""
    counter = _Regions()
    layers = decoder_layers(method.target)
    with ExitStack() as stack:
        for region, places in _places(method).items():
            for obj, name in places:
                stack.enter_context(_instance_wrapped(obj, name, counter.wrap(region)))
        for layer in layers:
            stack.enter_context(_layer_region(layer, counter))
        with torch.no_grad(), counter, _OneKernel(counter):
            method.generate(cond, generators, on_step=counter.on_step)
    steps = [b - a for a, b in pairwise(counter.marks)]  # every step after the first
    if not steps:
        raise ValueError("the decode finished in one step; nothing to count")
    regions = {r: sum(s[r] for s in steps) / len(steps) for r in REGIONS}
    return PhaseOps(regions, len(layers), len(steps))


@contextmanager
def _layer_region(layer: nn.Module, counter: _Regions) -> Iterator[None]:
    """Ops inside ``layer``'s forward are charged to ``layers``."""

    def enter(*_: object) -> None:
        counter.stack.append("layers")

    def leave(*_: object) -> None:  # returns None: the layer's output stays
        counter.stack.pop()

    pre, post = layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
