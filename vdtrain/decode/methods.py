"""Decoding methods as named combinations of the engine's parts (``conf/decode/<name>.yaml``).

A method = a draft-tree builder + an acceptance rule + a verification schedule (``always`` unless the
method skips verification, VVS). AR is the method with no draft tree. New combinations need a config
file, not code. The parts are registries (``TREES``, ``ACCEPTANCE``, ``SCHEDULES``) mapping a config
``kind`` to a ``Part``: the kind's config dataclass (kept beside its class), how to build it, and what
it implies as data (a tree needs the drafter; a rule or schedule is lossless; a rule reads soft target
mass). A new part is one registry line; docs/extending.md walks through one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from vdtrain.config import DECODE_PRESETS, preset_node
from vdtrain.decode.acceptance import (
    AcceptanceConfig,
    Grouped,
    GsdConfig,
    Lantern,
    LanternConfig,
    LanternPP,
    LanternPPConfig,
    NeighbourConfig,
    Rule,
    exact_rule,
)
from vdtrain.decode.ar import ARDecoder
from vdtrain.decode.builders.base import DraftTreeBuilder, TreeConfig
from vdtrain.decode.builders.block import BlockTreeBuilder, BlockTreeConfig
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.builders.jacobi import JacobiTreeConfig, JacobiWindowBuilder
from vdtrain.decode.builders.peanut import PeanutTreeBuilder, PeanutTreeConfig
from vdtrain.decode.builders.sjd_pac import SjdPacBuilder, SjdPacTreeConfig
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.compiled import DecodeOptions
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.kernels import compiled_step_kernels
from vdtrain.decode.neighbours import latent_neighbours
from vdtrain.decode.run import DecodeResult, DecodeStats
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.schedule import ScheduleConfig, VerificationSchedule
from vdtrain.decode.vvs import (
    SimilaritySchedule,
    SimilarityScheduleConfig,
    UniformSchedule,
    UniformScheduleConfig,
)
from vdtrain.drafters.base import Drafter
from vdtrain.targets.base import Condition, Target


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
    def drafts_blocks(self) -> bool:
        """Its tree drafts a block in one forward: it needs a drafter kind that drafts blocks."""
        return _tree_part(self.tree.kind).drafts_blocks

    @property
    def exact(self) -> bool:
        """Lossless: a lossless rule and schedule (every step verified), so at T = 0 it reproduces AR."""
        return _acceptance_part(self.acceptance.kind).lossless and _schedule_part(self.schedule.kind).lossless


PRESETS = DECODE_PRESETS


def decode_config(node: Any) -> DecodeConfig:
    """The typed method of a config node or dict: each section typed by its kind's config, so unknown
    keys (naming the kind) and wrong types fail here."""
    node = OmegaConf.create(node) if not isinstance(node, DictConfig) else node
    unknown = sorted(set(node) - {"name", "tree", "acceptance", "schedule"})
    if unknown:
        raise ValueError(f"unknown decode keys {unknown}; a method has name, tree, acceptance, schedule")
    return DecodeConfig(
        name=node.get("name", "ar"),
        tree=_section(TREES, "tree kind", node.get("tree"), TreeConfig),
        acceptance=_section(ACCEPTANCE, "acceptance", node.get("acceptance"), AcceptanceConfig),
        schedule=_section(SCHEDULES, "schedule kind", node.get("schedule"), ScheduleConfig),
    )


def _section(parts: Mapping[str, Part], what: str, node: Any, base: type) -> Any:
    """One section typed by its kind's config (``base``'s kind when it names none)."""
    node = OmegaConf.create({} if node is None else node)
    part = _part(parts, node.get("kind", base.kind), what)
    own = {f.name for f in fields(part.config)}
    unknown = sorted(set(node) - own)
    if unknown:
        kind = node.get("kind", base.kind)
        raise ValueError(f"{what} {kind!r} has no key {unknown}; its keys: {sorted(own - {'kind'})}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(part.config), node))


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def load_preset(name: str, overrides: Mapping[str, Any] | None = None) -> DecodeConfig:
    """The method preset ``conf/decode/<name>.yaml``, with ``overrides`` (nested keys) merged on top."""
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown method preset {name!r}; known: {preset_names()}")
    return decode_config(OmegaConf.merge(preset_node(path), overrides or {}))


PART_SCHEMAS = "decode_parts"  # the ConfigStore group of the parts' config dataclasses


def register_part_schemas() -> None:
    """Every part's config dataclass as ``decode_parts/<section>/<kind>`` in Hydra's ConfigStore. A preset's
    defaults list pulls its parts' schemas in, so each key a part has (its dataclass default included)
    can be overridden on the command line (``decode.tree.window=32``) and is typed there, while the
    preset file sets only what differs."""
    store = ConfigStore.instance()
    for section, parts in SECTIONS.items():
        for kind, part in parts.items():
            store.store(group=f"{PART_SCHEMAS}/{section}", name=kind, node=part.config)


def _neighbour_table(config: NeighbourConfig, target: Target) -> tuple[torch.Tensor]:
    table = latent_neighbours(target.tokenizer.codebook(), config.k, config.cache_dir)
    return (table.to(target.token_embedding.weight.device),)


def _gsd_embeddings(config: GsdConfig, target: Target) -> tuple[torch.Tensor]:
    if config.embedding == "token_embedding":
        return (target.token_embedding.weight.detach(),)
    if config.embedding == "codebook":
        return (target.tokenizer.codebook().to(target.token_embedding.weight.device),)
    raise ValueError(f"unknown GSD embedding {config.embedding!r}; use token_embedding or codebook")


def _codebook(config: SimilarityScheduleConfig, target: Target) -> tuple[torch.Tensor]:
    return (target.tokenizer.codebook().to(target.token_embedding.weight.device),)


@dataclass(frozen=True)
class Part:
    """One registered part of a method: its config, what makes it and what it implies, as data.

    ``config`` is the kind's config dataclass: its fields are the keys the kind's section may hold, and
    it alone holds their defaults. ``make`` is the part's class (or, for the stateless exact rule, a
    function), called with the config section and what ``lends`` takes from the target (a rule's
    neighbour table, a schedule's codebook); None for the one part with nothing to build (tree
    ``none``: AR). Each capability is read for one family only: ``needs_drafter`` and ``drafts_blocks``
    for trees (the builder class's own declaration, read here), ``lossless`` for rules and schedules,
    ``needs_soft_p`` for rules. The last two must agree with the built objects' own flags
    (``Rule.needs_soft_p``, ``VerificationSchedule.can_skip``); tests/test_method_registry.py checks that.
    """

    config: type
    make: Callable[..., Any] | None
    lends: Callable[[Any, Target], tuple] | None = None  # the target's tables the part is made with
    lossless: bool = False  # rule: keeps the target distribution; schedule: verifies every step
    needs_soft_p: bool = False  # rule: reads p beyond p(x) (a group's mass): at T = 0, the T = 1 softmax

    @property
    def needs_drafter(self) -> bool:
        """tree: drafts with the drafter model (else none is attached); ``DraftTreeBuilder.needs_drafter``."""
        return self.make is not None and self.make.needs_drafter

    @property
    def drafts_blocks(self) -> bool:
        """tree: one drafter forward drafts a block (a drafter kind with blocks); the builder's own flag."""
        return self.make is not None and self.make.drafts_blocks

    def build(self, config: Any, target: Target | None = None) -> Any:
        """The part ``config`` describes (``target``: where ``lends`` takes its tables from)."""
        return self.make(config, *(self.lends(config, target) if self.lends else ()))


TREES: dict[str, Part] = {
    "none": Part(TreeConfig, None),  # AR: one target forward per token
    "static": Part(StaticTreeConfig, StaticTreeBuilder),  # ranks (EAGLE-1, LANTERN++)
    "dynamic": Part(DynamicTreeConfig, DynamicTreeBuilder),  # EAGLE-2: by confidence
    "peanut": Part(PeanutTreeConfig, PeanutTreeBuilder),  # per-tree depth and width
    # A chain or static tree over one block drafter forward's slots (issue #48).
    "block": Part(BlockTreeConfig, BlockTreeBuilder),
    # SJD: a window of the target's own drafts; SJD-PAC: the same with a proactive tree. No drafter.
    "jacobi": Part(JacobiTreeConfig, JacobiWindowBuilder),
    "sjd_pac": Part(SjdPacTreeConfig, SjdPacBuilder),
}

ACCEPTANCE: dict[str, Part] = {
    # u·q(x) < p(x): only the drafted token's target probability.
    "exact": Part(AcceptanceConfig, exact_rule, lossless=True),
    # Credits x with the mass of its latent neighbours A(x) (Σ_A p ≤ δ): p beyond p(x).
    "lantern": Part(LanternConfig, Lantern, _neighbour_table, needs_soft_p=True),
    # The same with Σ_A p ≤ (λ − 1)·p(x).
    "lantern_pp": Part(LanternPPConfig, LanternPP, _neighbour_table, needs_soft_p=True),
    # Credits x with its group's mass (rank window by p, filtered by |p(c) − p(x)| and embedding distance).
    "gsd": Part(GsdConfig, Grouped, _gsd_embeddings, needs_soft_p=True),
}

SCHEDULES: dict[str, Part] = {
    "always": Part(ScheduleConfig, VerificationSchedule, lossless=True),  # every step verified
    "uniform": Part(UniformScheduleConfig, UniformSchedule),  # skips every `every`-th step
    "similarity": Part(SimilarityScheduleConfig, SimilaritySchedule, _codebook),  # skips when paths agree
}

SECTIONS: dict[str, dict[str, Part]] = {"tree": TREES, "acceptance": ACCEPTANCE, "schedule": SCHEDULES}


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
    """The builder of ``config``'s tree (its ``max_rows`` is the engine's: ``build_method``)."""
    part = _tree_part(config.kind)
    if part.make is None:
        raise ValueError(f"tree kind {config.kind!r} drafts nothing: it has no draft-tree builder (AR)")
    return part.build(config)


class ARMethod:
    """The baseline, reporting the same statistics as the speculative methods. Its step is recorded and
    replayed like theirs when the options ask for it (``DecodeOptions.step_recorder``), once per batch
    shape."""

    def __init__(
        self, target: Target, sampling: SamplingConfig, options: DecodeOptions | None = None
    ) -> None:
        self.target, self.sampling = target, sampling
        self.options = options if options is not None else DecodeOptions()
        self.decoder = ARDecoder(target, sampling, self.options.step_recorder)

    @property
    def recorder(self):
        return self.decoder.recorder

    def generate(
        self,
        cond: Condition,
        generators: Sequence[torch.Generator | None],
        on_step: Callable[..., None] | None = None,
        planned_batch: int | None = None,
    ) -> DecodeResult:
        """``on_step()`` runs after each step (as the engine's hook, without arguments); AR has no tree
        for ``planned_batch`` to size (it is taken, as the engine takes it). Its sampling tail runs
        compiled where the options ask for it (``DecodeOptions.compile_steps``), as the engine's step
        kernels do."""
        start = time.perf_counter()
        backend = self.options.compile_steps
        with compiled_step_kernels(backend is not None, backend or "inductor"):
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
    config: DecodeConfig,
    target: Target,
    drafter: Drafter | None,
    sampling: SamplingConfig,
    options: DecodeOptions | None = None,
) -> ARMethod | SpeculativeEngine:
    """The method ``config`` names, decoding with ``options`` (``prepare_decoding``'s; default: eager)."""
    skips = not _schedule_part(config.schedule.kind).lossless
    if _tree_part(config.tree.kind).make is None:
        if not _acceptance_part(config.acceptance.kind).lossless:
            kind = config.acceptance.kind
            raise ValueError(f"method {config.name!r} has no draft tree to apply acceptance {kind!r} to")
        if skips:
            kind = config.schedule.kind
            raise ValueError(f"method {config.name!r} has no draft tree to skip verifying ({kind!r})")
        return ARMethod(target, sampling, options)
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
        accept=acceptance_rule(config.acceptance, target),
        schedule=verification_schedule(config.schedule, target),
        options=options,
        max_rows=config.tree.max_rows,
        draft_cfg_scale=config.tree.draft_cfg_scale,
    )
