"""Decoding methods as named combinations of the engine's parts (``conf/decode/<name>.yaml``).

A method = a draft-tree builder + an acceptance rule + a verification schedule (``always`` unless the
method skips verification, VVS). AR is the method with no draft tree. New combinations need a config
file, not code.

The parts are a registry: ``TREES``, ``ACCEPTANCE`` and ``SCHEDULES`` map a config ``kind`` to a
``Part``, its builder plus what it implies as data (a tree needs the drafter model; a rule or schedule
is lossless; a rule reads soft target mass). ``DecodeConfig.needs_drafter`` and ``DecodeConfig.exact``
read those fields, so a new part is one registry entry. Acceptance rules and schedules are built from
the target: LANTERN and LANTERN++ need its latent-neighbour table (``vdtrain.decode.neighbours``, cached
on disk), GSD a token embedding table for its distance filter, the similarity schedule its codebook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from vdtrain.decode.acceptance import EXACT, Grouped, Lantern, LanternPP, Rule
from vdtrain.decode.ar import ARDecoder
from vdtrain.decode.builders.base import DraftTreeBuilder
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder
from vdtrain.decode.builders.jacobi import JacobiWindowBuilder
from vdtrain.decode.builders.peanut import PeanutTreeBuilder
from vdtrain.decode.builders.sjd_pac import SjdPacBuilder
from vdtrain.decode.builders.static import StaticTreeBuilder
from vdtrain.decode.engine import DecodeResult, DecodeStats, SpeculativeEngine
from vdtrain.decode.neighbours import latent_neighbours
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import STATIC_TREES, static_tree
from vdtrain.decode.vvs import SimilaritySchedule, UniformSchedule, VerificationSchedule
from vdtrain.drafter import Drafter
from vdtrain.targets.base import Condition, Target


@dataclass
class TreeConfig:
    kind: str = "none"  # none (AR) | static | dynamic | jacobi (SJD, no drafter) | sjd_pac (no drafter)
    preset: str | None = None  # static: a named tree (eagle1, lantern_pp)
    paths: list[list[int]] | None = None  # static: explicit rank paths instead of a preset
    top_k: int = 10  # dynamic: children per expanded node and frontier width
    depth: int = 5  # dynamic: expansion rounds after the root's children
    total_tokens: int = 59  # dynamic: nodes kept, root included
    window: int = 16  # jacobi: draft tokens per Jacobi window (SJD's W)
    init: str = "random"  # jacobi: fresh drafts, random | {horizontal,vertical}_{repeat,sample}
    # sjd_pac (SJD-PAC, no drafter, vdtrain.decode.sjd_pac) reads `window` as L, the tokens per forward with
    # the root (the release's max_num_new_tokens): a full `width`-ary tree of `levels` levels + a chain.
    width: int = 3  # sjd_pac: W, tokens drafted per tree level (proactive drafting)
    levels: int = 3  # sjd_pac: D, tree levels, the root included (the release's tree_depth)
    # peanut (EAGLE-2 trees adapted per tree, vdtrain.decode.peanut; also reads total_tokens and `init`:
    # horizontal_repeat | vertical_repeat | random). d counts draft levels (= dynamic depth + 1).
    beta: float = 1.0  # peanut: positive threshold on α = accepted drafts / tree depth
    l_d: int = 1  # peanut: depth step
    l_k: int = 10  # peanut: width (top-k) step (paper: 10 for LlamaGen, 3 for Chameleon-family targets)
    d_min: int = 0  # peanut: open bounds d_min < d < d_max
    d_max: int = 10
    k_min: int = 3  # peanut: open bounds k_min < k < k_max (paper: (3, 40) LlamaGen, (3, 14) Chameleon)
    k_max: int = 40
    d_init: int = 5  # peanut: the first tree's depth (draft levels) and width
    k_init: int = 10
    init_seed: int = 0  # peanut random init: seed of the fallback generators (when the engine passes none)


@dataclass
class AcceptanceConfig:
    """Which verification rule, and its parameters (each kind reads only its own)."""

    kind: str = "exact"  # exact | lantern | lantern_pp | gsd
    delta: float = 0.1  # lantern: bound on the neighbours' target mass (additive)
    lam: float = 2.0  # lantern_pp: bound (λ − 1)·p(x) on the neighbours' mass (multiplicative)
    k: int = 1000  # lantern, lantern_pp: latent neighbours considered (≤ 1000, clamped to V − 1)
    group_size: int = 14  # gsd: rank window G
    delta_p: float = 0.15  # gsd: keep candidates with |p(c) − p(x)| < delta_p
    max_distance: float = 0.5  # gsd: keep candidates with squared embedding distance D(x, c) < d
    embedding: str = "token_embedding"  # gsd: distance source, token_embedding | codebook
    cache_dir: str | None = None  # neighbour-table cache (null: $VDTRAIN_CACHE/neighbours or ~/.cache)


@dataclass
class ScheduleConfig:
    """Which steps are verified (VVS, ``vdtrain.decode.vvs``); each kind reads only its own parameters."""

    kind: str = "always"  # always | uniform | similarity
    every: int = 3  # uniform: skip every `every`-th step (paper: 2, 3, 4)
    t_sim: float = 0.7  # similarity: skip when the paths' similarity S̄ >= t_sim (paper: 0.65 - 0.8)
    alpha: float = 0.8  # similarity: depth decay of the weights w_l ∝ alpha^l (not given by the paper)
    stride: int = 2  # similarity: keep every `stride`-th candidate path
    # Where the authors' release (HyattDD/VVS) differs (docs/decoding.md, VVS; preset vvs_release):
    phase: int | None = None  # uniform: skip step s (from 0) if s % every == phase; null: every-1 (release 1)
    formula: str = "level_mean"  # similarity: level_mean (ours) | release (0.9^l over longest path, gaps 0)
    few_paths: str = "skip"  # similarity: < 2 candidate paths: skip (ours, S̄ = 1) | verify (release, S̄ = 0)
    warmup: int = 0  # uniform, similarity: no skip while <= warmup image tokens are committed (release: 6)


@dataclass
class DecodeConfig:
    name: str = "ar"
    tree: TreeConfig = field(default_factory=TreeConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    @property
    def needs_drafter(self) -> bool:
        return _tree_part(self.tree.kind).needs_drafter

    @property
    def exact(self) -> bool:
        """Lossless: a lossless rule and schedule (every step verified), so at T = 0 it reproduces AR."""
        return _acceptance_part(self.acceptance.kind).lossless and _schedule_part(self.schedule.kind).lossless


PRESETS = Path(__file__).resolve().parents[2] / "conf" / "decode"


def decode_config(node: Any) -> DecodeConfig:
    """The typed method of a config node or dict (unknown keys and wrong types fail here)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DecodeConfig), node))


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def load_preset(name: str, overrides: Mapping[str, Any] | None = None) -> DecodeConfig:
    """The method preset ``conf/decode/<name>.yaml``, with ``overrides`` (nested keys) merged on top."""
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown method preset {name!r}; known: {preset_names()}")
    return decode_config(OmegaConf.merge(OmegaConf.load(path), overrides or {}))


def _neighbour_table(config: AcceptanceConfig, target: Target) -> torch.Tensor:
    table = latent_neighbours(target.tokenizer.codebook(), config.k, config.cache_dir)
    return table.to(target.token_embedding.weight.device)


def _gsd_embeddings(config: AcceptanceConfig, target: Target) -> torch.Tensor:
    if config.embedding == "token_embedding":
        return target.token_embedding.weight.detach()
    if config.embedding == "codebook":
        return target.tokenizer.codebook().to(target.token_embedding.weight.device)
    raise ValueError(f"unknown GSD embedding {config.embedding!r}; use token_embedding or codebook")


def _similarity(config: ScheduleConfig, target: Target) -> SimilaritySchedule:
    codebook = target.tokenizer.codebook().to(target.token_embedding.weight.device)
    return SimilaritySchedule(
        codebook,
        config.t_sim,
        config.alpha,
        config.stride,
        formula=config.formula,
        few_paths=config.few_paths,
        warmup=config.warmup,
    )


def _static(config: TreeConfig) -> StaticTreeBuilder:
    if (config.preset is None) == (config.paths is None):
        raise ValueError("a static tree needs exactly one of tree.preset or tree.paths")
    if config.preset is not None and config.preset not in STATIC_TREES:
        raise ValueError(f"unknown static tree {config.preset!r}; known: {sorted(STATIC_TREES)}")
    paths = STATIC_TREES[config.preset] if config.preset else [tuple(p) for p in config.paths]
    return StaticTreeBuilder(static_tree(paths))


def _peanut(config: TreeConfig) -> PeanutTreeBuilder:
    return PeanutTreeBuilder(
        init=config.init,
        beta=config.beta,
        l_d=config.l_d,
        l_k=config.l_k,
        d_min=config.d_min,
        d_max=config.d_max,
        k_min=config.k_min,
        k_max=config.k_max,
        d_init=config.d_init,
        k_init=config.k_init,
        total_tokens=config.total_tokens,
        seed=config.init_seed,
    )


@dataclass(frozen=True)
class Part:
    """One registered part of a method: how to build it and what it implies, as data.

    ``build`` takes the part's config section (trees) or the section and the target (acceptance rules,
    schedules); None for the one part with nothing to build (tree ``none``: AR). Each capability is read
    for one family only: ``needs_drafter`` for trees, ``lossless`` for rules and schedules,
    ``needs_soft_p`` for rules. They must agree with the built objects' own flags
    (``DraftTreeBuilder.needs_drafter``, ``Rule.needs_soft_p``, ``VerificationSchedule.can_skip``);
    tests/test_method_registry.py checks that.
    """

    build: Callable[..., Any] | None
    needs_drafter: bool = False  # tree: drafts with the drafter model (else none is attached)
    lossless: bool = False  # rule: keeps the target distribution; schedule: verifies every step
    needs_soft_p: bool = False  # rule: reads p beyond p(x) (a group's mass): at T = 0, the T = 1 softmax


TREES: dict[str, Part] = {
    "none": Part(None),  # AR: one target forward per token
    "static": Part(_static, needs_drafter=True),  # a fixed tree of drafter ranks (EAGLE-1, LANTERN++)
    "dynamic": Part(  # EAGLE-2: expanded by the drafter's cumulative confidence
        lambda c: DynamicTreeBuilder(c.top_k, c.depth, c.total_tokens), needs_drafter=True
    ),
    "peanut": Part(_peanut, needs_drafter=True),  # EAGLE-2 trees with per-tree depth and width
    "jacobi": Part(lambda c: JacobiWindowBuilder(c.window, c.init)),  # SJD: the target's own window
    "sjd_pac": Part(lambda c: SjdPacBuilder(c.window, c.width, c.levels)),  # SJD-PAC: window + proactive tree
}

ACCEPTANCE: dict[str, Part] = {
    # u·q(x) < p(x): only the drafted token's target probability.
    "exact": Part(lambda c, t: EXACT, lossless=True),
    # Credits x with the mass of its latent neighbours A(x) (Σ_A p ≤ δ): p beyond p(x).
    "lantern": Part(lambda c, t: Lantern(_neighbour_table(c, t), c.k, delta=c.delta), needs_soft_p=True),
    # The same with Σ_A p ≤ (λ − 1)·p(x).
    "lantern_pp": Part(lambda c, t: LanternPP(_neighbour_table(c, t), c.k, lam=c.lam), needs_soft_p=True),
    # Credits x with its group's mass (rank window by p, filtered by |p(c) − p(x)| and embedding distance).
    "gsd": Part(
        lambda c, t: Grouped(
            _gsd_embeddings(c, t), group_size=c.group_size, delta_p=c.delta_p, max_distance=c.max_distance
        ),
        needs_soft_p=True,
    ),
}

SCHEDULES: dict[str, Part] = {
    "always": Part(lambda c, t: VerificationSchedule(), lossless=True),  # every step verified
    "uniform": Part(lambda c, t: UniformSchedule(c.every, c.phase, c.warmup)),  # skips every `every`-th
    "similarity": Part(_similarity),  # skips when the candidate paths agree (VVS S̄ >= t_sim)
}


def _part(parts: Mapping[str, Part], kind: str, what: str) -> Part:
    if kind not in parts:
        raise ValueError(f"unknown {what} {kind!r}; known: {sorted(parts)}")
    return parts[kind]


def _tree_part(kind: str) -> Part:
    return _part(TREES, kind, "tree kind")


def _acceptance_part(kind: str) -> Part:
    return _part(ACCEPTANCE, kind, "acceptance")


def _schedule_part(kind: str) -> Part:
    return _part(SCHEDULES, kind, "schedule kind")


def acceptance_rule(config: AcceptanceConfig, target: Target) -> Rule:
    """The verification callable for ``config``, with the tables it needs built from ``target``."""
    return _acceptance_part(config.kind).build(config, target)


def verification_schedule(config: ScheduleConfig, target: Target) -> VerificationSchedule:
    """The schedule for ``config``; the similarity schedule compares ``target.tokenizer.codebook()`` rows."""
    return _schedule_part(config.kind).build(config, target)


def tree_builder(config: TreeConfig) -> DraftTreeBuilder:
    build = _tree_part(config.kind).build
    if build is None:
        raise ValueError(f"tree kind {config.kind!r} drafts nothing: it has no draft-tree builder (AR)")
    return build(config)


class ARMethod:
    """The baseline, reporting the same statistics as the speculative methods. Its step is recorded and
    replayed like theirs when the target asks for it (``Target.step_recorder``), once per batch shape."""

    def __init__(self, target: Target, sampling: SamplingConfig) -> None:
        self.target, self.sampling = target, sampling
        self.decoder = ARDecoder(target, sampling, target.step_recorder)

    @property
    def recorder(self):
        return self.decoder.recorder

    def generate(
        self,
        cond: Condition,
        generators: Sequence[torch.Generator | None],
        on_step: Callable[..., None] | None = None,
    ) -> DecodeResult:
        """``on_step()`` runs after each step (as the engine's hook, without arguments)."""
        start = time.perf_counter()
        tokens = self.decoder.generate(cond, generators, on_step)
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
    skips = not _schedule_part(config.schedule.kind).lossless
    if _tree_part(config.tree.kind).build is None:
        if not _acceptance_part(config.acceptance.kind).lossless:
            kind = config.acceptance.kind
            raise ValueError(f"method {config.name!r} has no draft tree to apply acceptance {kind!r} to")
        if skips:
            kind = config.schedule.kind
            raise ValueError(f"method {config.name!r} has no draft tree to skip verifying ({kind!r})")
        return ARMethod(target, sampling)
    if skips and not config.needs_drafter:
        raise ValueError(f"schedule {config.schedule.kind!r} needs a drafter tree, not {config.tree.kind!r}")
    if drafter is None and config.needs_drafter:
        raise ValueError(f"method {config.name!r} needs a drafter (set drafter=<folder>)")
    builder = tree_builder(config.tree)
    drafter = drafter if config.needs_drafter else None  # drafter-free (SJD): never attached
    return SpeculativeEngine(
        target,
        drafter,
        builder,
        sampling,
        acceptance_rule(config.acceptance, target),
        verification_schedule(config.schedule, target),
    )
