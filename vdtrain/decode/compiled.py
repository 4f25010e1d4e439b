"""The fast decoding modes: whole steps recorded as CUDA graphs, and ``torch.compile`` on top.

``cuda_graphs`` (default on a GPU) records AR's step and every speculative step once per shape with the
eager kernels (``vdtrain.decode.graphs``) and replays it with one launch: capture takes seconds, no
code is generated. ``compile`` wraps the target's decoder layers, the drafter and the step kernels
between forwards (``vdtrain.decode.kernels``) in ``torch.compile`` (inductor, static shapes); with
graphs the compiled code runs inside the recorded steps. docs/decoding.md ("Fast decoding") has the
measurements.

Every ``torch.compile`` option newer than the oldest supported torch (2.11) is feature-detected
(``compile_options``): where it is missing the same code runs, with torch's process-wide setting in its
place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vdtrain.decode.graphs import Recorder, record_cuda_graph
from vdtrain.decode.kernels import RECOMPILE_LIMIT, raise_recompile_limit
from vdtrain.drafters.base import Drafter
from vdtrain.targets.base import Target


@dataclass
class DecodeOptions:
    """How decoding steps run: decode policy, made by ``prepare_decoding`` and handed to the engine and
    the AR decoder by ``build_method`` (never stored on the target)."""

    compile_steps: str | None = None  # the step kernels' torch.compile backend; None: eager
    step_recorder: Recorder | None = None  # records a step once and replays it; None: from Python

    @property
    def starts_up(self) -> bool:
        """Whether a method's first decode of a batch shape records or compiles what later ones reuse."""
        return self.step_recorder is not None or self.compile_steps is not None


def compile_options(compile: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The per-function recompile limit where this torch has it (2.13+): a compiled layer keeps up to
    ``RECOMPILE_LIMIT`` shapes (a prefill, AR's step and one verification shape per method of an
    evaluation). Older torches get none; ``compile_decoding`` raises the process-wide limit instead."""
    accepted = inspect.signature(compile or torch.compile).parameters
    wanted = {"recompile_limit": RECOMPILE_LIMIT}
    return {k: v for k, v in wanted.items() if k in accepted}


def compile_decoding(
    target: Target, drafter: Drafter | None = None, *, backend: str = "inductor", step_kernels: bool = True
) -> str | None:
    """Wrap, in place, the target transformer's decoder layers (prefill, AR and verification) and the
    drafter's forward in ``torch.compile`` (``backend``: ``inductor``; ``eager``/``aot_eager`` trace
    without generating kernels). Returns the backend the speculative step kernels should run compiled
    with (``DecodeOptions.compile_steps``): ``backend`` with ``step_kernels``, else None. Call it once,
    after the target has its device and dtype and before decoding.

    The target is compiled by region: every decoder layer runs the same code on its own weights and
    cache (``KVCache.layer``), so one compiled layer per shape serves all of them, and XL's 36 layers
    compile as fast as one."""
    modules: list[nn.Module] = [target.transformer] if drafter is None else [target.transformer, drafter]
    if any(getattr(m, "_vdtrain_compiled", False) for m in modules):
        raise RuntimeError("compile_decoding was already applied to this target or drafter")
    options = compile_options()
    if "recompile_limit" not in options:
        raise_recompile_limit(RECOMPILE_LIMIT)
    compile = functools.partial(torch.compile, backend=backend, fullgraph=False, dynamic=False, **options)
    for module in modules:
        layers = getattr(module, "layers", None)
        regions = list(layers) if isinstance(layers, nn.ModuleList) else [module]
        for region in regions:
            region.forward = compile(region.forward)
        module._vdtrain_compiled = True
    return backend if step_kernels else None


def cuda_graph_recorder(target: Target) -> Recorder:
    """The recorder (``DecodeOptions.step_recorder``) that records AR's and every graph-safe speculative
    method's step as a CUDA graph on first use of a shape, then replays it (``vdtrain.decode.graphs``)."""
    if target.token_embedding.weight.device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device; the target is on {target.device}")
    return record_cuda_graph


def wants_cuda_graphs(setting: bool | str | None, device: torch.device) -> bool:
    """The ``cuda_graphs`` key: ``auto`` (or null) means on a GPU; ``true`` refuses other devices."""
    if setting in (None, "auto"):
        return device.type == "cuda"
    if not isinstance(setting, bool):
        raise ValueError(f"cuda_graphs must be auto, true or false, got {setting!r}")
    if setting and device.type != "cuda":
        raise ValueError(f"cuda_graphs=true needs a CUDA device, not {device}; use cuda_graphs=auto")
    return setting


def prepare_decoding(
    target: Target, drafter: Drafter | None, *, compile: bool, cuda_graphs: bool | str | None = "auto"
) -> DecodeOptions:
    """Set up the fast mode the apps' ``compile`` and ``cuda_graphs`` keys ask for, and return the options
    ``build_method`` hands to the methods. ``compile`` compiles the target's layers, the drafter and the
    step kernels; with graphs they run inside the recorded steps, where fusing a step's hundreds of small
    ops into a few kernels is what is left to gain."""
    graphs = wants_cuda_graphs(cuda_graphs, target.token_embedding.weight.device)
    options = DecodeOptions()
    if compile:
        options.compile_steps = compile_decoding(target, drafter)
    if graphs:
        options.step_recorder = cuda_graph_recorder(target)
    return options
