"""Verification of draft trees, every row at once: exact and relaxed (LANTERN, LANTERN++, GSD).

A rule turns a tried child ``x`` into a *group* G(x) of other tokens whose target mass is credited to
``x`` and an acceptance test ``u · Q < P`` (exact: G = ∅, P = p(x), Q = q_x(x)); on rejection the walk
continues with the residual ``norm(max(0, p_G − q_x))``. ``accept_batch`` judges every node of every
row with tensor ops only (no read of the device, loops bounded by the tree's depth and width), given
pre-drawn uniforms. docs/decoding.md, "Exact acceptance" and "Relaxed acceptance", derive the rules,
their T = 0 forms and why δ = 0, λ = 1, G = 1 reproduce exact verification bit for bit; the per-row
walk the batched form must match lives with the tests (``tests/reference_acceptance.py``).
"""

# Glossary (the words every rule, verdict and stat here uses):
# - accepted: a drafted child the walk keeps. Exactly, with u · q(x) < p(x); ``BatchVerdict.accepted``
#   counts them per row, and they form ``BatchVerdict.path`` from the root down.
# - relaxed: accepted only because the rule credits x with its group's mass (LANTERN, LANTERN++, GSD);
#   exact verification would have rejected it (``BatchVerdict.relaxed``, ``DecodeStats.relaxed_acceptances``).
# - bonus: the one token the target adds after the last accepted node: a draw from the residual there (or
#   from p when no child was tried), so every verified step commits accepted + 1 tokens.
# - residual: what is left to draw from after a rejection, ``norm(max(0, p_G − q_x))`` (exact: p − q_x);
#   the next sibling is judged against it, the bonus is drawn from the last one.

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vdtrain.decode.kernels import plain_kernels, shared_arange, shared_full
from vdtrain.decode.rng import inverse_cdf
from vdtrain.decode.trees import DraftTree, first_flagged_child


def _normalise_rows(p: torch.Tensor) -> torch.Tensor:
    """Every row of ``p`` [..., V] (p >= 0) normalised, without reading the device. An exhausted row
    (nothing left to reject into) is all zeros, whose argmax is token 0: it becomes a point mass there."""
    total = p.sum(-1, keepdim=True)
    exhausted = total <= 0
    out = p / total.masked_fill(exhausted, 1.0)
    out[..., :1].add_(exhausted)  # in place on the view: no copy back
    return out


@dataclass
class AcceptanceConfig:
    """A method's ``acceptance`` section: its ``kind`` and what every kind shares; each relaxed rule's
    config below adds its own keys. This class alone is kind ``exact``."""

    kind: str = "exact"
    cache_dir: str | None = None  # neighbour-table cache (null: $VDTRAIN_CACHE/neighbours or ~/.cache)


@dataclass
class NeighbourConfig(AcceptanceConfig):
    """What the LANTERN-style rules share: how many latent neighbours they read."""

    k: int = 1000  # latent neighbours considered (≤ 1000, clamped to V − 1)


@dataclass
class LanternConfig(NeighbourConfig):
    """``Lantern``: the neighbours' target mass bounded additively."""

    kind: str = "lantern"
    delta: float = 0.1  # bound on the neighbours' target mass


@dataclass
class LanternPPConfig(NeighbourConfig):
    """``LanternPP``: the neighbours' target mass bounded by (λ − 1)·p(x)."""

    kind: str = "lantern_pp"
    lam: float = 2.0  # λ


@dataclass
class GsdConfig(AcceptanceConfig):
    """``Grouped`` (GSD): a rank window by p, filtered by probability gap and embedding distance."""

    kind: str = "gsd"
    group_size: int = 14  # rank window G
    delta_p: float = 0.15  # keep candidates with |p(c) − p(x)| < delta_p
    max_distance: float = 0.5  # keep candidates with squared embedding distance D(x, c) < d
    embedding: str = "token_embedding"  # distance source, token_embedding | codebook


class Rule:
    """Exact verification. The relaxed rules are small frozen dataclasses deriving from it that widen
    the group of tokens credited to a child (``group_batch``); the flags say how ``accept_batch`` treats
    the group."""

    needs_soft_p: ClassVar[bool] = False  # wants the T = 1 softmax at T = 0 (``p_relax``)
    relaxes: ClassVar[bool] = False  # has a group at all (exact does not: batched acceptance has a shortcut)
    removes_group: ClassVar[bool] = False  # the residual drops the group's mass (LANTERN)
    credits_q: ClassVar[bool] = False  # Q sums q over the group too (GSD)

    def group_batch(self, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups of many (distribution, token) pairs at once: ``p`` [..., V], ``x`` [...] →
        candidate tokens [..., G] and a mask [..., G] of those in the group (G = 0 here)."""
        empty = x.new_zeros(*x.shape, 0)
        return empty, empty.bool()


EXACT = Rule()


def exact_rule(config: AcceptanceConfig) -> Rule:
    """Kind ``exact``'s rule: the one stateless ``EXACT`` (it has no key of its own)."""
    return EXACT


@dataclass(frozen=True, eq=False)
class _NeighbourRule(Rule):
    """LANTERN-style relaxation: A(x) = the longest prefix of x's first ``k`` latent neighbours (all K
    when k ≥ K) whose cumulative target mass S_j stays ≤ ``bound``. S_j never decreases, so the prefix
    is a count."""

    config: NeighbourConfig
    neighbours: torch.Tensor  # [V, K] latent neighbour table (``vdtrain.decode.neighbours``)

    needs_soft_p: ClassVar[bool] = True
    removes_group: ClassVar[bool] = True
    relaxes: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    @property
    def k(self) -> int:
        return self.config.k

    def bound(self, p_token: float | torch.Tensor) -> float | torch.Tensor:
        raise NotImplementedError

    def group_batch(self, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # S_j never decreases, so the entries with S_j <= bound are a prefix.
        near = self.neighbours[:, : self.k].to(p.device)[x]  # [..., k]
        cumulative = p.gather(-1, near).cumsum(-1)
        return near, cumulative <= self.bound(p.gather(-1, x.unsqueeze(-1)))


@dataclass(frozen=True, eq=False)
class Lantern(_NeighbourRule):
    """LANTERN: additive bound, Σ_A p ≤ δ (``LanternConfig.delta``)."""

    config: LanternConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.config.delta < 0:
            raise ValueError(f"LANTERN needs delta >= 0, got {self.config.delta}")

    def bound(self, p_token: float | torch.Tensor) -> float:
        return self.config.delta


@dataclass(frozen=True, eq=False)
class LanternPP(_NeighbourRule):
    """LANTERN++: multiplicative bound, Σ_A p ≤ (λ − 1)·p(x), so p'(x) ≤ λ·p(x) (``LanternPPConfig.lam``)."""

    config: LanternPPConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.config.lam < 1:
            raise ValueError(f"LANTERN++ needs lam >= 1, got {self.config.lam}")

    def bound(self, p_token: float | torch.Tensor) -> float | torch.Tensor:
        return (self.config.lam - 1.0) * p_token


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

    config: GsdConfig  # the group's size G, delta_p and max_distance
    embeddings: torch.Tensor  # [V, E]: the target's input token embeddings (or the codebook), kept in fp64

    needs_soft_p: ClassVar[bool] = True
    credits_q: ClassVar[bool] = True
    relaxes: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.config.group_size < 1:
            raise ValueError(f"GSD needs group_size >= 1, got {self.config.group_size}")
        # Distances are taken in fp64: converting the table once (exact) spares a conversion of every
        # gathered window, the bulk of this rule's work at large batches.
        object.__setattr__(self, "embeddings", self.embeddings.double())

    def group_batch(self, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.group_size == 1:
            return super().group_batch(p, x)
        vocab, size = p.shape[-1], self.config.group_size
        order = p.sort(dim=-1, descending=True, stable=True).indices  # ties by token id
        place = torch.empty_like(order).scatter_(-1, order, shared_arange(vocab, p.device).expand_as(order))
        start = place.gather(-1, x.unsqueeze(-1)) - size // 2  # [..., 1]: x's rank minus half the window
        slots = start.clamp_min(0) + shared_arange(size, p.device)
        in_window = (slots < start + size) & (slots < vocab)
        window = order.gather(-1, slots.clamp_max(vocab - 1))  # [..., G]
        close_p = (p.gather(-1, window) - p.gather(-1, x.unsqueeze(-1))).abs() < self.config.delta_p
        emb = self.embeddings.to(p.device)
        dist = (emb[window] - emb[x].unsqueeze(-2)).pow(2).sum(-1)
        return window, in_window & (window != x.unsqueeze(-1)) & close_p & (dist < self.config.max_distance)


# --- batched acceptance ------------------------------------------------------------------------------
#
# The reference walk (``tests/reference_acceptance.py``) reads probabilities node by node on the host.
# ``accept_batch`` computes the same verdict for
# every row with tensor ops only: no host synchronisation, and loops bounded by the tree's depth and
# width (host-side ``DraftTree.depth_bound`` / ``width_bound``), never by the batch. The key fact is that
# what happens at a node (which child is accepted first, what ``p`` is left when all are rejected)
# depends only on that node's own distributions, children and uniforms, not on how the walk got there.
# So every node is judged at once, then the accepted path is followed ``depth`` times by gathers:
#
# - T = 0 (every rule): one shot; a child is accepted if it is the argmax at its parent, else (relaxed
#   rules, with ``p_relax``) if its group holds the argmax; the first such child per parent wins.
# - T > 0, exact rule, deterministic drafts (EAGLE-2, PEANUT): one shot too. After rejecting the
#   earlier siblings p is the original one without them, renormalised, so child c is accepted iff
#   u_c · (Σ p − Σ_{earlier siblings} p) < p(c) (the first child: u_c < p(c), the walk's unnormalised
#   test). Only [B, T] and [B, T, T] work besides one [B, V] residual for the bonus.
# - T > 0 otherwise (sampled SpecInfer drafts, LANTERN, LANTERN++, GSD): the residual of each rejection
#   feeds the next sibling's test, so the loop runs over sibling rank, each pass handling the r-th
#   child of every node at once ([B, T, V] work). This takes ``width`` passes of a few dozen ops, where a
#   loop over depth × rank with [B, V] work would take ``depth × width`` passes.
# - The exact rule on a chain (``DraftTree.chain``: block drafting's chain, SJD's window), at T = 0 or
#   with sampled drafts: each node has one child, so no residual feeds a later test. Every child is
#   tested against its parent's argmax, or p and q, at once, the path is the run of acceptances from the
#   root, and the residual is built at the last accepted node only: the verdicts above, in 33 kernels
#   instead of 55 at T > 0 and 8 instead of 30 at T = 0 (B = 1, tests/test_batched_acceptance.py).
#
# The arithmetic mirrors the walk's step for step, so verdicts agree exactly except where a uniform falls
# within rounding (~1e-16) of a threshold (the shortcut's sums are grouped differently from the walk's).


@dataclass
class BatchVerdict:
    """Every row's verdict, as device tensors."""

    path: torch.Tensor  # [B, D] long: accepted nodes in depth order, then -1
    accepted: torch.Tensor  # [B] long: accepted draft tokens (the bonus not counted)
    bonus: torch.Tensor  # [B] long: the token drawn after the last accepted node
    relaxed: torch.Tensor  # [B] long: accepted nodes that only a relaxed rule accepted


def accept_batch(
    rule: Rule,
    tree: DraftTree,
    p_nodes: torch.Tensor,
    greedy: bool,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
    p_relax: torch.Tensor | None = None,
) -> BatchVerdict:
    """Verify every row's tree at once, without reading the device: for each row ``b`` what the
    reference walk ``walk(rule, tree, b, p_nodes[b], greedy, None, p_relax[b], u_accept[b], u_bonus[b])``
    returns.

    ``p_nodes`` [B, T, V]: the target distribution at every node; ``u_accept`` [B, T]: the uniform for
    testing node ``c`` as a child; ``u_bonus`` [B]: the bonus draw (both unused at T = 0); ``p_relax``
    [B, T, V]: for relaxed rules at T = 0, the temperature-1 softmax (see the module docstring)."""
    batch, size = tree.tokens.shape
    _check_shapes(tree, p_nodes, u_accept, u_bonus, p_relax)
    depth = size - 1 if tree.depth_bound is None else tree.depth_bound
    if tree.chain and (greedy or tree.sampled) and not rule.relaxes and not plain_kernels():
        return _chain_verdict(tree, p_nodes, greedy, u_accept, u_bonus, depth)  # its plain twin: below
    width = size - 1 if tree.width_bound is None else tree.width_bound
    if tree.sampled and width > 1 and not greedy and not rule.relaxes and not plain_kernels():
        return _sampled_verdict(tree, p_nodes, u_accept, u_bonus, depth, width)  # its plain twin: below
    if greedy:
        best = p_nodes.argmax(-1)  # [B, T]
        child_of, relaxed_at = _greedy_choices(rule, tree, best, p_relax)
        path, final, relaxed = _follow(child_of, relaxed_at, depth)
        bonus = best.gather(1, final[:, None]).squeeze(1)
    elif not tree.sampled and not rule.relaxes:
        p = p_nodes.double()  # one conversion for both
        path, final, relaxed = _follow(_exact_choices(tree, p, u_accept), None, depth)
        bonus = inverse_cdf(_exact_residual(tree, p, final), u_bonus)
    else:
        child_of, relaxed_at, p_left = _tried_choices(rule, tree, p_nodes, u_accept, width)
        path, final, relaxed = _follow(child_of, relaxed_at if rule.relaxes else None, depth)
        vocab = p_left.shape[-1]
        bonus = inverse_cdf(
            p_left.gather(1, final[:, None, None].expand(batch, 1, vocab)).squeeze(1), u_bonus
        )
    return BatchVerdict(path, (path >= 0).sum(1), bonus, relaxed)


def _check_shapes(
    tree: DraftTree,
    p_nodes: torch.Tensor,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
    p_relax: torch.Tensor | None,
) -> None:
    batch, size = tree.tokens.shape
    if p_nodes.dim() != 3 or p_nodes.shape[:2] != (batch, size):
        raise ValueError(f"p_nodes must be [B={batch}, T={size}, V], got {tuple(p_nodes.shape)}")
    if u_accept.shape != (batch, size) or u_bonus.shape != (batch,):
        raise ValueError(
            f"u_accept must be [B={batch}, T={size}] and u_bonus [B={batch}], "
            f"got {tuple(u_accept.shape)} and {tuple(u_bonus.shape)}"
        )
    if p_relax is not None and p_relax.shape != p_nodes.shape:
        raise ValueError(
            f"p_relax must have p_nodes' shape {tuple(p_nodes.shape)}, got {tuple(p_relax.shape)}"
        )
    if tree.sampled and (tree.q is None or tree.q.shape != p_nodes.shape):
        raise ValueError(f"a sampled tree needs q of p_nodes' shape {tuple(p_nodes.shape)}")


def _follow(
    child_of: torch.Tensor, relaxed_at: torch.Tensor | None, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk down from the root along each node's accepted child (``child_of`` [B, T], −1: none; ``relaxed_at``
    [B, T] is set only where there is one; None: a rule that relaxes nothing): (path [B, depth], last node
    [B], relaxed acceptances [B]). Level by level (``_follow_levels``) or by pointer doubling, its fast
    twin (``kernels.plain_kernels()`` chooses)."""
    if depth == 0:
        root = torch.zeros_like(child_of[:, 0])
        return child_of[:, :0], root, torch.zeros_like(root)
    if plain_kernels():
        return _follow_levels(child_of, relaxed_at, depth)
    return _follow_doubling(child_of, relaxed_at, depth)


def _follow_levels(
    child_of: torch.Tensor, relaxed_at: torch.Tensor | None, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_follow`` one level at a time: from each row's node, its accepted child if it has one."""
    node = torch.zeros_like(child_of[:, :1])  # [B, 1]: the root
    relaxed = torch.zeros_like(node[:, 0])
    path = []
    for _ in range(depth):
        child = child_of.gather(1, node)
        moves = child >= 0
        if relaxed_at is not None:
            relaxed = relaxed + (relaxed_at.gather(1, node) & moves).long()[:, 0]
        path.append(torch.where(moves, child, -1))
        node = torch.where(moves, child, node)
    return torch.cat(path, 1), node[:, 0], relaxed


def _follow_doubling(
    child_of: torch.Tensor, relaxed_at: torch.Tensor | None, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_follow`` as the powers of ``f`` (a node's accepted child, itself where none) at the root, found
    by doubling: about 3·log2(depth) ops instead of 5 per level. Measured at the LlamaGen-XL shape
    (``benchmarks.step_kernels --phases``, B = 1, against ``_follow_levels``): 20 ops fewer a step for
    eagle2 (470 → 450 beyond the target's layers) and 67 for sjd's 16-deep window (239 → 172)."""
    size = child_of.shape[1]
    nodes = shared_arange(size, child_of.device)
    jump = torch.where(child_of >= 0, child_of, nodes)  # f, then f^m
    reach = jump[:, :1]  # [B, m]: f(root) .. f^m(root)
    while reach.shape[1] < depth:
        reach = torch.cat([reach, jump.gather(1, reach)], 1)  # f^(m+1) .. f^(2m) (root)
        if reach.shape[1] < depth:
            jump = jump.gather(1, jump)
    reach = reach[:, :depth]
    before = F.pad(reach[:, :-1], (1, 0))  # the node each level's step starts from: the root first
    path = reach.masked_fill(reach == before, -1)  # a node is never its own child: equal means none
    if relaxed_at is None:  # a rule that relaxes nothing
        return path, reach[:, -1], shared_full(0, child_of.device, torch.long).expand(len(path))
    relaxed = relaxed_at.long().gather(1, before).sum(1)  # zero at the last node: it has no child
    return path, reach[:, -1], relaxed


def _chain_verdict(
    tree: DraftTree,
    p_nodes: torch.Tensor,
    greedy: bool,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
    depth: int,
) -> BatchVerdict:
    """The exact rule on a chain (``DraftTree.chain``): node ``i + 1`` is tried against node ``i``'s
    distributions alone (see the section comment): at T = 0 against its argmax, at T > 0 with
    ``_try_children``'s arithmetic on p and q. No valid node is deeper than ``depth``."""
    batch, size = tree.tokens.shape
    x = tree.tokens[:, 1:]
    if greedy:
        best = p_nodes.argmax(-1)  # [B, T]
        passes = tree.valid[:, 1:] & (x == best[:, :-1])
    else:
        p, q = p_nodes.double(), _normalise_rows(tree.q.double())
        p_x, q_x = p[:, :-1].gather(2, x[..., None])[..., 0], q[:, :-1].gather(2, x[..., None])[..., 0]
        passes = tree.valid[:, 1:] & (u_accept[:, 1:].double() * q_x < p_x)  # [B, T − 1]: child i + 1 of i
    accepted = passes.cumprod(1).sum(1)  # the run from the root, long: also the last accepted node
    device = x.device
    nodes, none = shared_arange(size, device), shared_full(-1, device, torch.long)
    path = torch.where(nodes[None, :depth] < accepted[:, None], nodes[None, 1 : depth + 1], none)
    relaxed = shared_full(0, device, torch.long).expand(batch)
    if greedy:
        return BatchVerdict(path, accepted, best.gather(1, accepted[:, None])[:, 0], relaxed)
    tried = F.pad(tree.valid[:, 1:], (0, 1)).gather(1, accepted[:, None])  # the last node had a child
    at = accepted[:, None, None].expand(batch, 1, p.shape[-1])
    p_last, q_last = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
    residual = torch.where(tried, _normalise_rows((p_last - q_last).clamp_min_(0)), p_last)
    return BatchVerdict(path, accepted, inverse_cdf(residual, u_bonus), relaxed)


# M_s where q has no mass left (a leaf's zero q, a support its children used up): below any mass a child
# is drawn from (float32's least is 1.4e-45), and large enough that the ranks past the node's children,
# which are never read, stay finite (A grows by at most 1 / _NO_MASS a rank).
_NO_MASS = 1e-300


def _sampled_verdict(
    tree: DraftTree,
    p_nodes: torch.Tensor,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
    depth: int,
    width: int,
) -> BatchVerdict:
    """The exact rule on a sampled tree (children drawn from their parent's q, without replacement or,
    where ``DraftTree.with_replacement``, i.i.d.), T > 0: the sibling loop's residuals in closed form (see
    the section comment), so a pass over a rank is a handful of [B, T] ops and one sum over the
    vocabulary, where ``_tried_choices`` carries p and q.

    With Q the parent's q normalised, after the children of ranks < s were rejected p is
    max(p − A_s·Q, 0) / D_s on the tokens not yet tried and 0 on those tried (a rejected token had
    p ≤ q̂, so nothing of it is left, and A only grows), where A_0 = 0, D_0 = 1,
    A_{s+1} = A_s + D_s / M_s, D_s = Σ max(p − A_s·Q, 0), and M_s, q̂'s normaliser once the children of
    ranks < s are removed, is the mass of the children of ranks >= s plus Q's undrafted mass: a sum of
    positive terms (1 − the drafted mass would cancel where q is peaked). Child c of rank s is accepted
    iff u_c · Q(x_c) / M_s < max(p(x_c) − A_s·Q(x_c), 0) / D_s. All of it holds with q unnormalised in
    place of Q (A and M then carry q's total, which cancels), so q is never normalised. Drawn i.i.d.,
    every rank draws from the whole Q: M_s = 1 (q's total), and a token repeated among siblings is
    rejected, as its first copy left it no p."""
    batch, size, vocab = p_nodes.shape
    device = p_nodes.device
    p, q = p_nodes.double(), tree.q.double()
    parents = tree.parents.clamp_min(0)
    is_child = tree.valid & (tree.parents >= 0)
    # Each child's place among its siblings (0: the root, and padding where the tree computes it).
    if tree.sibling_ranks is None:  # children ranked past a width bound below the truth are left out, as
        rank = tree.earlier_siblings().sum(-1).clamp_max_(width)  # the general pass leaves them
        is_child = is_child & (rank < width)
    else:  # a static shape's, always below its own width bound
        rank = tree.sibling_ranks
    at = parents * vocab + tree.tokens
    p_child = p.reshape(batch, size * vocab).gather(1, at)  # [B, T]: each child's token at its parent
    q_child = q.reshape(batch, size * vocab).gather(1, at)
    first = parents * (width + 1)
    slot, reverse = first + rank, first + (width - rank)  # (parent, rank), (parent, W − rank) in the tables
    if tree.with_replacement:  # every rank draws from the whole q: M_s is q's total
        total = q.sum(-1).clamp_min_(_NO_MASS)  # [B, T]
        left, left_child = total[..., None].expand(batch, size, width + 1), total.gather(1, parents)
    else:
        drafted = torch.zeros(batch, size * vocab + 1, dtype=torch.bool, device=device)  # + a spare column
        drafted = drafted.scatter_(1, torch.where(is_child, at, size * vocab), True)[:, :-1].view_as(q)
        # [B, T, W + 1]: column j holds the mass of the child of rank W − j (column 0: the undrafted
        # mass), so the running sum along it is M_{W − j}.
        spare = size * (width + 1)
        left = torch.zeros(batch, spare + 1, dtype=q.dtype, device=device)
        left.scatter_(1, torch.where(is_child, reverse, spare), q_child)
        left = left[:, :-1].view(batch, size, width + 1)
        left[:, :, 0] = q.masked_fill(drafted, 0.0).sum(-1)
        left = left.cumsum(-1).clamp_min_(_NO_MASS)  # M_s at column W − s
        left_child = left.view(batch, -1).gather(1, reverse)
    a = shared_full(0.0, device, q.dtype).expand(batch, size)
    d = shared_full(1.0, device, q.dtype).expand(batch, size)
    a_by_rank, d_by_rank = [a], [d]
    for s in range(1, width + 1):
        a = a + d / left[:, :, width + 1 - s]
        a_by_rank.append(a)
        if s < width:  # D_width is never read: the bonus draw normalises for itself
            d = torch.addcmul(p, q, a[..., None], value=-1.0).clamp_min_(0.0).sum(-1)
        d_by_rank.append(d)
    a_table = torch.stack(a_by_rank, -1).view(batch, -1)  # [B, T · (W + 1)]
    d_table = torch.stack(d_by_rank, -1).view(batch, -1)
    a_child, d_child = a_table.gather(1, slot), d_table.gather(1, slot)
    mass = torch.addcmul(p_child, a_child, q_child, value=-1.0).clamp_min_(0.0)
    accept = is_child & (u_accept.double() * q_child * d_child < left_child * mass)
    path, final, relaxed = _follow(first_flagged_child(accept, parents), None, depth)
    # The bonus: p at the last accepted node once all its k children were rejected, max(p − A_k·Q, 0).
    children = torch.zeros_like(tree.parents).scatter_add_(1, parents, is_child.long())
    a_final = a_table.gather(1, final[:, None] * (width + 1) + children.gather(1, final[:, None]))
    rows = final[:, None, None].expand(batch, 1, vocab)
    residual = torch.addcmul(p.gather(1, rows)[:, 0], q.gather(1, rows)[:, 0], a_final, value=-1.0)
    return BatchVerdict(path, (path >= 0).sum(1), inverse_cdf(residual.clamp_min_(0.0), u_bonus), relaxed)


def _greedy_choices(
    rule: Rule, tree: DraftTree, best: torch.Tensor, p_relax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """T = 0: (accepted child [B, T], whether it was accepted only by the relaxation [B, T]) per node."""
    parents = tree.parents.clamp_min(0)
    is_child = tree.valid & (tree.parents >= 0)
    best_at_parent = best.gather(1, parents)
    first_hit = first_flagged_child(is_child & (tree.tokens == best_at_parent), parents)
    if p_relax is None:
        return first_hit, torch.zeros_like(tree.valid)
    vocab = p_relax.shape[-1]
    soft = p_relax.double().gather(1, parents[..., None].expand(-1, -1, vocab))  # each child's parent row
    candidates, member = rule.group_batch(soft, tree.tokens)
    holds_best = ((candidates == best_at_parent[..., None]) & member).any(-1)
    first_group = first_flagged_child(is_child & holds_best, parents)
    relaxed_at = (first_hit < 0) & (first_group >= 0)
    return torch.where(first_hit >= 0, first_hit, first_group), relaxed_at


def _exact_choices(tree: DraftTree, p: torch.Tensor, u_accept: torch.Tensor) -> torch.Tensor:
    """T > 0, exact rule, deterministic drafts: the first accepted child of every node [B, T] in one
    shot (see the section comment); ``p`` [B, T, V] float64."""
    batch, size, vocab = p.shape
    parents = tree.parents.clamp_min(0)
    is_child = tree.valid & (tree.parents >= 0)
    earlier = tree.earlier_siblings()  # [B, T, T]
    p_child = p.reshape(batch, size * vocab).gather(1, parents * vocab + tree.tokens)
    # A token repeated among siblings was zeroed when its first copy was rejected.
    repeated = (earlier & (tree.tokens[:, :, None] == tree.tokens[:, None, :])).any(-1)
    p_child = p_child.masked_fill(repeated, 0.0)
    removed = (earlier.double() @ p_child[..., None]).squeeze(-1)
    one = shared_full(1.0, p.device, p.dtype)
    left = torch.where(earlier.any(-1), p.sum(-1).gather(1, parents) - removed, one)
    # ``left`` <= 0: the walk's p was exhausted and fell back to a point mass on token 0.
    accept = torch.where(left > 0, u_accept.double() * left < p_child, tree.tokens == 0)
    return first_flagged_child(is_child & accept, parents)


def _exact_residual(tree: DraftTree, p_nodes: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[B, V]: p (``p_nodes`` [B, T, V] float64) at each row's last accepted node once all its children
    were rejected: the children's tokens zeroed, renormalised (untouched at a leaf)."""
    batch, _, vocab = p_nodes.shape
    p = p_nodes.gather(1, final[:, None, None].expand(batch, 1, vocab)).squeeze(1)
    tried = tree.valid & (tree.parents == final[:, None])  # [B, T]
    hit = shared_full(0.0, p.device, p.dtype).expand_as(p).scatter_add(1, tree.tokens, tried.double()) > 0
    return torch.where(tried.any(1, keepdim=True), _normalise_rows(p.masked_fill(hit, 0.0)), p)


def _tried_choices(
    rule: Rule, tree: DraftTree, p_nodes: torch.Tensor, u_accept: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T > 0, general: children tried rank by rank at every node at once. Returns the first accepted
    child [B, T], whether only the relaxation accepted it [B, T], and p left at each node after all its
    children [B, T, V] (what the bonus is drawn from where none was accepted).

    A node with a child at rank r has r + 1 children, so at most (T − 1) // (r + 1) nodes take part in
    pass r: later passes work on those rows only (gathered, then written back)."""
    size, vocab = p_nodes.shape[1:]
    table = tree.child_table(width)  # [B, T, W]
    p, q = p_nodes.double(), tree.q.double() if tree.sampled else None
    u_all = u_accept.double()
    child_of = torch.full_like(tree.parents, -1)
    relaxed_at = torch.zeros_like(tree.valid)
    for rank in range(width):
        kid = table[:, :, rank]
        count = (size - 1) // (rank + 1)
        rows = None  # all nodes; else [B, count]: the nodes with a child at this rank first
        if count < size - 1:
            rows = (kid < 0).to(torch.int8).sort(dim=1, stable=True).indices[:, :count]
            kid = kid.gather(1, rows)
        at = kid.clamp_min(0)
        x = tree.tokens.gather(1, at)  # each node's child at this rank
        u = u_all.gather(1, at)
        if rows is None:
            follow = rank + 1 < width and not tree.with_replacement
            accept, relaxed, p, q = _try_children(rule, p, q, x, u, kid >= 0, follow)
            first = accept & (child_of < 0)
            child_of = torch.where(first, kid, child_of)
            if rule.relaxes:
                relaxed_at = torch.where(first, relaxed, relaxed_at)
            continue
        spread = rows[..., None].expand(-1, -1, vocab)
        taken_q = None if q is None else q.gather(1, spread)
        accept, relaxed, p_rows, q_rows = _try_children(
            rule, p.gather(1, spread), taken_q, x, u, kid >= 0, not tree.with_replacement
        )
        first = accept & (child_of.gather(1, rows) < 0)
        child_of = child_of.scatter(1, rows, torch.where(first, kid, child_of.gather(1, rows)))
        if rule.relaxes:
            relaxed_at = relaxed_at.scatter(1, rows, torch.where(first, relaxed, relaxed_at.gather(1, rows)))
        p.scatter_(1, spread, p_rows)  # p and q are this function's own after the first pass
        if q is not None:
            q.scatter_(1, spread, q_rows)
    return child_of, relaxed_at, p


def _try_children(
    rule: Rule,
    p: torch.Tensor,
    q: torch.Tensor | None,
    x: torch.Tensor,
    u: torch.Tensor,
    has: torch.Tensor,
    siblings_follow: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One step of the walk's sibling loop for many nodes: node i (current ``p`` [N.., V], ``q`` or None
    for point-mass drafts) tries child token ``x`` with uniform ``u`` where ``has``. Returns (accepted,
    accepted only by the relaxation, p after rejecting x, q without x), the last two freshly allocated;
    ``siblings_follow`` False (the last rank, or children drawn i.i.d.): q is not updated."""
    p_x = p.gather(-1, x[..., None]).squeeze(-1)
    if q is not None:
        q = _normalise_rows(q)
        q_x = q.gather(-1, x[..., None]).squeeze(-1)
    else:  # deterministic draft: a point mass on the child
        q_x = torch.ones_like(p_x)
    # A rule without a group (exact) skips it: its empty tensors would still cost a launch or two.
    candidates, member = rule.group_batch(p, x) if rule.relaxes else (x[..., :0], None)
    p_mass, q_mass = p_x, q_x
    if candidates.shape[-1]:
        p_mass = p_x + (p.gather(-1, candidates) * member).sum(-1)
        if rule.credits_q and q is not None:
            q_mass = q_x + (q.gather(-1, candidates) * member).sum(-1)
    accept = has & (u * q_mass < p_mass)
    relaxed = ~(u * q_x < p_x) if rule.relaxes else None  # exact: accepted only by the exact test
    # The residual after rejecting x (kept only where x was tried), built in place on one copy.
    if rule.removes_group and candidates.shape[-1]:
        rest = p.scatter(-1, candidates, p.gather(-1, candidates) * ~member)  # the group's mass set to 0
        if q is not None:
            rest.sub_(q)
    elif q is not None:
        rest = p - q
    else:
        rest = p.clone()
    if q is not None:
        rest.clamp_min_(0)
        if siblings_follow:  # the last rank's q is not read again
            q.scatter_(-1, x[..., None], 0.0)  # the next sibling was drawn without this one
    else:
        rest.scatter_(-1, x[..., None], (rest.gather(-1, x[..., None]) - 1.0).clamp_min(0))
    return accept, relaxed, torch.where(has[..., None], _normalise_rows(rest), p), q
