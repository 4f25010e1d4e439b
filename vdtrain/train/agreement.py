"""Simulated acceptance: how often the drafter, unrolled as a tree step runs it, agrees with the target.

Validation logs it per depth (``val/top1_depth{d}``, ``val/tau_sim``) and the acceptance report
(docs/evaluation.md) sets it beside what real decoding reached on the same prompts.
"""

from __future__ import annotations

import torch

from vdtrain.drafters.base import Drafter
from vdtrain.drafters.losses import image_target_mask, top_k_agreement
from vdtrain.drafters.rows import chain_rows
from vdtrain.targets.base import Condition, Target, split_taps


@torch.no_grad()
def unrolled_agreement(
    drafter: Drafter,
    hidden: torch.Tensor,
    tapped: torch.Tensor | None,
    tokens: torch.Tensor,
    cond_mask: torch.Tensor,
    depth: int,
) -> list[float]:
    """Top-1 agreement with the target's argmax at draft depths ``1 .. depth``, from the target's states
    (``hidden`` [B, L+N, H], ``tapped`` layers or None) on ``tokens`` [B, N]: depth ``d`` is unrolled step
    ``d - 1`` (``Drafter.unroll``) over the rows a decoding chain reaches (``chain_rows``)."""
    rows = image_target_mask(cond_mask, tokens.shape[1])
    target_logits = drafter.head_logits(hidden[:, 1:][rows])
    steps = drafter.unroll(drafter.input_features(hidden, tapped), tokens, cond_mask, depth)
    out = []
    for j, f_hat in enumerate(steps):
        chain = chain_rows(cond_mask, rows.shape[1], j).to(rows.device)[None].expand_as(rows)[rows]
        agree = top_k_agreement(drafter.logits(f_hat[rows][chain], j), target_logits[chain], None, 1)
        out.append(agree.item())
    return out


@torch.no_grad()
def depth_agreement(
    drafter: Drafter, target: Target, cond: Condition, tokens: torch.Tensor, depth: int
) -> list[float]:
    """Top-1 agreement of the drafter with the target's argmax at draft depths ``1 .. depth``,
    teacher-forced on the target's sequence (``cond``, image ``tokens`` [B, N]) and unrolled on the
    drafter's own features the way a tree step sees them. Works for every drafter kind. ``cond`` and
    ``tokens`` may be anywhere (the evaluation keeps decoded samples on the host): they go to the target."""
    cond, tokens = cond.to(target.device), tokens.to(target.device)
    states = target.sequence_features(cond, tokens, drafter.taps)
    hidden, tapped = split_taps(states.float(), target.hidden_size, len(drafter.taps))
    return unrolled_agreement(drafter, hidden, tapped, tokens, cond.mask, depth)
