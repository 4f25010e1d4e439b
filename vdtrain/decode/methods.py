"""Decoding methods as named combinations of the engine's parts (``conf/decode/<name>.yaml``).

A method = a draft-tree builder + an acceptance rule (+, later, a verification schedule). AR is the
method with no drafter. New combinations need a config file, not code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vdtrain.decode.acceptance import verify_exact
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.engine import (
    DecodeResult,
    DecodeStats,
    DraftTreeBuilder,
    DynamicTreeBuilder,
    SpeculativeEngine,
    StaticTreeBuilder,
)
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import STATIC_TREES, static_tree
from vdtrain.drafter import Drafter
from vdtrain.targets.base import Condition, Target


@dataclass
class TreeConfig:
    kind: str = "none"  # none (AR) | static | dynamic
    preset: str | None = None  # static: a named tree (eagle1, lantern_pp)
    paths: list[list[int]] | None = None  # static: explicit rank paths instead of a preset
    top_k: int = 10  # dynamic: children per expanded node and frontier width
    depth: int = 5  # dynamic: expansion rounds after the root's children
    total_tokens: int = 59  # dynamic: nodes kept, root included


@dataclass
class DecodeConfig:
    name: str = "ar"
    tree: TreeConfig = field(default_factory=TreeConfig)
    acceptance: str = "exact"  # exact

    @property
    def needs_drafter(self) -> bool:
        return self.tree.kind != "none"


ACCEPTANCE = {"exact": verify_exact}


def tree_builder(config: TreeConfig) -> DraftTreeBuilder:
    if config.kind == "static":
        if (config.preset is None) == (config.paths is None):
            raise ValueError("a static tree needs exactly one of tree.preset or tree.paths")
        if config.preset is not None and config.preset not in STATIC_TREES:
            raise ValueError(f"unknown static tree {config.preset!r}; known: {sorted(STATIC_TREES)}")
        paths = STATIC_TREES[config.preset] if config.preset else [tuple(p) for p in config.paths]
        return StaticTreeBuilder(static_tree(paths))
    if config.kind == "dynamic":
        return DynamicTreeBuilder(config.top_k, config.depth, config.total_tokens)
    raise ValueError(f"unknown tree kind {config.kind!r}; use none, static or dynamic")


class ARMethod:
    """The baseline, reporting the same statistics as the speculative methods."""

    def __init__(self, target: Target, sampling: SamplingConfig) -> None:
        self.target, self.sampling = target, sampling

    def generate(self, cond: Condition, generators: Sequence[torch.Generator | None]) -> DecodeResult:
        start = time.perf_counter()
        tokens = generate_ar(self.target, cond, self.sampling, generators)
        n = self.target.num_image_tokens
        stats = [
            DecodeStats(
                target_forwards=n,
                steps=n - 1,
                committed_per_step=[1] * (n - 1),
                depth_per_step=[0] * (n - 1),
                accept_map=[(i, 0) for i in range(n - 1)],
            )
            for _ in range(len(cond))
        ]
        return DecodeResult(tokens, stats, time.perf_counter() - start)


def build_method(
    config: DecodeConfig, target: Target, drafter: Drafter | None, sampling: SamplingConfig
) -> ARMethod | SpeculativeEngine:
    if not config.needs_drafter:
        return ARMethod(target, sampling)
    if drafter is None:
        raise ValueError(f"method {config.name!r} needs a drafter (set drafter=<folder>)")
    if config.acceptance not in ACCEPTANCE:
        raise ValueError(f"unknown acceptance {config.acceptance!r}; known: {sorted(ACCEPTANCE)}")
    return SpeculativeEngine(
        target, drafter, tree_builder(config.tree), sampling, ACCEPTANCE[config.acceptance]
    )
