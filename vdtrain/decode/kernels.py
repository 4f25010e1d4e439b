"""Step kernels: the tensor work between a step's forwards, compiled into a few graphs when asked.

A speculative step's bookkeeping is several hundred small ATen ops. The engine keeps it in pure tensor
functions marked ``@step_kernel``, one per gap between forwards: plain calls eagerly (the reference every
test compares against), one ``torch.compile`` graph each (static shapes, ``fullgraph=True``) inside
``compiled_step_kernels()`` (``DecodeOptions.compile_steps``). A kernel must be a pure function of its
arguments (it may change tensors in place, never Python state), or every decode would trace it anew;
recompiles are bounded by ``RECOMPILE_LIMIT``. ``shared_arange`` and its kin cache constant tensors across
steps, bypassed while compiling. Where a rewrite replaced readable code to save kernels (``selection``,
``acceptance._follow``, ``rng``), the plain version stays beside it and ``plain_kernels()`` switches to it
(``VDTRAIN_PLAIN_KERNELS=1``, or ``plain_twins()`` in tests). docs/decoding.md, "Step kernels"."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from vdtrain.decode.graphs import recording

_COMPILED: ContextVar[str | None] = ContextVar("vdtrain_step_kernels", default=None)  # backend or None
RECOMPILE_LIMIT = 64  # graphs per kernel: shapes x methods x batch sizes of one process

F = TypeVar("F", bound=Callable[..., Any])
_PLAIN = [os.environ.get("VDTRAIN_PLAIN_KERNELS", "") == "1"]  # a list: read at call time, also by dynamo


def plain_kernels() -> bool:
    """Whether the plain twins run instead of the fast kernels (see the module docstring)."""
    return _PLAIN[0]


@contextmanager
def plain_twins(enabled: bool = True) -> Iterator[None]:
    """The plain twins inside the block (``enabled``), the fast kernels otherwise."""
    before, _PLAIN[0] = _PLAIN[0], enabled
    try:
        yield
    finally:
        _PLAIN[0] = before


def step_kernel(fn: F) -> F:
    """Mark ``fn`` (a function or method of tensors and Python constants, no host reads, no forwards)
    as one graph of a decoding step."""
    graphs: dict[str, Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = None if torch.compiler.is_compiling() else _COMPILED.get()
        if backend is None:
            return fn(*args, **kwargs)
        graph = graphs.get(backend)
        if graph is None:
            graph = graphs[backend] = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
        return graph(*args, **kwargs)

    call.step_kernel = fn  # marks the wrapper (benchmarks/step_kernels.py finds the kernels by it)
    return call  # type: ignore[return-value]


_SHARED: dict[tuple[str, int | str, torch.dtype, torch.device], torch.Tensor] = {}


def shared_arange(n: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, made once and shared (``_shared``)."""
    return _shared(("arange", n, dtype, device), lambda: torch.arange(n, dtype=dtype, device=device))


def shared_eye(n: int, device: torch.device) -> torch.Tensor:
    """The bool ``torch.eye(n)`` on ``device``, made once and shared (``_shared``)."""
    return _shared(("eye", n, torch.bool, device), lambda: torch.eye(n, dtype=torch.bool, device=device))


def shared_full(value: float | bool, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-dim ``value`` on ``device``, made once and shared (``_shared``): expand it to a constant, or
    hand it to ``torch.where``, where a Python number is one more fill kernel on a GPU. Made by a fill,
    not copied from the host: a CUDA graph's capture refuses a copy from pageable memory."""
    key = ("full", repr(value), dtype, device)
    return _shared(key, lambda: torch.full((), value, dtype=dtype, device=device))


def _shared(
    key: tuple[str, int | str, torch.dtype, torch.device], make: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``make()``, kept under ``key`` for every later step: read it, never write it (a GPU step is bound
    by launches). Made afresh while compiling (inductor folds it) or while a step is warmed up and
    recorded (every capture runs inside ``StepGraph``'s recording: a CUDA graph's kernels run only on
    replay, so a tensor made then holds nothing before one; the CPU tests record alike, so they see what a
    capture would run)."""
    if torch.compiler.is_compiling() or recording():
        return make()
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def _limit_name() -> str:
    """Dynamo's recompile-limit setting: ``recompile_limit`` (torch 2.7+), ``cache_size_limit`` before."""
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


def recompile_limit() -> int:
    return getattr(torch._dynamo.config, _limit_name())


def raise_recompile_limit(limit: int) -> None:
    """Raise dynamo's process-wide recompile limit to at least ``limit``."""
    setattr(torch._dynamo.config, _limit_name(), max(recompile_limit(), limit))


@contextmanager
def compiled_step_kernels(enabled: bool = True, backend: str = "inductor") -> Iterator[None]:
    """Run step kernels compiled with ``backend`` (``inductor``; ``eager``/``aot_eager`` trace without
    generating code, for tests) inside the block; eagerly when not ``enabled``."""
    limit = recompile_limit()
    if enabled:  # for the block only: AR decoding outside it keeps torch's limit
        raise_recompile_limit(RECOMPILE_LIMIT)
    token = _COMPILED.set(backend if enabled else None)
    try:
        yield
    finally:
        _COMPILED.reset(token)
        setattr(torch._dynamo.config, _limit_name(), limit)
