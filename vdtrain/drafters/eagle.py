"""The EAGLE drafter kinds: ``fc([embed(x_{t+1}); f_t])`` through one decoder layer of the target's family.

``eagle1`` reads the target's last (final-norm) hidden state and regresses the next one, teacher-forced.
``eagle3`` fuses low, middle and high target layers (``fuse``), normalises its output before the head
and is trained on its own unrolled outputs (docs/training.md, "EAGLE-3 drafters"). Both are rows of
``vdtrain.drafters.registry.DRAFTERS``; the functions here receive the ``Drafter`` whose modules they made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vdtrain.models.kv_cache import KVCache

if TYPE_CHECKING:
    from vdtrain.targets.base import Target


# What the kind's functions receive: the ``Drafter`` (drafters/base.py) whose modules the kind made, and
# its ``DrafterConfig``; named without importing them, since drafters/base.py imports the kinds.
Drafter = nn.Module
DrafterConfig = Any


def modules(config: DrafterConfig) -> dict[str, nn.Module]:
    """The drafter's own modules, in registration order (their names are the saved weights' prefixes)."""
    hidden, out = config.hidden_size, {}
    if config.feature_layers:  # as EAGLE-3: a bias-free fusion, a norm before the head
        out["fuse"] = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        out["norm"] = nn.RMSNorm(hidden, eps=1e-6)
    if config.tap_norm:
        out["tap_norms"] = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6) for _ in config.feature_layers)
    if config.input_norm:  # the embedding (~0.08) and the features (~1.7) put on one scale
        out["embed_norm"] = nn.RMSNorm(hidden, eps=1e-6)
        out["feature_norm"] = nn.RMSNorm(hidden, eps=1e-6)
    out["fc"] = nn.Linear(2 * hidden, hidden, bias=True)
    out["layer"] = config.layer_class(hidden, config.prefix_length, config.grid, config.layer)
    return out


def last_state(drafter: Drafter, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
    """eagle1's view of the target: its final-norm ``hidden`` [.., H] as is."""
    return hidden


def fused_layers(drafter: Drafter, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
    """eagle3's view of the target: ``fuse`` over the ``tapped`` layers [.., k·H] → [.., H]."""
    if tapped is None:
        raise ValueError(
            f"an eagle3 drafter reads target layers {list(drafter.taps)}: run the target with taps"
        )
    tapped = tapped.to(drafter.fuse.weight.dtype)
    if drafter.config.tap_norm:
        parts = tapped.split(drafter.config.hidden_size, dim=-1)
        tapped = torch.cat([norm(part) for norm, part in zip(drafter.tap_norms, parts, strict=True)], -1)
    return drafter.fuse(tapped)


def forward(
    drafter: Drafter,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    cache: KVCache | None,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """Rows ``fc([next_embeds; features])`` ([B, S, H] each) through the layer at ``positions`` [B, S]
    → f̂ [B, S, H] (``Drafter.forward`` has the cache's contract)."""
    dtype = drafter.fc.weight.dtype
    next_embeds, features = next_embeds.to(dtype), features.to(dtype)
    if drafter.config.input_norm:  # a zero embedding (prefix rows) stays zero
        next_embeds, features = drafter.embed_norm(next_embeds), drafter.feature_norm(features)
    x = drafter.fc(torch.cat([next_embeds, features], dim=-1))
    return drafter.layer(x, positions, mask, cache, slots)


def as_is(drafter: Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """eagle1's f̂ [.., H] goes to the head as is: it regresses final-norm states."""
    return hidden


def own_norm(drafter: Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """eagle3's f̂ [.., H] through its own norm before the head."""
    return drafter.norm(hidden.to(drafter.norm.weight.dtype))


def layer_cache(drafter: Drafter, batch: int, max_len: int) -> KVCache:
    return drafter.layer.new_cache(batch, max_len)


@torch.no_grad()
def norm_from_target(drafter: Drafter, target: Target) -> None:
    """A new eagle3 drafter's norm starts as the target's final norm, so its first logits are on the head's
    scale."""
    final_norm = getattr(target.transformer, "norm", None)
    if final_norm is not None:
        drafter.norm.weight.copy_(final_norm.weight.float())


def fused_defaults(target: Target) -> dict[str, object]:
    """A new eagle3 drafter's settings: the family's layers, its inputs normalised (as EAGLE-3)."""
    return {"feature_layers": target.default_feature_layers(), "input_norm": True}


def eagle1_card(drafter: Drafter) -> str:
    c = drafter.config
    return (
        "A speculative-decoding drafter trained with vdtrain: `fc([embed(x_{t+1}); f_t])` followed"
        f" by one {c.family} decoder layer predicts the target's next hidden state, and "
    )


def eagle3_card(drafter: Drafter) -> str:
    c = drafter.config
    norms = "".join(
        note
        for on, note in (
            (c.tap_norm, "each layer RMS-normalised, "),
            (c.input_norm, "the embedding and `g_t` RMS-normalised before `fc`, "),
        )
        if on
    )
    return (
        f"An EAGLE-3 drafter trained with vdtrain: the target's layers {list(c.feature_layers)} "
        "(residual stream after that many decoder layers) are fused into `g_t = fuse([h_k; ...])`, "
        f"{norms}`fc([embed(x_{{t+1}}); g_t])` followed by one {c.family} decoder layer and a norm "
        "drafts the next token, trained on its own unrolled outputs (training-time test), and "
    )


def layer_shape(drafter: Drafter) -> str:
    """The card's shape line: the width and the decoder layer's hyper-parameters."""
    return f"Layer: hidden size {drafter.config.hidden_size}, {drafter.layer.describe()}"
