"""``compile=true``: the target's cached forward and the drafter's forward under ``torch.compile``, and
the step kernels between them (``vdtrain.decode.kernels``) compiled too.

The engine gives every forward of a step a shape fixed by the method (trees padded to their max nodes,
visibility over the whole image plus scratch), so each wrapped forward compiles once per shape
(``dynamic=False``) and is replayed after. On a GPU the mode is ``reduce-overhead``: the graphs are
captured as CUDA graphs, which removes the per-kernel launch cost that dominates small decoding steps.
CUDA graphs need fixed addresses, so there the KV caches come from a pool (one per shape, zeroed on
reuse) and are marked static, and each output is copied out of the graph's memory before the next
replay overwrites it. CPUs have no CUDA graphs: there the mode is ``default`` (inductor's C++ kernels).

On a GPU the speculative engine goes one step further: it records the whole step (drafter rounds,
verification forward, acceptance, commit) as one CUDA graph and replays it (``vdtrain.decode.graphs``,
``Target.step_recorder``; VVS in two parts). A forward called while a step is recorded runs a second
compiled version of itself without CUDA graphs of its own (captures do not nest); AR decoding keeps the
``reduce-overhead`` forwards.

The wrapping lives on the module instances, not in the engine, so every method gets it unchanged and
eager decoding stays the reference the compiled one is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vdtrain.decode.graphs import record_cuda_graph, recording
from vdtrain.decode.kernels import RECOMPILE_LIMIT
from vdtrain.drafter import Drafter
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Target


def compile_mode(device: torch.device) -> str:
    """``reduce-overhead`` (CUDA graphs) on a GPU; ``default`` elsewhere, where CUDA graphs do not exist."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def pooled_caches(make: Callable[..., KVCache]) -> Callable[..., KVCache]:
    """``make`` returning one cache per argument set, zeroed on each reuse, with its tensors marked as
    static inputs: CUDA graphs replay on fixed addresses. One decode at a time may use a pooled cache."""
    pool: dict[tuple[Any, ...], KVCache] = {}

    def new_cache(*args: Any, **kwargs: Any) -> KVCache:
        key = (*args, *sorted(kwargs.items()))
        cache = pool.get(key)
        if cache is None:
            cache = pool[key] = make(*args, **kwargs)
            for tensor in (cache.k, cache.v):
                torch._dynamo.mark_static_address(tensor)
        else:
            cache.k.zero_()
            cache.v.zero_()
        return cache

    return new_cache


def graph_replay(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``compiled`` as a CUDA-graph step: a new replay each call, its output cloned out of graph memory
    (the engine keeps features and hidden states across steps)."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs).clone()

    return forward


def _compile_forward(module: nn.Module, mode: str, backend: str) -> None:
    # Each compiled version keeps its own graphs, up to RECOMPILE_LIMIT shapes (a prefill, AR's step and
    # one verification shape per method of an evaluation): past torch's default of 8 shared by both
    # versions, later methods (or AR, the baseline) would fall back to eager forwards silently.
    compile = functools.partial(
        torch.compile,
        backend=backend,
        fullgraph=False,
        dynamic=False,
        recompile_limit=RECOMPILE_LIMIT,
        isolate_recompiles=True,
    )
    if mode != "reduce-overhead":
        module.forward = compile(module.forward, mode=mode)
        return
    graphed, plain = graph_replay(compile(module.forward, mode=mode)), compile(module.forward)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return plain(*args, **kwargs) if recording() else graphed(*args, **kwargs)

    module.forward = forward


def compile_decoding(target: Target, drafter: Drafter | None = None, *, backend: str = "inductor") -> None:
    """Wrap, in place, the target transformer's forward (prefill and verification) and the drafter's,
    and make speculative decoding on ``target`` run its step kernels compiled (the tensor work between
    forwards, ``vdtrain.decode.kernels``) and, on a GPU, record its steps as CUDA graphs.

    ``backend`` is torch.compile's (``inductor``; ``aot_eager`` traces without generating kernels). Call
    it once, after the target has its device and dtype and before decoding.
    """
    modules: list[nn.Module] = [target.transformer] if drafter is None else [target.transformer, drafter]
    if any(getattr(m, "_vdtrain_compiled", False) for m in modules):
        raise RuntimeError("compile_decoding was already applied to this target or drafter")
    target.compile_steps = backend
    mode = compile_mode(target.token_embedding.weight.device)
    if mode == "reduce-overhead":
        target.step_recorder = record_cuda_graph
    for module in modules:
        if mode == "reduce-overhead":
            module.new_cache = pooled_caches(module.new_cache)
        _compile_forward(module, mode, backend)
        module._vdtrain_compiled = True
