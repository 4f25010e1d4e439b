"""How drafter rows line up with the target's slots: teacher forcing and its unrolled tree steps.

Row ``s`` of a drafter sequence pairs the target's feature at slot ``s`` with the embedding of the token at
slot ``s + 1`` and predicts ``f_{s+1}`` (docs/training.md, "The drafter's sequence alignment"); unrolled
step ``j`` of training-time test stands for the depth-``j + 1`` nodes of the draft trees decoding builds
(docs/training.md, "EAGLE-3 drafters").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vdtrain.targets.base import prefix_causal_mask


def teacher_inputs(
    target_hidden: torch.Tensor,
    tokens: torch.Tensor,
    prefix_length: int,
    embed: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ``f_s`` with ``e_{s+1}`` for ``s = 0 .. L+N-2``: the drafter's teacher-forced inputs.

    ``target_hidden`` [B, L+N, H] (final-norm states at every slot), ``tokens`` [B, N] image tokens,
    ``embed`` the target token embedding. Returns ``features`` = ``target_hidden[:, :-1]`` and
    ``next_embeds`` [B, L+N-1, H]: zeros for rows ``0 .. L-2`` (no token follows inside the prefix), then
    ``embed(tokens)`` (row ``L-1+i`` carries image token ``i``). The regression targets of those rows
    are ``target_hidden[:, 1:]`` (``feature_targets``).
    """
    seq = target_hidden.shape[1]
    n_tokens = tokens.shape[1]
    if seq != prefix_length + n_tokens:
        raise ValueError(
            f"target_hidden has {seq} slots but prefix {prefix_length} + {n_tokens} tokens = "
            f"{prefix_length + n_tokens}"
        )
    return target_hidden[:, :-1], after_prefix_rows(embed(tokens), prefix_length)


def after_prefix_rows(token_embeds: torch.Tensor, prefix_length: int) -> torch.Tensor:
    """The ``next_embeds`` of drafter rows ``0 ..``: zeros for the ``prefix_length - 1`` rows inside the
    prefix, then ``token_embeds`` [B, N, H] (row ``L - 1`` carries image token 0)."""
    batch, _, hidden = token_embeds.shape
    return torch.cat([token_embeds.new_zeros(batch, prefix_length - 1, hidden), token_embeds], dim=1)


def feature_targets(target_hidden: torch.Tensor) -> torch.Tensor:
    """What drafter row ``s`` regresses: ``f_{s+1}``, i.e. ``target_hidden[:, 1:]``."""
    return target_hidden[:, 1:]


def teacher_mask(cond_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``prefix_causal_mask`` over ``seq_len`` drafter slots, also when ``seq_len`` < the prefix length."""
    full = prefix_causal_mask(cond_mask, max(seq_len, cond_mask.shape[1]))
    return full[..., :seq_len, :seq_len]


def chain_start(prefix_length: int, step: int) -> int:
    """The first row of unrolled step ``step`` whose chain starts where decoding starts one: row ``L - 1``
    (the first root; decoding never drafts from inside the prefix) plus the steps drafted since."""
    return prefix_length - 1 + step


def chain_rows(cond_mask_or_prefix_len: torch.Tensor | int, seq_len: int, step: int) -> torch.Tensor:
    """Bool [S] over the rows of unrolled step ``step`` from its ``chain_start`` on."""
    prefix = (
        cond_mask_or_prefix_len.shape[1]
        if isinstance(cond_mask_or_prefix_len, torch.Tensor)
        else int(cond_mask_or_prefix_len)
    )
    return torch.arange(seq_len) >= chain_start(prefix, step)
