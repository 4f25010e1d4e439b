"""Couplings: how a draft carries over to a new target distribution p and stays a draw from it.

Jacobi-family methods recompute p for drafts they do not commit, then keep a draft for the next
verification, which judges it with q = p. Any rule that leaves a draw from p is lossless; a coupling
also keeps the old draft as often as it can, so the window changes little between steps (SCD). Maximal
coupling (SCD's π_MC, SJD-PAC's continuation) needs the q the draft was drawn from; Gumbel coupling
(SCD's π_GS) needs noise fixed per position until it is committed (``RowRandom.keyed``).
docs/decoding.md, "SCD: coupled Jacobi drafts", has the rules and why the release's stale q is wrong.
"""

from __future__ import annotations

import torch

from vdtrain.decode.rng import inverse_cdf

COUPLINGS = ("none", "maximal", "gumbel")  # none: a fresh draw from p (SJD's refinement)


def maximal_coupling(
    drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u_keep: torch.Tensor, u_redraw: torch.Tensor
) -> torch.Tensor:
    """Each draft x [...] (a draw from q [..., V]) kept with min(1, p(x)/q(x)), else redrawn from
    norm(max(0, p − q)): a draw from p equal to x with probability Σ min(p, q), the most any coupling
    gives. Where q is all zero (no draft) the result is a draw from p."""
    p, q = p.double(), q.double()
    p_x = p.gather(-1, drafts[..., None]).squeeze(-1)
    q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
    kept = (q_x > 0) & (u_keep * q_x < p_x)
    residual = (p - q).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p = q up to rounding: nothing to reject into, use p
    redraw = inverse_cdf(torch.where(empty, p, residual), u_redraw)
    return torch.where(kept, drafts, redraw)


def gumbel_max(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax(log p + G) [...] with G = −log(−log u) [..., V]: a draw from p. With the same ``u`` for a
    position at every step, drafts for nearby targets coincide often (the Gumbel coupling); zero-mass
    tokens are never drawn."""
    gumbel = -torch.log(-torch.log(u.double()))
    return (p.double().log() + gumbel).argmax(-1)
