"""Measuring the engine from outside: host synchronisations, ATen ops and phase times per step.

A speculative step is only fast on a GPU if the host never waits for the device. ``OpCounter`` counts
every read of a device value into Python (a sync) and every ATen op, on any device, split per engine step
through the ``on_step`` hook; host-to-device copies from pageable memory are counted apart (``h2d``).
``PhaseTimer`` times draft / verify / accept / commit by wrapping engine methods (``phase_methods``).
On a CPU the counter follows each tensor's provenance to count "as if on a GPU". docs/decoding.md, "Host
syncs and ATen ops per step", has the provenance rules; "Step cost" how ``benchmarks/step_cost.py`` uses
both.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

_aten = torch.ops.aten
# Data-dependent ATen ops: their result (or its size) must reach the host, so CUDA waits for the device.
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim_consecutive.default,
        _aten.equal.default,
        _aten.is_nonzero.default,
    }
)
# Python-level reads of a tensor's values: each is one sync when the tensor is on the device.
_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "numpy",
}
# Factories that copy host data: with an explicit device they are host-to-device copies.
_FROM_HOST_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_HERE = str(Path(__file__).resolve())
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


@dataclass
class Counts:
    """Host syncs, host-to-device copies and ATen ops over some stretch of execution."""

    syncs: int = 0
    h2d: int = 0
    ops: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def copy(self) -> Counts:
        return Counts(self.syncs, self.h2d, self.ops)


@dataclass
class StepCounts:
    """Counts split at the engine's step boundaries: ``first`` runs from the counter's start to the end of
    the first step (prefill included), ``steps[i]`` is step ``i + 2``, ``tail`` what ran after the last
    step (the loop's final exit test)."""

    first: Counts
    steps: list[Counts]
    tail: Counts

    @property
    def total(self) -> Counts:
        out = self.first + self.tail
        for step in self.steps:
            out = out + step
        return out

    @property
    def max_syncs(self) -> int:
        return max((s.syncs for s in self.steps), default=0)

    @property
    def mean_syncs(self) -> float:
        return sum(s.syncs for s in self.steps) / max(1, len(self.steps))

    @property
    def mean_ops(self) -> float:
        return sum(s.ops for s in self.steps) / max(1, len(self.steps))


def _call_site() -> str:
    """``file:line (function)`` of the innermost caller outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name == _HERE or name.startswith(_TORCH_DIR)):
            return f"{Path(name).name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


def _tensors(args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The tensors among the arguments, one list level deep (``torch.cat([a, b])``, ``t[i, j]``); kept
    shallow because it runs on every op."""
    out = []
    for x in (*args, *(kwargs or {}).values()):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
    return out


class _Functions(TorchFunctionMode):
    """Python level: value reads, device moves, and the provenance tags of the as-if-GPU mode."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        c, kwargs = self.counter, kwargs or {}
        inputs = _tensors(args, kwargs)
        if func in _READS:
            with c.quiet():
                out = func(*args, **kwargs)
            if c.on_device(args[0]):
                c.sync(_READS[func])
            return out
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return c.move(func, args, kwargs)
        device = kwargs.get("device")
        if func in _FROM_HOST_DATA and device is not None:
            with c.quiet():
                out = func(*args, **kwargs)
            source_on_host = not inputs or not c.on_device(inputs[0])
            if source_on_host and c.device_destination(device, None):
                c.h2d(func.__name__)
            c.tag(out, host=not c.device_destination(device, None))
            return out
        c.check_devices(func, inputs)
        out = func(*args, **kwargs)
        if c.as_if_gpu and isinstance(out, (torch.Tensor, tuple, list)):
            if inputs:
                c.tag(out, host=not any(c.on_device(t) for t in inputs))
            else:  # a factory: on the host unless given a device
                c.tag(out, host=device is None or not c.device_destination(device, None))
        return out


class _Dispatch(TorchDispatchMode):
    """ATen level: every op, the data-dependent ones and cross-device copies."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        c.counts.ops += 1
        if not c.quiet_depth:
            kind = self._sync_kind(func, args, kwargs or {})
            if kind == "h2d":
                c.h2d(str(func.overloadpacket.__name__))
            elif kind is not None:
                c.sync(kind)
        out = func(*args, **(kwargs or {}))
        if func is _aten.lift_fresh.default:  # a Python number made a tensor (``t[i] = 0.0``): host data
            c.tag(out, host=True)
        return out

    def _sync_kind(self, func, args, kwargs) -> str | None:
        c = self.counter
        if func in SYNC_OPS:
            return func.overloadpacket.__name__ if any(map(c.on_device, _tensors(args, kwargs))) else None
        packet = func.overloadpacket
        if packet in (_aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_):
            masks = [t for t in args[1] if t is not None and t.dtype in (torch.bool, torch.uint8)]
            if not masks or not (c.on_device(args[0]) or any(map(c.on_device, masks))):
                return None
            # ``t[mask] = scalar`` becomes a masked_fill (no sync); anything else turns masks into indices.
            if packet is not _aten.index and args[2].numel() == 1 and len(args[1]) == 1:
                return None
            return "bool-mask index"
        if packet is _aten.copy_:
            dst, src = c.on_device(args[0]), c.on_device(args[1])
            if dst and not src:  # a 0-dim source too: a capture refuses it (``fill_`` is the safe way)
                return "h2d"
            if src and not dst:
                return "copy to host"
        return None


class OpCounter:
    """Counts host syncs, host-to-device copies and ATen ops while active; ``on_step`` (the engine's
    ``on_step(target_cache, committed, tokens)`` hook) marks step boundaries for ``steps()``.

    ``as_if_gpu`` None: on when CUDA is unavailable, so a CPU run counts what a GPU run would.
    ``sites`` counts syncs by kind and source line (where to look when a budget fails).
    """

    def __init__(self, as_if_gpu: bool | None = None) -> None:
        self.as_if_gpu = (not torch.cuda.is_available()) if as_if_gpu is None else as_if_gpu
        self.counts = Counts()
        self.sites: Counter[str] = Counter()
        self.quiet_depth = 0
        self._host = WeakTensorKeyDictionary()
        self._marks: list[Counts] = []
        self._modes: tuple[_Functions, _Dispatch] | None = None

    # --- context ------------------------------------------------------------------------------------
    def __enter__(self) -> OpCounter:
        if self._modes is not None:
            raise RuntimeError("this OpCounter is already counting; make a new one to nest")
        self.counts, self.sites, self._marks = Counts(), Counter(), [Counts()]
        self._modes = (_Functions(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
        self._marks.append(self.counts.copy())

    def on_step(self, *_: object) -> None:
        """The engine's step hook: a step ended here."""
        self._marks.append(self.counts.copy())

    def steps(self) -> StepCounts:
        """Per-step counts; call after the counter has exited."""
        if self._modes is not None or len(self._marks) < 2:
            raise RuntimeError("steps() needs a finished count (leave the `with OpCounter()` block first)")
        marks = self._marks
        if len(marks) == 2:  # no step boundary seen: all of it is "first"
            return StepCounts(marks[1] - marks[0], [], Counts())
        diffs = [b - a for a, b in pairwise(marks)]
        return StepCounts(diffs[0], diffs[1:-1], diffs[-1])

    # --- classification (used by the modes) ------------------------------------------------------------
    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Ops inside an already-counted read or move are not counted again as syncs."""
        self.quiet_depth += 1
        try:
            yield
        finally:
            self.quiet_depth -= 1

    def on_device(self, t: torch.Tensor) -> bool:
        if self.as_if_gpu:  # a view made inside an op (``t[i] = v``) lives where its base does
            return t not in self._host and (t._base is None or t._base not in self._host)
        return t.device.type != "cpu"

    def device_destination(self, device: Any, tensor: torch.Tensor | None) -> bool:
        """Whether ``.to(device)`` / ``device=`` puts a tensor on the accelerator."""
        if isinstance(device, torch.Tensor):
            return self.on_device(device)
        if self.as_if_gpu:  # "cpu" spelled as a string means the host; a torch.device is the model's
            return not (isinstance(device, str) and device.split(":")[0] == "cpu")
        return torch.device(device).type != "cpu"

    def tag(self, out: Any, host: bool) -> None:
        if not self.as_if_gpu:
            return
        for t in _tensors((out,), None):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    def check_devices(self, func: Callable, inputs: Sequence[torch.Tensor]) -> None:
        """Called before every op with its tensor inputs; ``DeviceGuard`` refuses a mix of devices."""

    def sync(self, kind: str) -> None:
        self.counts.syncs += 1
        self.sites[f"{kind} @ {_call_site()}"] += 1

    def h2d(self, kind: str) -> None:
        self.counts.h2d += 1
        self.sites[f"h2d {kind} @ {_call_site()}"] += 1

    def move(self, func: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``.to`` / ``.cpu()`` / ``.cuda()``: a sync when device data reaches the host, an h2d copy the
        other way, free otherwise."""
        source = args[0]
        if func is torch.Tensor.cpu:
            destination: Any = "cpu"
        elif func is torch.Tensor.cuda:
            destination = "cuda"
        else:
            destination = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device, torch.Tensor)):
                    destination = a
        with self.quiet():
            out = func(*args, **kwargs)
        was_on_device = self.on_device(source)
        if destination is None:  # a dtype change stays where it was
            self.tag(out, host=not was_on_device)
            return out
        on_device = self.device_destination(destination, None)
        if self.as_if_gpu and on_device != was_on_device and out is source:
            with self.quiet():  # on a GPU a move between host and device is a new tensor, never a view
                out = source.clone()
        if was_on_device and not on_device:
            self.sync("cpu" if func is torch.Tensor.cpu else "to(cpu)")
        elif on_device and not was_on_device:
            self.h2d("to(device)")
        self.tag(out, host=not on_device)
        return out


def count_steps(
    engine: Any, cond: Any, generators: Sequence[torch.Generator | None], as_if_gpu: bool | None = None
) -> tuple[StepCounts, OpCounter]:
    """Run ``engine.generate`` under an ``OpCounter``; its per-step counts and the counter (``sites``)."""
    with OpCounter(as_if_gpu) as counter:
        engine.generate(cond, generators, on_step=counter.on_step, planned_batch=len(cond))
    return counter.steps(), counter


# --- phase times ------------------------------------------------------------------------------------
PHASES = ("draft", "verify", "accept", "commit")


def phase_methods(engine: Any) -> dict[str, list[tuple[Any, str]]]:
    """Where each phase lives in the engine: (object, method name) pairs. The one place to update when
    the engine renames them. ``forward`` (target and drafter forwards) overlaps the phases."""
    model = engine.drafting.drafter  # None: a drafter-free method
    drafter = [] if model is None else [(model, "forward"), (model, "logits")]
    return {
        "draft": [(engine.builder, "build"), (engine.builder, "observe")],
        "verify": [(engine, "target_forward")],
        "accept": [(engine, "judge")],
        "commit": [(engine, "commit"), (engine, "commit_unverified")],
        "forward": [(engine.target, "forward_tokens"), *drafter],
    }


@contextmanager
def _wrapped(obj: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``obj.name`` replaced by ``wrap(obj.name)`` on the instance, restored on exit."""
    had_own = name in vars(obj)
    original = vars(obj)[name] if had_own else None
    setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@dataclass
class StepTimes:
    """Seconds per engine step: wall time, the phases (exclusive: a phase called inside another is
    charged to itself), ``forward`` (target + drafter forwards, overlapping the phases) and whether the
    target verified in that step (a VVS step may skip it)."""

    seconds: float
    phases: dict[str, float]
    forward: float
    verified: bool

    @property
    def other(self) -> float:
        """Loop bookkeeping outside every phase."""
        return self.seconds - sum(self.phases.values())


class PhaseTimer:
    """Times the phases of ``engine`` while active; ``on_step`` is the engine's step hook.

    ``synchronize`` waits for the GPU at every phase boundary (on a CUDA engine), so queued kernels are
    charged to the phase that launched them; it adds syncs, so never combine it with ``OpCounter``.
    """

    def __init__(self, engine: Any, synchronize: bool = True) -> None:
        self.engine, self.synchronize = engine, synchronize
        self.totals: dict[str, float] = {}
        self._stack: list[str] = []  # phases being run, innermost last
        self._since = 0.0  # when the innermost phase was last charged
        self._forward_depth, self._forward_start = 0, 0.0
        self._marks: list[tuple[float, dict[str, float]]] = []
        self._exit: ExitStack | None = None

    def _now(self) -> float:
        device = self.engine.target.token_embedding.weight.device
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _charge(self, now: float) -> None:
        if self._stack:
            top = self._stack[-1]
            self.totals[top] = self.totals.get(top, 0.0) + now - self._since
        self._since = now

    def _phase(self, name: str) -> Callable[[Callable], Callable]:
        def wrap(method: Callable) -> Callable:
            def timed(*args: Any, **kwargs: Any) -> Any:
                self._charge(self._now())
                self._stack.append(name)
                if name == "verify":
                    self.totals["verify_calls"] = self.totals.get("verify_calls", 0.0) + 1
                try:
                    return method(*args, **kwargs)
                finally:
                    self._charge(self._now())
                    self._stack.pop()

            return timed

        return wrap

    def _forward(self, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._forward_depth += 1
            if self._forward_depth == 1:
                self._forward_start = self._now()
            try:
                return method(*args, **kwargs)
            finally:
                self._forward_depth -= 1
                if self._forward_depth == 0:
                    spent = self._now() - self._forward_start
                    self.totals["forward"] = self.totals.get("forward", 0.0) + spent

        return timed

    def __enter__(self) -> PhaseTimer:
        stack = ExitStack()
        for name, places in phase_methods(self.engine).items():
            wrap = self._forward if name == "forward" else self._phase(name)
            for obj, method in places:
                if not callable(getattr(obj, method, None)):
                    stack.close()
                    raise AttributeError(
                        f"{type(obj).__name__} has no method {method!r} for phase {name!r}: "
                        "update vdtrain.decode.profiling.phase_methods to the engine's current names"
                    )
                stack.enter_context(_wrapped(obj, method, wrap))
        self._exit, self.totals = stack, {}
        self._marks = [(self._now(), {})]
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()
        self._exit = None

    def on_step(self, *_: object) -> None:
        """The engine's step hook: a step ended here."""
        self._marks.append((self._now(), dict(self.totals)))

    def steps(self) -> tuple[StepTimes | None, list[StepTimes]]:
        """(the first step, prefill included; every later step)."""
        out = []
        for (t0, a), (t1, b) in pairwise(self._marks):
            d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in {*a, *b}}
            phases = {p: d.get(p, 0.0) for p in PHASES}
            out.append(StepTimes(t1 - t0, phases, d.get("forward", 0.0), d.get("verify_calls", 0.0) > 0))
        return (out[0] if out else None), out[1:]


# Ops a GPU runs on a device tensor with host operands: indexing with host indices or masks, copies
# (host-to-device copies are ``OpCounter``'s to count, not errors), and ``Module.to``'s metadata check.
_MIXED_DEVICES_ALLOWED = frozenset(
    {
        torch.Tensor.__getitem__,
        torch.Tensor.__setitem__,
        torch.Tensor.copy_,
        torch.Tensor.index_put_,
        torch._has_compatible_shallow_copy_type,
        torch.Tensor.data.__set__,
    }
)


class DeviceGuard(OpCounter):
    """``OpCounter``'s as-if-GPU provenance made strict: an op given a host tensor (one moved or made
    there: ``.cpu()``, a factory without ``device=``; ``torch.from_numpy`` escapes it) beside device
    tensors raises, as CUDA does ("Expected all tensors to be on the same device"). Tensors that exist
    before the guard is entered count as on the device, so models built outside it stand for models on a
    GPU. A CPU test wraps a user path in it to catch what would cross devices there; 0-dim host tensors
    pass, as on CUDA."""

    def __init__(self) -> None:
        super().__init__(as_if_gpu=True)

    def check_devices(self, func: Callable, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) < 2 or func in _MIXED_DEVICES_ALLOWED:
            return
        host = [t for t in inputs if t.dim() > 0 and not self.on_device(t)]
        if host and len(host) < len(inputs) and any(self.on_device(t) for t in inputs):
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"Expected all tensors to be on the same device (as on a GPU), but {name} got a host "
                f"tensor of shape {tuple(host[0].shape)} beside device tensors, at {_call_site()}"
            )
