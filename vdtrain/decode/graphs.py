"""A whole speculative step recorded once as a CUDA graph and replayed: one launch per step.

Compiling the forwards and the step kernels (``vdtrain.decode.kernels``) fuses a step's work into a few
dozen kernels, but each is still launched from Python: on a GPU that host time is about what the small
kernels of a decoding step take to run, so a step costs several AR steps however little it computes.
Every tensor of a step has a shape fixed by the method, the step reads the device only in the loop's
test (are prompts left?), and it changes the run's tensors in place (``DecodeRun``). So the whole step —
drafter rounds, tree building, the verification forward, acceptance, commit and the drafter's catch-up
— can be recorded once (``torch.cuda.graph``) and replayed each step with one launch, the way gpt-fast
replays a decoding step. What the step returns to the host (its drafter-call counts) is recorded with it:
a graph-safe method (``SpeculativeEngine.recorder``) returns the same every step.

``StepGraph`` runs the first ``warmup`` steps eagerly (on a side stream, as CUDA graph capture asks:
compiled code compiles and libraries allocate their workspaces there), records the next one and replays
it from then on. ``recording()`` is set while it does, so a compiled forward that would capture a CUDA
graph of its own (``reduce-overhead``, ``vdtrain.decode.compiled``) runs its plain compiled version
inside the step's graph instead. The engine keeps the recorded step with its run (``DecodeRun``): a
decode of the same shapes resets that run in place and replays the same graph. Tests record on the CPU
with ``record_fx`` (``make_fx``: the same op sequence replayed on the same tensors), which checks what
a CUDA graph needs without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
# record(step) → (what the step returned, replay, whether recording already ran the step once)
Recorder = Callable[[Callable[[], T]], tuple[T, Callable[[], object], bool]]

_RECORDING: ContextVar[bool] = ContextVar("vdtrain_recording_step", default=False)


def recording() -> bool:
    """True while a step is warmed up, recorded or replayed as a graph."""
    return _RECORDING.get()


@contextmanager
def _recording() -> Iterator[None]:
    token = _RECORDING.set(True)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def record_cuda_graph(step: Callable[[], T]) -> tuple[T, Callable[[], object], bool]:
    """``step`` captured as a CUDA graph on the current device; capture runs none of its kernels."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return result, graph.replay, False


def record_fx(step: Callable[[], T]) -> tuple[T, Callable[[], object], bool]:
    """``step`` traced into an FX graph of ATen ops (``make_fx``), replayed on the same tensors: a CPU
    stand-in for ``record_cuda_graph`` in tests. Tracing runs the step once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    box: list[T] = []

    def traced() -> list[torch.Tensor]:
        box.append(step())
        return []

    graph = make_fx(traced)()
    return box[0], graph, True


class StepGraph(Generic[T]):
    """``step`` eagerly for ``warmup`` calls, then recorded once with ``record`` and replayed."""

    def __init__(self, step: Callable[[], T], record: Recorder = record_cuda_graph, warmup: int = 2) -> None:
        self.step, self.record, self.warmup = step, record, warmup
        self.replay: Callable[[], object] | None = None
        self.result: T | None = None

    def __call__(self) -> T:
        if self.replay is not None:
            self.replay()
            return self.result
        with _recording():
            if self.warmup > 0:
                self.warmup -= 1
                return self._warm_up()
            self.result, self.replay, ran = self.record(self.step)
        if not ran:
            self.replay()
        return self.result

    def _warm_up(self) -> T:
        if self.record is not record_cuda_graph:
            return self.step()
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = self.step()
        main.wait_stream(side)
        return result
