"""Draft trees as plain data, and the pure functions that turn them into masks and orders.

A tree of ``T`` nodes per row: node 0 is the root (the last committed token, not yet seen by the
target), every other node is a drafted token. Nodes are stored parents-before-children, siblings in
the drafter's rank order (the order exact verification tries them in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vdtrain.decode.kernels import shared_arange, shared_eye, shared_full

# EAGLE-1's default static tree (25 draft nodes, depth 5): paths of child ranks from the root.
EAGLE1_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


def _ranks(prefix: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    return [(*prefix, r) for r in range(n)]


# LANTERN++'s extended static tree: 58 nodes with the root, depth 5, at most 5 children per node.
LANTERN_PP_PATHS: tuple[tuple[int, ...], ...] = tuple(
    _ranks((), 5)
    + _ranks((0,), 4) + _ranks((1,), 3) + _ranks((2,), 3) + _ranks((3,), 2) + _ranks((4,), 1)
    + _ranks((0, 0), 4) + _ranks((0, 1), 3) + _ranks((0, 2), 3) + _ranks((0, 3), 2)
    + _ranks((1, 0), 2) + _ranks((1, 1), 1) + _ranks((2, 0), 1)
    + _ranks((0, 0, 0), 4) + _ranks((0, 0, 1), 3) + _ranks((0, 0, 2), 2) + _ranks((0, 0, 3), 1)
    + _ranks((0, 1, 0), 2) + _ranks((0, 1, 1), 1) + _ranks((0, 2, 0), 1)
    + _ranks((0, 0, 0, 0), 3) + _ranks((0, 0, 0, 1), 2) + _ranks((0, 0, 1, 0), 2)
    + _ranks((0, 0, 1, 1), 1) + _ranks((0, 0, 2, 0), 1)
)  # fmt: skip

STATIC_TREES: dict[str, tuple[tuple[int, ...], ...]] = {
    "eagle1": EAGLE1_PATHS,
    "lantern_pp": LANTERN_PP_PATHS,
}


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape: for node ``i`` its parent, depth and rank among its siblings."""

    paths: tuple[tuple[int, ...], ...]  # node i>0 has path paths[i-1]
    parents: tuple[int, ...]  # parents[0] = -1
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def nodes_at(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def width(self, node: int) -> int:
        """How many children ``node`` has (they take ranks 0 .. width-1)."""
        return sum(1 for p in self.parents if p == node)


def static_tree(paths: tuple[tuple[int, ...], ...] | list[list[int]]) -> StaticTree:
    """Validate a list of rank paths and lay it out parents-first, siblings by rank.

    Every path's parent path must be present, and the ranks under each parent must be 0..k-1.
    """
    unique = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    if len(unique) != len(paths):
        raise ValueError("the tree lists a path twice")
    if not unique or any(len(p) == 0 for p in unique):
        raise ValueError("a tree needs at least one non-empty path")
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [0]
    for path in unique:
        parent = path[:-1]
        if parent not in index:
            raise ValueError(f"path {list(path)} has no parent path {list(parent)} in the tree")
        if path[-1] < 0:
            raise ValueError(f"path {list(path)} has a negative rank")
        index[path] = len(parents)
        parents.append(index[parent])
        depths.append(len(path))
        ranks.append(path[-1])
    for node in range(len(parents)):
        kids = sorted(ranks[i] for i, p in enumerate(parents) if p == node)
        if kids != list(range(len(kids))):
            raise ValueError(
                f"the children of {list(unique[node - 1]) if node else 'the root'} skip a rank: {kids}"
            )
    return StaticTree(tuple(unique), tuple(parents), tuple(depths), tuple(ranks))


def first_nodes(tree: StaticTree, nodes: int) -> StaticTree:
    """``tree`` cut to ``nodes`` nodes: its first ``nodes - 1`` rank paths (laid out shortest first, then by
    rank, so every kept path's parent and lower-ranked siblings are kept too); a tree under a node budget."""
    return tree if nodes >= tree.size else static_tree(tree.paths[: nodes - 1])


def first_flagged_child(flag: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, T]: each node's first (lowest-stored) child with ``flag`` [B, T] set, −1 where none
    (``parents`` [B, T]; a flagged node has one). Unflagged nodes scatter to a spare column, so a node
    that no flagged child reaches keeps the −1 it starts with."""
    batch, size = flag.shape
    nodes = shared_arange(size, flag.device).expand(batch, size)
    first = (
        shared_full(-1, flag.device, torch.long)
        .expand(batch, size + 1)
        .scatter_reduce(1, parents.masked_fill(~flag, size), nodes, reduce="amin", include_self=False)
    )
    return first[:, :size]


def ancestor_matrix(parents: torch.Tensor, depth_bound: int | None = None) -> torch.Tensor:
    """``parents`` [B, T] (−1 at the root) → [B, T, T] bool: node ``i`` sees ``j`` iff ``j`` is ``i``
    or one of its ancestors. Each pass composes the relation with itself, doubling the path length it
    covers, so ⌈log2 D⌉ passes reach every ancestor of a tree no deeper than ``depth_bound`` D
    (default T − 1): a fixed count, with no read of the device."""
    size = parents.shape[1]
    depth = size - 1 if depth_bound is None else min(depth_bound, size - 1)
    eye = shared_eye(size, parents.device)
    cols = shared_arange(size, parents.device)
    anc = eye | (parents[..., None] == cols)  # itself and its parent
    passes = max(0, depth - 1).bit_length()  # 2^passes >= depth
    if not passes:
        return anc
    # The relation is reflexive, so its square holds it: a pass is one product, its entries (counts of
    # walks) clamped to 1 so that no pass overflows (3 kernels a pass fewer than OR-ing bool matrices).
    walks = anc.float()
    for i in range(passes):
        walks = walks @ walks
        if i + 1 < passes:
            walks = walks.clamp_max_(1.0)
    return walks > 0


@dataclass
class DraftTree:
    """One step's drafted trees for a batch of prompts.

    ``q`` holds, for each node, the drafter distribution its children were chosen from (sampled
    static trees need it for the SpecInfer rule); ``sampled`` says children were drawn from it rather
    than taken as its top-k: without replacement, or i.i.d. where ``with_replacement`` says so (the exact
    rule then keeps q whole after a rejection).
    """

    tokens: torch.Tensor  # [B, T] long; tokens[:, 0] = the root
    parents: torch.Tensor  # [B, T] long, -1 at the root
    depths: torch.Tensor  # [B, T] long
    valid: torch.Tensor  # [B, T] bool: padding nodes are never verified or accepted
    q: torch.Tensor | None  # [B, T, V] or None
    sampled: bool
    # Host-side bounds that the builder knows without reading the device; batched acceptance loops this
    # many times, so a bound below the truth cuts paths or children off. None: the tree size bounds
    # them (always right, but loops T - 1 times).
    depth_bound: int | None = None  # no valid node is deeper
    width_bound: int | None = None  # no node has more valid children
    # [B or 1, T, T] bool, ``ancestor_matrix(parents)`` where the builder knows it without computing it
    # (a chain's is a triangle); None: the verification rows compute it.
    ancestors: torch.Tensor | None = None
    # Nodes 0 .. T − 1 form one path in stored order (parents[i] = i − 1): exact verification takes its
    # chain shortcut (``acceptance._chain_verdict``) and the commit moves no KV (``SpeculativeEngine``).
    # False: any tree.
    chain: bool = False
    # [B or 1, T] long: each node's place among its siblings (the root: 0), where the builder knows it
    # (a static tree's ranks: its valid children are always its first ranks); None: computed from the
    # valid nodes (``earlier_siblings``) when needed.
    sibling_ranks: torch.Tensor | None = None
    # Sampled children drawn i.i.d. from q (a token may repeat among siblings; under the exact rule a
    # repeat is always rejected) rather than without replacement; False for every tree not sampled.
    with_replacement: bool = False

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def earlier_siblings(self) -> torch.Tensor:
        """[B, T, T] bool: ``j`` is a valid sibling stored before ``i`` (tried before it). The root and
        invalid nodes have none."""
        index = shared_arange(self.size, self.parents.device)
        same_parent = self.parents[:, :, None] == self.parents[:, None, :]
        before = index[None, :, None] > index[None, None, :]
        has_parent = (self.parents >= 0) & self.valid
        return same_parent & before & self.valid[:, None, :] & has_parent[:, :, None]

    def child_table(self, width: int) -> torch.Tensor:
        """[B, T, width] long: the valid child of node ``n`` at sibling rank ``r`` (its place among
        the valid children, in stored order), −1 where there is none. Children ranked ``width`` or
        later are left out."""
        batch, size = self.parents.shape
        if width == 1:  # each node's first valid child: no sibling ranks needed (a chain, SJD's window)
            return first_flagged_child(self.valid & (self.parents >= 0), self.parents)[..., None]
        ranks = self.earlier_siblings().sum(-1)
        keep = self.valid & (self.parents >= 0) & (ranks < width)
        slot = torch.where(keep, self.parents.clamp_min(0) * width + ranks, size * width)  # spare slot
        nodes = shared_arange(size, self.parents.device).expand(batch, size)
        table = torch.full((batch, size * width + 1), -1, dtype=torch.long, device=self.parents.device)
        table.scatter_(1, slot, torch.where(keep, nodes, -1))
        return table[:, :-1].view(batch, size, width)

    def children(self, row: int, node: int) -> list[int]:
        """Valid children of ``node`` in stored (rank) order."""
        mask = (self.parents[row] == node) & self.valid[row]
        return mask.nonzero().flatten().tolist()

    def max_depth(self) -> torch.Tensor:
        """Depth of each row's tree [B]."""
        return (self.depths * self.valid).amax(dim=1)  # depths are >= 0: an invalid node counts 0
