"""A whole speculative step recorded once as a CUDA graph and replayed: one launch per step.

Launching a step's few dozen compiled kernels from Python costs about what they take to run, so a step
would cost several AR steps however little it computes. Every tensor of a step has a shape fixed by the
method and the step changes its run's tensors in place (``DecodeRun``), so the whole step can be
recorded once (``torch.cuda.graph``) and replayed, as gpt-fast does. ``StepGraph`` warms up eagerly on a
side stream, records, then replays (``SplitStepGraph``: two parts with VVS's plan read between them);
``recording()`` tells compiled forwards not to capture graphs of their own. Tests record on the CPU with
``record_fx``. docs/decoding.md, "Whole steps as CUDA graphs".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
A = TypeVar("A")
K = TypeVar("K")
# record(step, stream) → (what the step returned, replay, whether recording already ran the step once)
Recorder = Callable[[Callable[[], T], "torch.cuda.Stream | None"], tuple[T, Callable[[], object], bool]]

_RECORDING: ContextVar[bool] = ContextVar("vdtrain_recording_step", default=False)


def recording() -> bool:
    """True while a step is warmed up or recorded (replays run no Python)."""
    return _RECORDING.get()


@contextmanager
def _recording() -> Iterator[None]:
    token = _RECORDING.set(True)
    try:
        yield
    finally:
        _RECORDING.reset(token)


class DeviceLog:
    """Long rows appended at a count kept on the device: a recorded step, replayed without Python, still
    appends its row at the next place. Read back in one transfer."""

    def __init__(self, capacity: int, *row: int, device: torch.device | str | None = None) -> None:
        self.rows = torch.zeros(capacity, *row, dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)

    def append(self, row: torch.Tensor) -> None:
        self.rows.index_copy_(0, self.count, row[None].long())
        self.count += 1

    def clear(self) -> None:
        """Empty, in place."""
        self.rows.zero_()
        self.count.zero_()

    def tolist(self, count: int | None = None) -> list:
        """The first ``count`` rows (default: all appended, which reads the count from the device)."""
        return self.rows[: int(self.count) if count is None else count].tolist()


def record_cuda_graph(
    step: Callable[[], T], stream: torch.cuda.Stream | None
) -> tuple[T, Callable[[], object], bool]:
    """``step`` captured as a CUDA graph on ``stream``; capture runs none of its kernels.

    cuBLAS keeps a scratch buffer per stream that a graph addresses directly: cleared before the capture,
    the graph allocates its own in its memory pool (as torch's cudagraph trees do), and cleared after, so
    no later eager call or other graph shares it. Nothing may compile while capturing (the warm-up steps
    did): a recompile raises instead of failing obscurely inside the capture."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    graph = torch.cuda.CUDAGraph()
    clear()
    with torch.compiler.set_stance("fail_on_recompile"), torch.cuda.graph(graph, stream=stream):
        result = step()
    clear()
    return result, graph.replay, False


def record_fx(step: Callable[[], T], stream: object = None) -> tuple[T, Callable[[], object], bool]:
    """``step`` traced into an FX graph of ATen ops (``make_fx``), replayed on the same tensors: a CPU
    stand-in for ``record_cuda_graph`` in tests. Tracing runs the step once, counted as if on a GPU
    (``OpCounter``): a step that reads the device or copies host data to it raises, as a capture does.
    A CUDA graph rewrites the tensors its captured step returned at their addresses; a replay here copies
    its results into them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from vdtrain.decode.profiling import OpCounter

    box: list[T] = []

    def traced() -> list[torch.Tensor]:
        with OpCounter(as_if_gpu=True) as counter:
            box.append(step())
        if counter.counts.syncs or counter.counts.h2d:
            raise RuntimeError(
                "a CUDA graph capture refuses this step: it reads the device or copies host data to it "
                f"({', '.join(counter.sites)})"
            )
        return _tensors_in(box[-1])

    graph = make_fx(traced)()
    returned = _tensors_in(box[0])

    def replay() -> None:
        for captured, now in zip(returned, graph(), strict=True):
            if captured.data_ptr() == now.data_ptr():  # a view of the run's state: already written
                continue
            if torch._debug_has_internal_overlap(captured) != 0:  # an expanded view: write its base
                captured, now = captured._base, now._base
            captured.copy_(now)

    return box[0], replay, True


def _tensors_in(value: object) -> list[torch.Tensor]:
    """The distinct tensors inside ``value`` (named tuples, dataclasses, sequences), in a fixed order."""
    found: dict[int, torch.Tensor] = {}

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            found.setdefault(id(v), v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
        elif isinstance(v, (tuple, list)):
            for item in v:
                walk(item)

    walk(value)
    return list(found.values())


class StepGraph(Generic[T]):
    """``step`` eagerly for ``warmup`` calls, then recorded once with ``record`` and replayed. On a GPU
    (``record_cuda_graph``) warm-up and capture run on a stream of this graph's own, and every call on
    ``device`` (the run's GPU, whichever is current)."""

    def __init__(
        self,
        step: Callable[[], T],
        record: Recorder = record_cuda_graph,
        device: torch.device | str | None = None,
        warmup: int = 2,
    ) -> None:
        self.step, self.record, self.warmup = step, record, warmup
        self.device = torch.device(device) if device is not None else None
        self.stream = torch.cuda.Stream(self.device) if record is record_cuda_graph else None
        self.replay: Callable[[], object] | None = None
        self.result: T | None = None

    def __call__(self) -> T:
        with torch.cuda.device(self.device) if self.stream is not None else nullcontext():
            return self._call()

    def _call(self) -> T:
        if self.replay is not None:
            self.replay()
            return self.result
        with _recording():
            if self.warmup > 0:
                self.warmup -= 1
                return self._warm_up()
            self.result, self.replay, ran = self.record(self.step, self.stream)
        if not ran:
            self.replay()
        return self.result

    def _warm_up(self) -> T:
        if self.stream is None:
            return self.step()
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            result = self.step()
        main.wait_stream(self.stream)
        return result


class SplitStepGraph(Generic[A, K, T]):
    """A step in two recorded parts with one read of the device between them: ``first`` (one graph),
    then ``key(first's result)`` on the host, then ``second(result, key)``, one graph per key. A VVS step
    is drafted and planned by the first; which prompts verify, post-verify or skip decides which
    forwards the second runs."""

    def __init__(
        self,
        first: Callable[[], A],
        key: Callable[[A], K],
        second: Callable[[A, K], T],
        record: Recorder = record_cuda_graph,
        device: torch.device | str | None = None,
    ) -> None:
        self.first = StepGraph(first, record, device)
        self.key, self.second, self.record, self.device = key, second, record, device
        self.seconds: dict[K, StepGraph[T]] = {}
        self.drafted: A | None = None  # the first part's result this step (one object once recorded)

    def __call__(self) -> T:
        self.drafted = self.first()
        key = self.key(self.drafted)
        graph = self.seconds.get(key)
        if graph is None:
            graph = self.seconds[key] = StepGraph(
                lambda: self.second(self.drafted, key), self.record, self.device
            )
        return graph()
