"""The drafter's training loss and the cheap signals logged with it (docs/training.md, "Choices this
implementation makes").

Only the ``N`` rows whose target feature predicts an image token are trained (``trained_rows``):
docs/training.md, "Which rows are trained", says why. The token-distribution term goes through the frozen
head a chunk of rows at a time (``vdtrain.drafters.head_loss``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.config import DrafterTrainConfig
from vdtrain.drafters.head_loss import head_token_loss
from vdtrain.drafters.rows import chain_start


def trained_rows(prefix_length: int, num_image_tokens: int) -> slice:
    """The rows ``j`` of the ``L+N-1`` regression targets ``target_hidden[:, 1:]`` that are trained: target
    slot ``j+1`` predicts an image token, ``L-1 <= j+1 <= L+N-2`` (see the module docstring). The same
    rows for every sample: the condition's padding does not matter, since every trained slot is at or after
    the last caption row, which left padding always keeps real."""
    if prefix_length < 1:
        raise ValueError(f"prefix length must be >= 1, got {prefix_length}")
    return slice(max(0, prefix_length - 2), prefix_length + num_image_tokens - 2)


def image_target_mask(cond_mask_or_prefix_len: torch.Tensor | int, num_image_tokens: int) -> torch.Tensor:
    """``trained_rows`` as a bool mask over the ``L+N-1`` regression targets: given a ``[B, L]`` condition
    mask, ``[B, L+N-1]`` (on its device); given ``L``, ``[L+N-1]``."""
    if isinstance(cond_mask_or_prefix_len, torch.Tensor):
        batch, prefix = cond_mask_or_prefix_len.shape
        device = cond_mask_or_prefix_len.device
    else:
        batch, prefix, device = None, int(cond_mask_or_prefix_len), None
    mask = torch.zeros(prefix + num_image_tokens - 1, dtype=torch.bool, device=device)
    mask[trained_rows(prefix, num_image_tokens)] = True
    return mask if batch is None else mask.expand(batch, -1)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` [B, S] over the True (or weighted) entries of ``mask`` ([S] or [B, S])."""
    if mask is None:
        return values.mean()
    weights = mask.to(values.dtype).expand_as(values)
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


def feature_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SmoothL1 (beta 1) averaged over the hidden dim, then a masked mean over positions; fp32."""
    return _masked_mean(_feature_per_row(pred, target), mask)


def _feature_per_row(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=1.0).mean(-1)


def top_k_agreement(
    pred_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None, k: int = 1
) -> torch.Tensor:
    """Fraction of (masked) positions where the target's argmax is among the drafter's top-k."""
    k = min(k, pred_logits.shape[-1])
    top = pred_logits.topk(k, dim=-1).indices
    hit = (top == target_logits.argmax(-1, keepdim=True)).any(-1)
    return _masked_mean(hit.float(), mask)


def teacher_loss(
    pred_feats: torch.Tensor,
    target_feats: torch.Tensor,
    normed: Callable[[torch.Tensor], torch.Tensor],
    head: nn.Module,
    prefix_length: int,
    *,
    w_cls: float = DrafterTrainConfig.w_cls,
    cls_loss: str = DrafterTrainConfig.cls_loss,
    chunks: int = DrafterTrainConfig.loss_chunks,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-1's loss on the ``trained_rows``: ``feature_loss + w_cls · soft_ce(head(f), head(normed(f̂)))``
    (``cls_loss``: another ``token_loss`` kind in place of the soft CE), ``f̂ = pred_feats`` and
    ``f = target_feats`` [B, L+N-1, H] each.

    ``head``: the frozen target head, scored in ``chunks`` chunks of rows (``head_token_loss``).
    ``parts`` holds detached scalars: ``feature``, ``cls``, ``top1`` (agreement) and ``total``.
    """
    rows = trained_rows(prefix_length, target_feats.shape[1] - prefix_length + 1)
    pred, target = pred_feats[:, rows], target_feats[:, rows]
    feat = feature_loss(pred, target, None)
    if pred.shape[1]:
        drafted = normed(pred).flatten(0, 1)[:, None]
        losses, hits = head_token_loss(drafted, target.flatten(0, 1), head, cls_loss, chunks)
        cls, top1 = losses.mean(), hits.float().mean()
    else:
        cls, top1 = feat.new_zeros(()), feat.new_zeros(())
    # a zero weight leaves its term out: Inductor would fold ``x + 0 · y`` into ``x``, and the loss it
    # returns beside that term detached then loses its gradient (torch 2.13)
    total = feat + w_cls * cls if w_cls else feat
    parts = {"feature": feat.detach(), "cls": cls.detach(), "top1": top1, "total": total.detach()}
    return total, parts


def unrolled_loss(
    steps: Sequence[torch.Tensor],
    target_feats: torch.Tensor,
    normed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head: nn.Module,
    prefix_length: int,
    *,
    decay: float = DrafterTrainConfig.ttt_decay,
    w_feature: float = DrafterTrainConfig.w_feature,
    cls_loss: str = DrafterTrainConfig.cls_loss,
    chunks: int = DrafterTrainConfig.loss_chunks,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training-time test's loss: ``Σ_j decay^j · soft_ce_j`` over the unrolled ``steps`` (f̂ [B, S, H]
    each; ``cls_loss``: another ``token_loss`` kind in place of the soft CE), plus ``w_feature ·`` the
    mean SmoothL1 of ``normed(f̂)`` to the target's features ``target_feats`` [B, S, H] if asked.

    Step ``j`` is scored on the ``trained_rows`` that a decoding chain reaches at that depth
    (``chain_start``), against the target's distribution ``head(target_feats)``; ``normed`` maps drafter
    features of step ``j``'s rows (offset ``j``) to what ``head`` reads (``Drafter.normed``). Every
    step's rows go through the frozen head together, in ``chunks`` chunks. ``parts``: ``cls`` (the
    weighted sum), ``feature``, ``top1`` (step 0), ``top1_step{j}`` and ``total``, detached.
    """
    batch = target_feats.shape[0]
    rows = trained_rows(prefix_length, target_feats.shape[1] - prefix_length + 1)
    width = rows.stop - rows.start
    firsts = [max(0, chain_start(prefix_length, j) - rows.start) for j in range(len(steps))]
    scored = [n for n in (width - first for first in firsts) if n > 0]  # rows per step; none: no step after
    cls = target_feats.new_zeros((), dtype=torch.float32)
    if not scored:
        return cls, {"feature": cls, "cls": cls, "top1": cls, "total": cls}
    device, depth = target_feats.device, len(scored)
    stacked = torch.stack([f_hat[:, rows] for f_hat in steps[:depth]], 2)  # [B, N, K, H]
    drafted = normed(stacked, torch.arange(depth, device=device))  # step j: rows at depth j
    target = target_feats[:, rows]
    losses, hits = head_token_loss(
        drafted.flatten(0, 1), target.flatten(0, 1), head, cls_loss, chunks
    )  # [B·N, K]
    reached = torch.arange(width, device=device)[:, None] >= torch.tensor(firsts[:depth], device=device)
    per_row = torch.tensor([decay**j / (batch * n) for j, n in enumerate(scored)], device=device)
    weights = reached * per_row  # [N, K]: decay^j / rows scored at step j, on those rows
    cls = (losses.view(batch, width, depth) * weights).sum()
    feat = cls.new_zeros(())
    if w_feature:
        feat = (_feature_per_row(drafted, target[:, :, None].expand_as(drafted)) * weights).sum()
    total = cls + w_feature * feat if w_feature else cls  # see teacher_loss
    agree = (
        (hits.view(batch, width, depth) & reached).sum((0, 1)) / torch.tensor(scored, device=device) / batch
    )
    parts = {"feature": feat.detach(), "cls": cls.detach(), "top1": agree[0]}
    parts |= {f"top1_step{j}": agree[j] for j in range(depth)}
    parts["total"] = total.detach()
    return total, parts


def simulated_tau(acc_per_depth: Sequence[float] | torch.Tensor) -> float:
    """Expected tokens per verification step of a single draft chain: ``1 + Σ_k Π_{i≤k} acc_i``.

    ``acc_i`` is the top-1 agreement of draft step ``i``; the chain approximation treats the steps as
    independent and greedy (a draft token counts only if all before it were accepted; the 1 is the bonus
    token). Teacher-forced training measures step 1 only: ``[acc_1] * depth`` is then an optimistic
    estimate, since later steps read the drafter's own features. It ignores trees (which accept more).
    """
    tau, run = 1.0, 1.0
    for acc in acc_per_depth:
        run *= float(acc)
        tau += run
    return tau


def uniform_feature_noise(
    features: torch.Tensor,
    a: float = DrafterTrainConfig.feature_noise,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``features + U(-a, a)``: the input-feature augmentation, with no 512/seq_len factor
    (docs/training.md, "Choices this implementation makes", Loss).

    Apply it to the drafter's *input* features only, never to the regression targets.
    """
    if a == 0:
        return features
    device = generator.device if generator is not None else features.device
    noise = torch.rand(features.shape, generator=generator, device=device, dtype=torch.float32)
    return features + ((noise * 2 - 1) * a).to(features.device, features.dtype)
