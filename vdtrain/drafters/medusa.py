"""A Medusa-style drafter (Cai et al., 2024): residual heads on the target's last hidden state.

Head k (1-based) drafts the token k positions past the bonus from h_t alone: ``r_k = h_t + SiLU(W_k h_t)``
through the frozen target head. It reads no drafted token and no position: a call keeps h_t as its
feature, and the head is its rows' ``offset`` (their place past the root) + 1, so a node at depth d drafts
its children with head d + 1 whatever its path holds; deeper drafts reuse the last head. That is a block
tree's reading too ("slot d's q whatever its path holds"): the kind drafts a block, all its heads in one
forward (``vdtrain.decode.builders.block``), as well as one depth per call in the engine's other trees.
It trains as an unrolled drafter (step j scores head j + 1), logits only: h_t is no feature to regress.
docs/extending.md, "Adding a drafter kind", walks through it.
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


@register("medusa")
class MedusaDrafter(Drafter):
    """K residual heads on h_t, one per draft depth."""

    title: ClassVar[str] = "Medusa-style drafter"
    card_tags: ClassVar[tuple[str, ...]] = ("medusa",)
    Options: ClassVar[type] = MedusaOptions
    feature_loss: ClassVar[bool] = False
    drafts_blocks: ClassVar[bool] = True  # block query row j reads head j + 1: all heads in one forward

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

    @property
    def block_slots(self) -> int:
        """A block as long as the image: past the heads, the last one drafts (as in the other trees)."""
        return self.config.num_image_tokens

    def draft(self, features: torch.Tensor, rows: DraftInputs) -> torch.Tensor:
        """One draft depth: the same h_t (nothing of ``rows`` is read here; ``normed`` reads their offset)."""
        return features

    def normed(self, feature: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """What the target's head reads [.., H]: head ``offset + 1``'s residual block on h_t (the last head
        past them all); ``offset`` an int for every row, or a tensor broadcast to the rows."""
        hidden, last = feature.to(self.heads[0].weight.dtype), len(self.heads) - 1
        if isinstance(offset, int):
            head = self.heads[min(offset, last)]
            return hidden + F.silu(head(hidden))
        blocks = torch.stack([hidden + F.silu(head(hidden)) for head in self.heads], -2)  # [.., K, H]
        which = offset.clamp_max(last).expand(hidden.shape[:-1])
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
