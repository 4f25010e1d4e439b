"""Kernel-launching ATen ops per decoding step, split by where they run (the kernel budget).

A replayed GPU step is bound by how many kernels it launches, so views and metadata ops are left out and
``F.rms_norm`` counts as one op (one fused kernel on CUDA). Each op is charged to the innermost region it
runs in: a target decoder layer (``layers``), the rest of a target forward (``forward``), the drafter, the
engine's phases (``draft`` / ``verify`` / ``accept`` / ``commit``) or ``other``; and also to the engine
phase it runs in, forwards included (``PhaseOps.phases``). Vocabulary-wide selections (``topk``, ``sort``,
``kthvalue`` over >= V columns), tens of ordinary kernels each on a GPU, are counted apart by key width,
and ``PhaseOps.weighted`` charges each at its H200 price (conf/benchmarks/kernel_weights.yaml).
``benchmarks.step_kernels --phases`` prints the table; docs/decoding.md, "Kernels per step" and
"Vocabulary-wide selections"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vdtrain.cli import CONF_DIR
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
# Ops that select along a dimension (``dim``, -1 by default): vocabulary-wide ones are weighed apart.
_SELECTIONS = frozenset({_aten.topk, _aten.sort, _aten.kthvalue})
KERNEL_WEIGHTS = CONF_DIR / "benchmarks" / "kernel_weights.yaml"


@dataclass(frozen=True)
class KernelWeights:
    """What a vocabulary-wide selection costs on a GPU in ordinary kernels: µs per selection by key width
    (bits) over µs per ordinary kernel, both from one measured profile (``source``)."""

    ordinary_kernel_us: float
    selection_us: dict[int, float]
    source: str

    @classmethod
    def load(cls, path: Path = KERNEL_WEIGHTS) -> KernelWeights:
        raw = yaml.safe_load(path.read_text())
        us = {int(bits): float(v) for bits, v in raw["selection_us"].items()}
        return cls(float(raw["ordinary_kernel_us"]), us, raw["source"])

    def selection(self, bits: int) -> float:
        """One vocabulary-wide selection on ``bits``-bit keys, in ordinary kernels."""
        if bits not in self.selection_us:
            raise ValueError(f"no measured price for a {bits}-bit selection ({self.source}); add one")
        return self.selection_us[bits] / self.ordinary_kernel_us


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches a kernel on a GPU: not a view (every output aliases an input without
    writing it) and not a metadata op."""
    if func in _METADATA or func.is_view:
        return False
    returns = func._schema.returns
    return not returns or not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class PhaseOps:
    """Mean kernel ops per step (the first step, which holds the prefill, left out) by region, the
    target's decoder layer count, and the mean vocabulary-wide selections per step by key width in bits
    (each also one op of its region)."""

    regions: dict[str, float]
    num_layers: int
    steps: int
    selections: dict[int, float] = field(default_factory=dict)
    # Per engine phase (``PHASES``, and ``other`` outside them): every op run inside it, forwards included,
    # and its vocabulary-wide selections by key width.
    phases: dict[str, float] = field(default_factory=dict)
    phase_selections: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def vocabulary_selections(self) -> float:
        return sum(self.selections.values())

    def weighted(self, weights: KernelWeights) -> float:
        """The step in ordinary kernels: every op one, a vocabulary-wide selection its measured price."""
        extra = sum(n * (weights.selection(bits) - 1) for bits, n in self.selections.items())
        return self.total + extra

    def weighted_phase(self, phase: str, weights: KernelWeights) -> float:
        """Engine ``phase``'s ops per step, forwards inside it included, in ordinary kernels (as
        ``weighted``)."""
        selections = self.phase_selections.get(phase, {})
        return self.phases[phase] + sum(n * (weights.selection(bits) - 1) for bits, n in selections.items())

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
        self.regions.charge()
        self.regions.hidden += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.regions.hidden -= 1


def selection_bits(func: torch._ops.OpOverload, args: tuple, kwargs: dict, vocab: int) -> int | None:
    """The key width in bits when ``func`` selects along a dimension of at least ``vocab`` entries
    (a vocabulary-wide ``topk`` / ``sort`` / ``kthvalue``), else None."""
    if func.overloadpacket not in _SELECTIONS:
        return None
    dim = -1
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dim":
            positional = not argument.kwarg_only and i < len(args)
            dim = args[i] if positional else kwargs.get("dim", -1)
    values = args[0]
    if values.dim() == 0 or values.shape[dim] < vocab:
        return None
    return values.element_size() * 8


class _Regions(TorchDispatchMode):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.stack = ["other"]
        self.hidden = 0
        self.counts: Counter[str] = Counter()
        self.selections: Counter[int] = Counter()
        self.in_phase: Counter[str] = Counter()  # by the engine phase the op runs in
        self.phase_selections: Counter[tuple[str, int]] = Counter()
        self.marks: list[tuple[Counter, ...]] = []

    def charge(self, bits: int | None = None) -> None:
        """One op to the innermost region and to the engine phase it runs in; ``bits``: a selection's."""
        phase = next((r for r in self.stack if r in PHASES), "other")
        self.counts[self.stack[-1]] += 1
        self.in_phase[phase] += 1
        if bits is not None:
            self.selections[bits] += 1
            self.phase_selections[phase, bits] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.hidden and launches_kernel(func):
            self.charge(selection_bits(func, args, kwargs or {}, self.vocab))
        return func(*args, **(kwargs or {}))

    def on_step(self, *_: object) -> None:
        counters = (self.counts, self.selections, self.in_phase, self.phase_selections)
        self.marks.append(tuple(c.copy() for c in counters))

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
    """One ``method.generate`` (eager) under the region counter: mean kernel ops per step by region, and
    the vocabulary-wide selections (over the target's vocabulary or more)."""
    counter = _Regions(method.target.vocab_size)
    layers = decoder_layers(method.target)
    with ExitStack() as stack:
        for region, places in _places(method).items():
            for obj, name in places:
                stack.enter_context(_instance_wrapped(obj, name, counter.wrap(region)))
        for layer in layers:
            stack.enter_context(_layer_region(layer, counter))
        with torch.no_grad(), counter, _OneKernel(counter):
            method.generate(cond, generators, on_step=counter.on_step, planned_batch=len(cond))
    # every step after the first: (regions, selections, phases, phase selections) counted in it
    steps = [tuple(y - x for x, y in zip(a, b, strict=True)) for a, b in pairwise(counter.marks)]
    if not steps:
        raise ValueError("the decode finished in one step; nothing to count")

    def mean(part: int, key: object) -> float:
        return sum(s[part][key] for s in steps) / len(steps)

    widths = sorted({bits for s in steps for bits in s[1]})
    phase_keys = sorted({key for s in steps for key in s[3]})
    phase_selections: dict[str, dict[int, float]] = {}
    for phase, bits in phase_keys:
        phase_selections.setdefault(phase, {})[bits] = mean(3, (phase, bits))
    return PhaseOps(
        {r: mean(0, r) for r in REGIONS},
        len(layers),
        len(steps),
        {bits: mean(1, bits) for bits in widths},
        {p: mean(2, p) for p in (*PHASES, "other")},
        phase_selections,
    )


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
