"""The drafter's training loss and the cheap signals logged with it (docs/training.md, "Choices this
implementation makes").

Only the ``N`` rows whose target feature predicts an image token are trained (``image_target_mask``):
docs/training.md, "Which rows are trained", says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def image_target_mask(cond_mask_or_prefix_len: torch.Tensor | int, num_image_tokens: int) -> torch.Tensor:
    """Bool mask over the ``L+N-1`` regression targets ``target_hidden[:, 1:]``: True on the rows trained.

    Row ``j`` (target slot ``j+1``) is trained iff ``L-1 <= j+1 <= L+N-2``, see the module docstring.
    Given a ``[B, L]`` condition mask, returns ``[B, L+N-1]`` (on its device); given ``L``, ``[L+N-1]``.
    The condition's padding does not matter: every trained slot is at or after the last caption row,
    which left padding always keeps real.
    """
    if isinstance(cond_mask_or_prefix_len, torch.Tensor):
        batch, prefix = cond_mask_or_prefix_len.shape
        device = cond_mask_or_prefix_len.device
    else:
        batch, prefix, device = None, int(cond_mask_or_prefix_len), None
    if prefix < 1:
        raise ValueError(f"prefix length must be >= 1, got {prefix}")
    target_slot = torch.arange(1, prefix + num_image_tokens, device=device)
    mask = (target_slot >= prefix - 1) & (target_slot <= prefix + num_image_tokens - 2)
    return mask if batch is None else mask.expand(batch, -1)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` [B, S] over the True (or weighted) entries of ``mask`` ([S] or [B, S])."""
    if mask is None:
        return values.mean()
    weights = mask.to(values.dtype).expand_as(values)
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


def feature_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SmoothL1 (beta 1) averaged over the hidden dim, then a masked mean over positions; fp32."""
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=1.0).mean(-1)
    return _masked_mean(per_position, mask)


def soft_ce(
    target_logits: torch.Tensor, pred_logits: torch.Tensor, mask: torch.Tensor | None, kind: str = "soft_ce"
) -> torch.Tensor:
    """``-(softmax(target) · log_softmax(pred)).sum(-1)`` (or another ``cls_per_row`` kind), masked mean;
    the target side carries no grad."""
    target_probs = target_logits.detach().float().softmax(-1)
    return _masked_mean(cls_per_row(target_probs, pred_logits, kind), mask)


CLS_LOSSES = ("soft_ce", "acceptance", "log_acceptance")


def cls_per_row(target_probs: torch.Tensor, pred_logits: torch.Tensor, kind: str = "soft_ce") -> torch.Tensor:
    """The token-distribution term per row [R] between the target's ``target_probs`` p and the drafter's
    ``pred_logits`` (q = softmax): ``soft_ce`` −Σ p log q (EAGLE's), or the chance that speculative
    sampling at T = 1 accepts a token drawn from q, ``α = Σ_v min(p_v, q_v)``, as ``acceptance`` 1 − α
    or ``log_acceptance`` −log α. Soft CE pulls q towards all of p; α rewards only the mass q shares with
    p, which is what acceptance pays for when the target spreads its mass over many image tokens."""
    pred_logits = pred_logits.float()
    if kind == "soft_ce":
        return -(target_probs * pred_logits.log_softmax(-1)).sum(-1)
    if kind not in CLS_LOSSES:
        raise ValueError(f"the cls loss must be one of {list(CLS_LOSSES)}, got {kind!r}")
    accepted = torch.minimum(target_probs, pred_logits.softmax(-1)).sum(-1)
    return 1.0 - accepted if kind == "acceptance" else -accepted.clamp_min(1e-6).log()


def top_k_agreement(
    pred_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None, k: int = 1
) -> torch.Tensor:
    """Fraction of (masked) positions where the target's argmax is among the drafter's top-k."""
    k = min(k, pred_logits.shape[-1])
    top = pred_logits.topk(k, dim=-1).indices
    hit = (top == target_logits.argmax(-1, keepdim=True)).any(-1)
    return _masked_mean(hit.float(), mask)


def drafter_loss(
    pred_feats: torch.Tensor,
    target_feats: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor,
    w_cls: float = 0.1,
    cls_loss: str = "soft_ce",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``feature_loss + w_cls · soft_ce(head(f), head(f̂))`` over the ``mask``ed positions (``cls_loss``:
    another ``cls_per_row`` kind in place of the soft CE).

    ``head`` maps features to logits (pass ``drafter.logits``: the frozen target head, fp32 out). Logits
    are computed only at the masked positions, so the ``[B, S, V]`` tensors never exist. ``parts`` holds
    detached scalars: ``feature``, ``cls``, ``top1`` (agreement) and ``total``.
    """
    mask = mask.bool().expand(pred_feats.shape[:-1])
    feat = feature_loss(pred_feats, target_feats, mask)
    pred_sel, target_sel = pred_feats[mask], target_feats[mask]
    pred_logits = head(pred_sel).float()
    with torch.no_grad():
        target_logits = head(target_sel.detach()).float()
    cls = soft_ce(target_logits, pred_logits, None, cls_loss) if pred_sel.shape[0] else feat.new_zeros(())
    total = feat + w_cls * cls
    with torch.no_grad():
        top1 = (
            top_k_agreement(pred_logits, target_logits, None, 1) if pred_sel.shape[0] else feat.new_zeros(())
        )
    parts = {"feature": feat.detach(), "cls": cls.detach(), "top1": top1, "total": total.detach()}
    return total, parts


def unrolled_loss(
    steps: Sequence[torch.Tensor],
    target_feats: torch.Tensor,
    normed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor,
    chains: Sequence[torch.Tensor],
    decay: float = 0.8,
    w_feature: float = 0.0,
    cls_loss: str = "soft_ce",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training-time test's loss: ``Σ_j decay^j · soft_ce_j`` over the unrolled ``steps`` (f̂ [B, S, H]
    each; ``cls_loss``: another ``cls_per_row`` kind in place of the soft CE), plus ``w_feature ·`` the
    mean SmoothL1 of ``normed(f̂)`` to the target's features if asked.

    Step ``j`` is scored on the ``mask``ed rows [B, S] that are also in ``chains[j]`` [S] (rows a decoding
    chain reaches at that depth), against the target's distribution ``head(target_feats)``; ``normed``
    maps drafter features to what ``head`` reads (``Drafter.normed``). ``parts``: ``cls`` (the weighted
    sum), ``feature``, ``top1`` (step 0), ``top1_step{j}`` and ``total``, detached.
    """
    mask = mask.bool().expand(target_feats.shape[:-1])
    with torch.no_grad():
        target_logits = head(target_feats[mask].detach()).float()
        target_probs = target_logits.softmax(-1)
    cls = target_feats.new_zeros((), dtype=torch.float32)
    feat = cls.clone()
    parts: dict[str, torch.Tensor] = {}
    for j, f_hat in enumerate(steps):
        keep = chains[j].to(mask.device)[None].expand_as(mask)[mask]
        if not keep.any():
            break
        drafted = normed(f_hat[mask][keep])
        logits = head(drafted).float()
        ce = cls_per_row(target_probs[keep], logits, cls_loss).mean()
        cls = cls + decay**j * ce
        if w_feature:
            feat = feat + decay**j * feature_loss(drafted, target_feats[mask][keep], None)
        with torch.no_grad():
            parts[f"top1_step{j}"] = top_k_agreement(logits, target_logits[keep], None, 1)
    total = cls + w_feature * feat
    top1 = parts.get("top1_step0", cls.new_zeros(()))
    parts = {"feature": feat.detach(), "cls": cls.detach(), "top1": top1, **parts}
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
    features: torch.Tensor, a: float = 0.1, generator: torch.Generator | None = None
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
