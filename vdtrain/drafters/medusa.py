"""A Medusa-style drafter (Cai et al., 2024): residual heads on the target's last hidden state.

Head k (1-based) drafts the token k positions past the bonus from h_t alone: ``r_k = h_t + SiLU(W_k h_t)``
through the frozen target head. It reads no drafted token and no position. To draft through the
engine's one-call-per-depth trees, its feature is the state ``(h_t, d)``: [.., H + 1], the target's
state and the heads used so far. A call keeps h_t and counts d up (the drafted token's embedding is
ignored), so a node at depth d drafts its children with head d + 1 whatever its path holds; deeper
drafts reuse the last head. It trains as an unrolled drafter (step j scores head j + 1), logits only:
its state is no feature to regress. docs/extending.md, "Adding a drafter kind", walks through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vdtrain.models.kv_cache import KVCache


# What the kind's functions receive: the ``Drafter`` (drafters/base.py) whose modules the kind made, and
# its ``DrafterConfig``; named without importing them, since drafters/base.py imports the kinds.
Drafter = nn.Module
DrafterConfig = Any


def modules(config: DrafterConfig) -> dict[str, nn.Module]:
    """One ``Linear(H → H)`` per head, zero at the start: every head then drafts what the target's head
    would from h_t (Medusa's initialisation)."""
    heads = nn.ModuleList(
        nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.options["heads"])
    )
    for head in heads:
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return {"heads": heads}


def check(config: DrafterConfig) -> None:
    if config.options["heads"] < 1:
        raise ValueError(f"a medusa drafter needs heads >= 1, got {config.options['heads']}")


def start_state(drafter: Drafter, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
    """The target's final-norm ``hidden`` [.., H] → the state [.., H + 1] with no head used yet."""
    return torch.cat([hidden, hidden.new_zeros(*hidden.shape[:-1], 1)], -1)


def forward(
    drafter: Drafter,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    cache: KVCache | None,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """One draft depth: states [B, S, H + 1] → the same h_t, one more head used (the embeddings
    ``next_embeds``, the ``positions``, ``mask``, ``cache`` and ``slots`` are not read)."""
    return torch.cat([features[..., :-1], features[..., -1:] + 1], -1)


def head_input(drafter: Drafter, state: torch.Tensor) -> torch.Tensor:
    """The state [.., H + 1] → what the target's head reads [.., H]: head d's residual block on h_t, d the
    heads used (clamped to 1 .. heads)."""
    first = drafter.heads[0]
    hidden = state[..., :-1].to(first.weight.dtype)
    blocks = torch.stack([hidden + F.silu(head(hidden)) for head in drafter.heads], -2)  # [.., K, H]
    which = state[..., -1].round().long().clamp(1, len(drafter.heads)) - 1
    return blocks.gather(-2, which[..., None, None].expand(*which.shape, 1, hidden.shape[-1])).squeeze(-2)


def no_cache(drafter: Drafter, batch: int, max_len: int) -> None:
    """Medusa heads attend to nothing: the engine keeps no drafter cache for them."""
    return None


def card(drafter: Drafter) -> str:
    return (
        f"A Medusa-style drafter trained with vdtrain: {drafter.config.options['heads']} heads, head k a "
        "residual block `h_t + SiLU(W_k h_t)` on the target's last hidden state drafting the token k "
        "positions ahead (a tree's depth-d nodes draft with head d + 1), and "
    )


def shape(drafter: Drafter) -> str:
    return f"Heads: {drafter.config.options['heads']} residual blocks of width {drafter.config.hidden_size}"
