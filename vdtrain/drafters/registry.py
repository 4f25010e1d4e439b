"""Drafter kinds as registered parts: ``DRAFTERS`` maps ``DrafterConfig.kind`` to what the kind is, as data.

A row names the kind's settings (``DrafterConfig.options``, with their defaults), whether it reads
fused target layers (its taps), the modules it adds to a ``Drafter``, how target features enter it,
one drafter call, what the head reads, how it trains (teacher-forced, or unrolled for some steps, with
or without a feature loss) and its model-card text. The drafter, the engine, fit, the train module and
the exporter read this table and compare no kind's name. A new kind is one module and one row
(docs/extending.md, "Adding a drafter kind").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

import vdtrain.drafters.eagle as eagle
import vdtrain.drafters.medusa as medusa

if TYPE_CHECKING:
    import torch

    from vdtrain.models.kv_cache import KVCache
    from vdtrain.targets.base import Target


# What the kind's functions receive: the ``Drafter`` (drafters/base.py) whose modules the kind made, and
# its ``DrafterConfig``; named without importing them, since drafters/base.py imports the kinds.
Drafter = nn.Module
DrafterConfig = Any


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter. The callables get the ``Drafter`` whose ``modules`` the kind made."""

    modules: Callable[[DrafterConfig], dict[str, nn.Module]]  # its own modules (its saved weights)
    # The target's hidden [.., H] and tapped layers [.., k·H] (or None) → the drafter's feature.
    input_features: Callable[[Drafter, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (features, next_embeds, positions, mask, cache, slots) → f̂, one call (``Drafter.forward``).
    forward: Callable[..., torch.Tensor]
    head_input: Callable[[Drafter, torch.Tensor], torch.Tensor]  # f̂ → what the target's head reads
    new_cache: Callable[[Drafter, int, int], KVCache | None]  # its cache for (batch, max_len); None: none
    title: str  # the model card's title: "<title> for `<target>`"
    card: Callable[[Drafter], str]  # the model card's design sentence, up to "and the target's head ..."
    shape: Callable[[Drafter], str]  # the model card's shape line
    options: Mapping[str, Any] = field(default_factory=dict)  # its settings (DrafterConfig.options), defaults
    keys: tuple[
        str, ...
    ] = ()  # top-level DrafterConfig keys it owns (eagle3's); another kind's keep defaults
    reads_layers: bool = False  # fuses target layers (``feature_layers``: the taps the target runs)
    # A new drafter's owned keys from its target (``DrafterConfig.for_target``), before any given.
    defaults: Callable[[Target], Mapping[str, Any]] = field(default=lambda target: {})
    start_from: Callable[[Drafter, Target], None] | None = None  # a new drafter's initialisation
    check: Callable[[DrafterConfig], None] | None = None  # refuses settings the kind cannot build
    # Training: None is teacher-forced (one step); else the unrolled steps for (config, ttt_steps).
    unroll: Callable[[DrafterConfig, int], int] | None = None
    feature_loss: bool = True  # f̂ regresses the target's next feature (``w_cls`` / ``w_feature``)


EAGLE = {
    "forward": eagle.forward,
    "new_cache": eagle.layer_cache,
    "title": "EAGLE drafter",
    "shape": eagle.layer_shape,
}

DRAFTERS: dict[str, DrafterKind] = {
    # The target's last hidden state, teacher-forced feature regression (EAGLE-1).
    "eagle1": DrafterKind(
        eagle.modules, eagle.last_state, head_input=eagle.as_is, card=eagle.eagle1_card, **EAGLE
    ),
    # Fused target layers, trained on its own unrolled outputs (EAGLE-3).
    "eagle3": DrafterKind(
        eagle.modules,
        eagle.fused_layers,
        head_input=eagle.own_norm,
        card=eagle.eagle3_card,
        **EAGLE,
        keys=("feature_layers", "input_norm", "tap_norm"),
        reads_layers=True,
        defaults=eagle.fused_defaults,
        start_from=eagle.norm_from_target,
        unroll=lambda config, ttt_steps: ttt_steps,
    ),
    # Residual heads on the target's last hidden state, one per draft depth (Medusa).
    "medusa": DrafterKind(
        medusa.modules,
        medusa.start_state,
        medusa.forward,
        medusa.head_input,
        medusa.no_cache,
        "Medusa-style drafter",
        medusa.card,
        medusa.shape,
        options={"heads": 4},  # head k drafts the token k past the bonus
        check=medusa.check,
        unroll=lambda config, ttt_steps: config.options["heads"],
        feature_loss=False,
    ),
}


def drafter_kind(kind: str) -> DrafterKind:
    if kind not in DRAFTERS:
        raise ValueError(f"drafter kind must be one of {list(DRAFTERS)}, got {kind!r}")
    return DRAFTERS[kind]
