"""The token-distribution term of the drafter's loss, through the frozen target head, a chunk of rows at a
time: the [rows, V] logits never exist whole (docs/training.md, "Training speed").

Every scored row pairs the drafter's features with the target's (eagle1: one drafter pass per target row;
an unrolled kind: one per unrolled step). A chunk of target rows goes through the head once, its
drafter rows beside it, and each row's loss and its gradient with respect to the drafter's features are
computed there and then: the head is frozen, so the backward pass needs nothing else, and nothing of the
size of the logits is kept for it ([rows, H] gradients instead).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.config import DrafterTrainConfig

CLS_LOSSES = ("soft_ce", "acceptance", "log_acceptance")
ACCEPTANCE_FLOOR = 1e-6  # log_acceptance clamps α here (−log 0 is no loss to train on)


def check_cls_loss(kind: str) -> None:
    if kind not in CLS_LOSSES:
        raise ValueError(f"the cls loss must be one of {list(CLS_LOSSES)}, got {kind!r}")


def token_loss(
    target_probs: torch.Tensor, pred_logits: torch.Tensor, kind: str = DrafterTrainConfig.cls_loss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row [...] between the target's ``target_probs`` p and the drafter's ``pred_logits`` (q = softmax;
    [..., V] each, broadcast), and its gradient with respect to ``pred_logits`` (fp32): ``soft_ce`` −Σ p log q
    (EAGLE's), or the chance that speculative sampling at T = 1 accepts a token drawn from q,
    ``α = Σ_v min(p_v, q_v)``, as ``acceptance`` 1 − α or ``log_acceptance`` −log α. Soft CE pulls q
    towards all of p; α rewards only the mass q shares with p, which is what acceptance pays for when the
    target spreads its mass over many image tokens.

    The gradient is what autograd gives the same expressions (tests/reference_losses.py), ties of ``min``
    split in half as ``torch.minimum`` splits them."""
    check_cls_loss(kind)
    log_q = pred_logits.float().log_softmax(-1)
    if kind == "soft_ce":
        loss = -(target_probs * log_q).sum(-1)
        return loss, log_q.exp_().mul_(target_probs.sum(-1, keepdim=True)).sub_(target_probs)  # in place
    q = log_q.exp_()
    alpha = torch.minimum(target_probs, q).sum(-1)
    # dα/dz_v = Σ_u m_u q_u (δ_uv − q_v), m_u the share of min's gradient q_u gets
    shared = (q < target_probs).float().add_((q == target_probs).float(), alpha=0.5).mul_(q)
    d_alpha = shared.sub_(q.mul_(shared.sum(-1, keepdim=True)))
    if kind == "acceptance":
        return 1.0 - alpha, d_alpha.neg_()
    clamped = alpha.clamp_min(ACCEPTANCE_FLOOR)
    passes = (alpha >= ACCEPTANCE_FLOOR).float() / clamped
    return -clamped.log(), d_alpha.mul_(-passes[..., None])


def split_head(head: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, nn.Linear]:
    """The head as (what runs before its last ``nn.Linear``, that linear): a linear alone, or a head naming
    them ``inner`` and ``final`` (Janus's generation head)."""
    if isinstance(head, nn.Linear):
        return None, head
    inner, final = getattr(head, "inner", None), getattr(head, "final", None)
    if not callable(inner) or not isinstance(final, nn.Linear):
        raise TypeError(
            f"the target head {type(head).__name__} is neither an nn.Linear nor names its last linear "
            "(`final`) and what runs before it (`inner`): the chunked loss cannot read it"
        )
    return inner, final


class _ChunkedHeadLoss(torch.autograd.Function):
    """(drafted [T, K, H], target [T, H]) → per-entry loss [T, K] and top-1 hits [T, K]; see the module
    docstring. The gradient with respect to ``drafted`` is computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, drafted, target, weight, bias, kind: str, chunks: int):
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            raise ValueError("the chunked head loss needs a frozen head (its weight gets no gradient)")
        per_chunk = -(-drafted.shape[0] // chunks)  # target rows a chunk takes, its drafter rows beside them
        losses, grads, drafted_top, target_top = [], [], [], []
        for chunk in range(chunks):  # a fixed count: as many kernels, and as much to compile, at any batch
            rows = slice(chunk * per_chunk, (chunk + 1) * per_chunk)  # the last may be short, or empty
            target_logits = F.linear(target[rows, None], weight, bias).float()  # [c, 1, V]
            target_top.append(target_logits.argmax(-1))
            probs = target_logits.softmax(-1)
            del target_logits  # a chunk holds as few [c, K, V] tensors at once as it can
            pred_logits = F.linear(drafted[rows], weight, bias).float()  # [c, K, V]
            drafted_top.append(pred_logits.argmax(-1))
            loss, grad_logits = token_loss(probs, pred_logits, kind)
            del pred_logits, probs
            losses.append(loss)
            if ctx.needs_input_grad[0]:
                grads.append((grad_logits.to(weight.dtype) @ weight).float())
            del grad_logits
        hits = torch.cat(drafted_top) == torch.cat(target_top)  # the drafter's argmax is the target's
        ctx.mark_non_differentiable(hits)
        grads = torch.cat(grads) if grads else None
        ctx.save_for_backward(grads)
        ctx.input_dtype = drafted.dtype
        return torch.cat(losses), hits

    @staticmethod
    def backward(ctx, grad_losses, _grad_hits):
        (grads,) = ctx.saved_tensors
        return (grads * grad_losses[..., None]).to(ctx.input_dtype), None, None, None, None, None


def head_token_loss(
    drafted: torch.Tensor, target: torch.Tensor, head: nn.Module, kind: str, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry token loss [T, K] (``token_loss`` of ``head(target)`` against ``head(drafted)``; a gradient
    to ``drafted``) and top-1 hits [T, K] of the drafter's features ``drafted`` [T, K, H] (K drafter rows
    per target row: unrolled steps) against the target's final-norm states ``target`` [T, H], through the
    frozen ``head`` in its weights' dtype, in ``chunks`` chunks of target rows (each with its drafter rows):
    the loss holds ``1 / chunks`` of the logits at a time."""
    check_cls_loss(kind)
    if chunks < 1:
        raise ValueError(f"drafter.loss_chunks must be >= 1, got {chunks}")
    inner, final = split_head(head)
    dtype = next(head.parameters()).dtype
    drafted, target = drafted.to(dtype), target.detach().to(dtype)
    if inner is not None:
        drafted = inner(drafted)
        with torch.no_grad():
            target = inner(target)
    return _ChunkedHeadLoss.apply(drafted, target, final.weight, final.bias, kind, chunks)
