"""The drafter loss as it was before the chunked head loss (``vdtrain.drafters.head_loss``) replaced it,
kept as the reference the new loss and its gradients are compared with (tests/test_train_speed.py) and
measured against (``python -m benchmarks.train_throughput --reference-loss``): every [rows, V] logits
tensor whole, autograd through them, a Python loop over the unrolled steps with boolean-mask row
selection."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vdtrain.drafters.losses import _masked_mean, feature_loss, top_k_agreement


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
    normed: Callable[[torch.Tensor, int], torch.Tensor],
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
    maps step ``j``'s drafter features (offset ``j``) to what ``head`` reads (``Drafter.normed``).
    ``parts``: ``cls`` (the weighted sum), ``feature``, ``top1`` (step 0), ``top1_step{j}`` and
    ``total``, detached.
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
        drafted = normed(f_hat[mask][keep], j)
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


def block_loss(drafter, batch, train) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A block drafter's loss as it was before it compiled (issue #55): only the query rows that draft an
    image token kept, by boolean indexing (data-dependent shapes), their per-slot agreement over a Python
    ``if .any()``, the chain estimate from Python floats."""
    from vdtrain.drafters import losses
    from vdtrain.drafters.head_loss import head_token_loss

    tokens, cond_mask, hidden, hidden_in, tapped, roots = batch
    prefix, num = cond_mask.shape[1], tokens.shape[1]
    states = drafter.input_features(hidden_in, tapped)
    rows, queries, drafted = drafter.teacher_blocks(states, tokens, cond_mask, roots)
    total, parts = losses.teacher_loss(
        rows, hidden[:, 1:], drafter.normed, drafter.head, prefix,
        w_cls=train.w_cls, cls_loss=train.cls_loss, chunks=train.loss_chunks,
    )  # fmt: skip
    valid = (drafted < num).flatten()
    slot_of = (drafted - roots[:, None]).flatten()[valid] - 1
    size, scored = len(tokens), int(valid.sum())
    target = hidden[:, prefix + drafted.flatten()[valid] - 1]
    drafts = drafter.normed(queries.flatten(1, 2)[:, valid])
    per_row, hits = head_token_loss(
        drafts.flatten(0, 1)[:, None], target.flatten(0, 1), drafter.head, train.cls_loss, train.loss_chunks
    )
    per_row, hits = per_row.view(size, scored), hits.view(size, scored).float()
    block = (per_row * train.ttt_decay ** slot_of.float()).mean()
    total = total + block
    agreement = [parts["top1"]]
    for k in range(1, drafted.shape[1] + 1):
        at = slot_of == k
        parts[f"top1_slot{k}"] = hits[:, at].mean() if at.any() else hits.new_zeros(())
        agreement.append(parts[f"top1_slot{k}"])
    parts["tau_block"] = hits.new_tensor(losses.simulated_tau(agreement))
    parts["block"] = block.detach()
    parts["total"] = total.detach()
    return total, parts
