"""Training-time test's attention in O(k): the teacher keys once, then one diagonal of ancestor keys per
unrolled step (docs/training.md, "EAGLE-3 drafters").

Row ``s`` of unrolled step ``j`` stands for the depth-``j + 1`` node of a chain that left the target's
features at row ``s - j``. Like that node in a tree step it sees the teacher-forced rows that row ``s - j``
sees and, of each later step ``i = 1 .. j``, only its own ancestor, row ``s - j + i``. A dense mask over
all ``(j + 1)·S`` keys of steps ``0 .. j`` says the same at ``k(k+1)/2`` teacher passes for ``k`` steps;
here step ``j`` scores the ``S`` teacher keys plus ``j`` keys per row, so ``k`` steps cost about ``k``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vdtrain.models.kv_cache import AttendingCache


def shift_rows(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x`` (rows on dim 2) moved ``by`` rows down: row ``s`` holds row ``s - by``, zeros above."""
    if by == 0:
        return x
    pad = x.new_zeros(*x.shape[:2], by, *x.shape[3:])
    return torch.cat([pad, x[:, :, : x.shape[2] - by]], dim=2)


class UnrollCache(AttendingCache):
    """One drafter layer's keys and values across unrolled steps, kept out of place so gradients flow
    through every step. Each step is a forward over all ``S`` rows under the teacher mask [B, 1, S, S]."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def layer(self, index: int) -> UnrollCache:
        return self

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own keys: ``attend`` keeps them once the heads are expanded."""
        if k.shape[2] != kv_len:
            raise ValueError(f"an unrolled step has {k.shape[2]} rows but its teacher mask covers {kv_len}")
        return k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        step = len(self.k)
        self.k.append(k)
        self.v.append(v)
        if step == 0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        rows = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        # Teacher keys: row s sees what the chain's start, row s - step, saw.
        allowed = mask if mask.dtype == torch.bool else mask == 0  # an additive bias: 0 where visible
        teacher = shift_rows(allowed.expand(q.shape[0], -1, -1, -1), step)
        # Ancestors: step i's row s - step + i, one key per row, laid along a new key axis.
        keys = torch.stack([shift_rows(self.k[i], step - i) for i in range(1, step + 1)], dim=3)
        values = torch.stack([shift_rows(self.v[i], step - i) for i in range(1, step + 1)], dim=3)
        row, i = torch.arange(rows, device=q.device), torch.arange(1, step + 1, device=q.device)
        ancestors = (row[:, None] - step + i >= 0).expand(q.shape[0], 1, -1, -1)
        scores = torch.cat(
            [q @ self.k[0].transpose(-1, -2), torch.einsum("bhsd,bhsjd->bhsj", q, keys)], dim=-1
        )
        visible = torch.cat([teacher, ancestors], dim=-1)
        weights = (scores * scale).masked_fill(~visible, float("-inf")).softmax(-1)
        first = weights[..., :rows] @ self.v[0]
        return first + torch.einsum("bhsj,bhsjd->bhsd", weights[..., rows:], values)
