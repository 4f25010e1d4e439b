"""Exact verification of a draft tree (ALGORITHMS.md §3): the output has exactly the target's
distribution, whatever the drafter proposed.

Walking down from the root, the children of the current node are tried in rank order:

- greedy (T = 0): a child is accepted iff it is the target's argmax;
- deterministic drafts (top-k children, EAGLE-2 dynamic trees): accept child ``c`` with probability
  ``p(c)``; on rejection set ``p(c) = 0`` and renormalise;
- sampled drafts (children drawn without replacement from ``q``, static trees at T > 0): accept ``c_i``
  with probability ``min(1, p(c_i) / q_i(c_i))`` where ``q_i`` is ``q`` without the earlier siblings,
  renormalised; on rejection ``p ← norm(max(0, p − q_i))`` (SpecInfer's recursive rejection sampling).

When no child is accepted the bonus token is drawn from the current ``p``. Every verification commits
at least that one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vdtrain.decode.trees import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, depth 1, 2, ... (the root is not included)
    bonus: int  # the token drawn after the last accepted node


def _normalise(p: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    if total <= 0:  # numerically exhausted: nothing left to reject into; keep the argmax mass
        return torch.zeros_like(p).scatter_(0, p.argmax().view(1), 1.0)
    return p / total


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def verify_exact(
    tree: DraftTree, row: int, p_nodes: torch.Tensor, greedy: bool, generator: torch.Generator | None
) -> Verdict:
    """Exact acceptance for one row. ``p_nodes`` [T, V]: the target distribution at every node (what
    the node's children should be drawn from), made by the one sampling pipeline."""
    tokens = tree.tokens[row]
    node, path = 0, []
    while True:
        p = p_nodes[node].double()
        kids = tree.children(row, node)
        accepted = None
        if greedy:
            best = int(p.argmax())
            accepted = next((c for c in kids if int(tokens[c]) == best), None)
        elif tree.sampled:
            q = tree.q[row, node].double()
            for c in kids:
                tok = int(tokens[c])
                q = _normalise(q)
                if _uniform(generator) * q[tok] < p[tok]:  # u < p/q without dividing by a zero q
                    accepted = c
                    break
                p = _normalise((p - q).clamp_min(0))
                q = q.clone()
                q[tok] = 0  # the next sibling was drawn without this one
        else:
            for c in kids:
                tok = int(tokens[c])
                if _uniform(generator) < p[tok]:
                    accepted = c
                    break
                p = p.clone()
                p[tok] = 0
                p = _normalise(p)
        if accepted is None:
            return Verdict(path, int(p.argmax()) if greedy else _draw(p.float(), generator))
        path.append(accepted)
        node = accepted
