"""Verification of a draft tree: exact (ALGORITHMS.md §3) and relaxed (LANTERN, LANTERN++, GSD; §4, §7).

Every rule shares one tree walk. Walking down from the root, the children of the current node are tried
in rank order; each child ``x`` is judged against the current target distribution ``p`` and the
proposal ``q_x`` it was drawn from:

- deterministic drafts (top-k children, EAGLE-2 dynamic trees): ``q_x`` is the point mass on ``x``;
- sampled drafts (children drawn without replacement from ``q``, static trees at T > 0): ``q_x`` is ``q``
  without the earlier siblings, renormalised (SpecInfer).

A rule turns ``(p, q_x, x)`` into a *group* G(x) of other tokens whose target mass is credited to ``x``
and an acceptance test ``u · Q < P`` (u ~ U[0, 1), one draw per tried child):

- exact: G = ∅, P = p(x), Q = q_x(x);
- LANTERN (δ): G = A(x), the longest prefix of x's first k latent neighbours with S_j ≤ δ
  (S_j = cumulative target mass of the first j); P = p(x) + S_|A|, Q = q_x(x);
- LANTERN++ (λ): the same with S_j ≤ (λ − 1)·p(x);
- GSD: G = C(x) minus x (a rank window around x, filtered by probability gap and embedding distance,
  see ``Grouped``); P = Σ_C p, Q = Σ_C q_x;

so exact verification accepts with ``min(1, p(x)/q_x(x))`` — with a point mass, with probability ``p(x)``.
On rejection ``p ← norm(max(0, p_G − q_x))`` and the next sibling is tried, where

- exact and GSD: ``p_G = p`` (GSD resamples from ``norm(max(0, p − q))`` over the full vocabulary);
- LANTERN / LANTERN++: ``p_G`` = the *unrelaxed* ``p`` with the mass of A(x) set to 0. This is the
  SpecInfer residual of the relaxed distribution ``p̃`` (p with A(x)'s mass moved onto ``x``): on
  rejection ``p̃(x) = P < q_x(x)``, so ``max(0, p̃ − q_x)`` is 0 on ``x`` and on A(x) and ``max(0, p − q_x)``
  elsewhere. With a point mass ``q_x`` it is ``p`` with ``x`` and A(x) zeroed, renormalised. One draft
  step therefore outputs exactly ``p̃`` (total-variation distance Σ_A p from ``p``); a later sibling's
  A is built on the residual, so mass already removed is never credited twice.

When no child is accepted the bonus token is drawn from the current ``p``; every verification commits
at least that one token.

Greedy (T = 0), where ``p`` is the one-hot of the argmax: exact accepts the child equal to the argmax.
A relaxed rule, when no child equals the argmax, accepts the first child (rank order) whose group holds
the argmax; the group is computed on ``p_relax``, the temperature-1 softmax of the same CFG-combined,
filtered logits (the engine passes it to rules with ``needs_soft_p``). The committed token is the draft,
the bonus is the argmax at the last accepted node.

δ = 0, λ = 1 and G = 1 reproduce exact verification bit for bit: same acceptances, same residuals, the
same random draws. ``Verdict.relaxed`` counts the acceptances that exact verification would have refused
with the same uniform draw (at T = 0: accepted although not the argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vdtrain.decode.trees import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, depth 1, 2, ... (the root is not included)
    bonus: int  # the token drawn after the last accepted node
    relaxed: int = 0  # accepted nodes that only a relaxed rule accepted


def _normalise(p: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    if total <= 0:  # numerically exhausted: nothing left to reject into; keep the argmax mass
        return torch.zeros_like(p).scatter_(0, p.argmax().view(1), 1.0)
    return p / total


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else None  # a CUDA generator draws on its GPU
    return float(torch.rand((), generator=generator, device=device))


def residual(p: torch.Tensor, q: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """The distribution to continue with after rejecting a child: ``norm(max(0, p_G − q))`` where
    ``p_G`` is ``p`` with the tokens ``removed`` set to 0 (LANTERN's A(x); empty for exact and GSD)."""
    if len(removed):
        p = p.index_fill(0, removed, 0.0)
    return _normalise((p - q).clamp_min(0))


class Rule:
    """Exact verification. The relaxed rules are small frozen dataclasses deriving from it that widen
    the group of tokens credited to a child; all are callables with ``verify_exact``'s signature (plus
    ``p_relax``) and share ``walk``."""

    needs_soft_p: ClassVar[bool] = False  # wants the T = 1 softmax at T = 0 (``p_relax``)
    removes_group: ClassVar[bool] = False  # the residual drops the group's mass (LANTERN)
    credits_q: ClassVar[bool] = False  # Q sums q over the group too (GSD)

    def group(self, p: torch.Tensor, token: int) -> torch.Tensor:
        """Other tokens whose target mass is credited to ``token`` (LongTensor, may be empty)."""
        return p.new_zeros(0, dtype=torch.long)

    def masses(
        self, p: torch.Tensor, q: torch.Tensor, token: int, group: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, Q): the child is accepted iff ``u · Q < P``."""
        if not len(group):
            return p[token], q[token]
        q_mass = q[token] + q[group].sum() if self.credits_q else q[token]
        return p[token] + p[group].sum(), q_mass

    def __call__(
        self,
        tree: DraftTree,
        row: int,
        p_nodes: torch.Tensor,
        greedy: bool,
        generator: torch.Generator | None,
        p_relax: torch.Tensor | None = None,
    ) -> Verdict:
        return walk(self, tree, row, p_nodes, greedy, generator, p_relax)


def walk(
    rule: Rule,
    tree: DraftTree,
    row: int,
    p_nodes: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None,
    p_relax: torch.Tensor | None = None,
) -> Verdict:
    """The one tree walk. ``p_nodes`` [T, V]: the target distribution at every node (what its children
    should be drawn from), made by the one sampling pipeline; ``p_relax`` [T, V]: at T = 0 the softmax
    of the same filtered logits, where relaxed rules look for the argmax's group."""
    tokens = tree.tokens[row]
    node, path, relaxed = 0, [], 0
    while True:
        p = p_nodes[node].double()
        kids = tree.children(row, node)
        accepted = None
        if greedy:
            best = int(p.argmax())
            accepted = next((c for c in kids if int(tokens[c]) == best), None)
            if accepted is None and p_relax is not None:
                soft = p_relax[node].double()
                accepted = next((c for c in kids if best in rule.group(soft, int(tokens[c])).tolist()), None)
                relaxed += accepted is not None
        else:
            q = tree.q[row, node].double() if tree.sampled else None
            for c in kids:
                tok = int(tokens[c])
                if tree.sampled:
                    q = _normalise(q)
                    q_c = q
                else:  # deterministic draft: a point mass on the child
                    q_c = torch.zeros_like(p)
                    q_c[tok] = 1.0
                group = rule.group(p, tok)
                p_mass, q_mass = rule.masses(p, q_c, tok, group)
                u = _uniform(generator)
                if u * q_mass < p_mass:  # u < P/Q without dividing by a zero Q
                    accepted = c
                    relaxed += not bool(u * q_c[tok] < p[tok])
                    break
                p = residual(p, q_c, group if rule.removes_group else group[:0])
                if tree.sampled:
                    q = q.clone()
                    q[tok] = 0  # the next sibling was drawn without this one
        if accepted is None:
            bonus = int(p.argmax()) if greedy else _draw(p.float(), generator)
            return Verdict(path, bonus, relaxed)
        path.append(accepted)
        node = accepted


EXACT = Rule()


def verify_exact(
    tree: DraftTree, row: int, p_nodes: torch.Tensor, greedy: bool, generator: torch.Generator | None
) -> Verdict:
    """Exact acceptance for one row (lossless): the output has exactly the target's distribution."""
    return walk(EXACT, tree, row, p_nodes, greedy, generator)


@dataclass(frozen=True, eq=False)
class _NeighbourRule(Rule):
    """LANTERN-style relaxation: A(x) = the longest prefix of x's first ``k`` latent neighbours (all K
    when k ≥ K) whose cumulative target mass S_j stays ≤ ``bound``. S_j never decreases, so the prefix
    is a count."""

    neighbours: torch.Tensor  # [V, K] latent neighbour table (``vdtrain.decode.neighbours``)
    k: int

    needs_soft_p: ClassVar[bool] = True
    removes_group: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    def bound(self, p_token: float) -> float:
        raise NotImplementedError

    def group(self, p: torch.Tensor, token: int) -> torch.Tensor:
        near = self.neighbours[token, : self.k].to(p.device)
        cumulative = p[near].cumsum(0)
        return near[: int((cumulative <= self.bound(float(p[token]))).sum())]


@dataclass(frozen=True, eq=False)
class Lantern(_NeighbourRule):
    """LANTERN: additive bound, Σ_A p ≤ δ."""

    delta: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delta < 0:
            raise ValueError(f"LANTERN needs delta >= 0, got {self.delta}")

    def bound(self, p_token: float) -> float:
        return self.delta


@dataclass(frozen=True, eq=False)
class LanternPP(_NeighbourRule):
    """LANTERN++: multiplicative bound, Σ_A p ≤ (λ − 1)·p(x), so p'(x) ≤ λ·p(x)."""

    lam: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lam < 1:
            raise ValueError(f"LANTERN++ needs lam >= 1, got {self.lam}")

    def bound(self, p_token: float) -> float:
        return (self.lam - 1.0) * p_token


@dataclass(frozen=True, eq=False)
class Grouped(Rule):
    """GSD grouped acceptance on drafter trees.

    Sort ``p`` by probability (descending, ties by token id) and let ``r`` be x's rank. Candidates are
    the tokens at ranks ``[r − G//2, r − G//2 + G)`` clipped to the vocabulary (the published slice
    ``[idx − G//2 : idx + G//2]`` for even G, without its wrap-around at the top ranks; G = 1 is x
    alone). C(x) keeps x and the candidates c with ``|p(c) − p(x)| < delta_p`` and
    ``D(x, c) < max_distance``, D = squared L2 distance between rows of ``embeddings``. Accept with
    ``min(1, Σ_C p / Σ_C q_x)``; the committed token is x; on rejection resample from
    ``norm(max(0, p − q_x))`` over the full vocabulary.
    """

    embeddings: torch.Tensor  # [V, E]: the target's input token embeddings (or the codebook)
    group_size: int = 14
    delta_p: float = 0.15
    max_distance: float = 0.5

    needs_soft_p: ClassVar[bool] = True
    credits_q: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"GSD needs group_size >= 1, got {self.group_size}")

    def group(self, p: torch.Tensor, token: int) -> torch.Tensor:
        if self.group_size == 1:
            return p.new_zeros(0, dtype=torch.long)
        order = p.sort(descending=True, stable=True).indices
        rank = int((p > p[token]).sum() + (p[:token] == p[token]).sum())  # x's place in ``order``
        lo = max(0, rank - self.group_size // 2)
        window = order[lo : max(0, rank - self.group_size // 2 + self.group_size)]
        window = window[window != token]
        close_p = (p[window] - p[token]).abs() < self.delta_p
        emb = self.embeddings.to(p.device)
        dist = (emb[window].double() - emb[token].double()).pow(2).sum(-1)
        return window[close_p & (dist < self.max_distance)]
