"""A Medusa-style drafter (Cai et al., 2024): residual heads on the target's last hidden state.

Head k (1-based) drafts the token k positions past the bonus from h_t alone: ``r_k = h_t + SiLU(W_k h_t)``
through the frozen target head. It reads no drafted token and no position. To draft through the
engine's one-call-per-depth trees, its feature is a state of its own, [.., H + 1]: the target's h_t and,
in the last channel, the heads used so far (``state``, ``heads_used``). A call keeps h_t and counts up
(the drafted token's embedding is ignored), so a node at depth d drafts its children with head d + 1
whatever its path holds; deeper drafts reuse the last head. It trains as an unrolled drafter (step j
scores head j + 1), logits only: its state is no feature to regress. docs/extending.md, "Adding a drafter
kind", walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.drafters.base import Drafter, DraftInputs
from vdtrain.drafters.config import DrafterConfig
from vdtrain.drafters.registry import register


@dataclass(frozen=True)
class MedusaOptions:
    heads: int = 4  # head k drafts the token k past the bonus


def state(hidden: torch.Tensor, heads_used: torch.Tensor) -> torch.Tensor:
    """A Medusa feature: h_t [.., H] and the heads used so far [..] as one tensor [.., H + 1]."""
    return torch.cat([hidden, heads_used[..., None].to(hidden.dtype)], -1)


def heads_used(feature: torch.Tensor) -> torch.Tensor:
    """The heads used so far, read from a Medusa feature [.., H + 1]."""
    return feature[..., -1]


@register("medusa")
class MedusaDrafter(Drafter):
    """K residual heads on h_t, one per draft depth."""

    title: ClassVar[str] = "Medusa-style drafter"
    card_tags: ClassVar[tuple[str, ...]] = ("medusa",)
    Options: ClassVar[type] = MedusaOptions
    feature_loss: ClassVar[bool] = False

    def build(self, config: DrafterConfig) -> None:
        """One ``Linear(H → H)`` per head, zero at the start: every head then drafts what the target's head
        would from h_t (Medusa's initialisation)."""
        self.heads = nn.ModuleList(
            nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.options.heads)
        )
        for head in self.heads:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    @classmethod
    def check(cls, config: DrafterConfig) -> None:
        if config.options.heads < 1:
            raise ValueError(f"a medusa drafter needs heads >= 1, got {config.options.heads}")

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The target's final-norm ``hidden`` [.., H], no head used yet."""
        return state(hidden, hidden.new_zeros(hidden.shape[:-1]))

    def draft(self, features: torch.Tensor, rows: DraftInputs) -> torch.Tensor:
        """One draft depth: the same h_t, one more head used (nothing of ``rows`` is read)."""
        return state(features[..., :-1], heads_used(features) + 1)

    def normed(self, feature: torch.Tensor) -> torch.Tensor:
        """What the target's head reads [.., H]: head d's residual block on h_t, d the heads used (clamped
        to 1 .. heads)."""
        hidden = feature[..., :-1].to(self.heads[0].weight.dtype)
        blocks = torch.stack([hidden + F.silu(head(hidden)) for head in self.heads], -2)  # [.., K, H]
        which = heads_used(feature).round().long().clamp(1, len(self.heads)) - 1
        return blocks.gather(-2, which[..., None, None].expand(*which.shape, 1, hidden.shape[-1])).squeeze(-2)

    def unroll_steps(self, ttt_steps: int) -> int:
        """Step j scores head j + 1: as many steps as heads."""
        return self.options.heads

    def card(self) -> str:
        return (
            f"A Medusa-style drafter trained with vdtrain: {self.options.heads} heads, head k a residual "
            "block `h_t + SiLU(W_k h_t)` on the target's last hidden state drafting the token k positions "
            "ahead (a tree's depth-d nodes draft with head d + 1), and "
        )

    def shape(self) -> str:
        return f"Heads: {self.options.heads} residual blocks of width {self.config.hidden_size}"
