"""The dense unroll that ``UnrollCache`` (vdtrain/drafters) replaced, kept as the reference its tests
compare against: step ``j`` attends over all ``(j + 1)·S`` keys of steps ``0 .. j`` under one mask, O(k²)
in the unroll depth."""

from __future__ import annotations

import torch

from vdtrain.drafters.base import Drafter
from vdtrain.drafters.rows import after_prefix_rows, teacher_mask


def tree_step_mask(cond_mask: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """What row ``s`` of unrolled step ``step`` may attend to: [B, 1, S, (step + 1)·S] over the keys of
    steps ``0 .. step`` (``S = seq_len`` rows each, in that order).

    Row ``s`` at step ``j`` stands for a depth-``j + 1`` draft node whose chain left the target's features
    at row ``s - j``: like that node in a tree step, it sees the teacher-forced (target-feature) rows up to
    ``s - j`` and, of each later step ``i``, only its own ancestor, row ``s - j + i``. Nothing after
    the chain's start, and no sibling chain."""
    teacher = teacher_mask(cond_mask, seq_len)[:, 0]  # [B, S, S]
    first = torch.zeros_like(teacher)
    first[:, step:] = teacher[:, : seq_len - step]
    q = torch.arange(seq_len, device=cond_mask.device)[:, None]
    k = torch.arange(seq_len, device=cond_mask.device)[None, :]
    ancestors = [(k - q == i - step).expand_as(teacher) for i in range(1, step + 1)]
    return torch.cat([first, *ancestors], dim=-1)[:, None]


class AppendCache:
    """A one-layer cache that appends each unrolled step's keys and values out of place, so gradients flow
    through every step (a preallocated cache is written in place, which autograd refuses)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def layer(self, index: int) -> AppendCache:
        return self

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if self.k.shape[2] != kv_len:
            raise ValueError(f"unrolled step has {self.k.shape[2]} keys but its mask covers {kv_len}")
        return self.k, self.v


def dense_unroll(
    drafter: Drafter, features: torch.Tensor, tokens: torch.Tensor, cond_mask: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """``Drafter.unroll`` with the dense ``tree_step_mask``: the same rows, O(k²) attention."""
    seq = features.shape[1] - 1
    embeds = after_prefix_rows(drafter.embed(tokens), drafter.config.prefix_length)
    positions = torch.arange(seq, device=features.device)
    cache = AppendCache()
    inputs, outs = features[:, :-1], []
    for step in range(steps):
        mask = tree_step_mask(cond_mask, seq, step)
        outs.append(drafter(inputs, embeds, positions, mask, cache, positions))
        inputs = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)
    return outs
