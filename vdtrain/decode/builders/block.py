"""Trees over a block drafter's slots (issue #48): one drafter forward proposes the next ``depth`` tokens.

Slot 1 is the root's own drafter view (the catch-up row's logits); one forward of ``depth − 1`` query rows
(``DraftContext.drafter_block``) gives slots 2 .. ``depth``. A node at depth ``d`` draws its children from
slot ``d``'s q whatever its path holds, so the tree is a fixed list of rank paths (a chain unless ``paths``
gives a tree). At T = 0 the children are slot d's top-k; at T > 0 they are sampled without replacement
from q_d (inverse CDF, ``Purpose.DRAFT`` uniforms at the child's index; i.i.d. from q_d where
``with_replacement``, all ranks in one inverse CDF) and q is kept, so exact
verification keeps AR's distribution and LANTERN++ / GSD apply as on a static tree. q_d is the drafter's
confidence (``DraftContext.draft_confidence``): the rule is exact for any q, and this one needs no
vocabulary-wide selection. A child past q's support stays undrafted, with its subtree, as in
``static.py``; all parents of a rank draw at once. ``cut`` (issue #55) leaves undrafted the levels that
the slots' confidences predict the chain does not reach: a function of q alone, never of the tokens
drawn, so verification stays exact. docs/decoding.md, "Block drafting"."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, TreeConfig
from vdtrain.decode.kernels import shared_arange, step_kernel
from vdtrain.decode.rng import Purpose, inverse_cdf, inverse_cdf_draws
from vdtrain.decode.rows import DrafterRows, chain_visibility, per_stream
from vdtrain.decode.selection import top_k_low_index_first
from vdtrain.decode.trees import (
    STATIC_TREES,
    DraftTree,
    StaticTree,
    ancestor_matrix,
    first_nodes,
    static_tree,
)

if TYPE_CHECKING:
    from vdtrain.decode.builders.base import DraftContext
    from vdtrain.drafters import Drafter


@dataclass
class BlockTreeConfig(TreeConfig):
    """A tree over a block drafter's slots (``BlockTreeBuilder``)."""

    kind: str = "block"
    depth: int = 8  # levels drafted: the block's first `depth` slots (at most the drafter's)
    # A tree over the slots' first levels: a named static tree (eagle1, lantern_pp) or rank paths, cut to
    # `depth`; its top-ranked path goes on as a chain down to `depth`. Neither: a chain.
    preset: str | None = None
    paths: list[list[int]] | None = None
    # Confidence cut (DSpark-style): a level deeper than 1 is drafted only while the product of the slots'
    # confidences (each slot's largest q) down to it is at least `cut`. None: every level.
    cut: float | None = None
    # T > 0: draw each node's children i.i.d. from q (one inverse CDF for all ranks) rather than without
    # replacement (one round per rank). A token drawn twice among siblings wastes its second node; the
    # exact rule is the one for i.i.d. draws, so either way AR's distribution is kept.
    with_replacement: bool = False


class _Layout(NamedTuple):
    """The tree's index tensors on one device."""

    parents: torch.Tensor  # [T]
    depths: torch.Tensor  # [T]
    ancestors: torch.Tensor  # [T, T] bool: j is i or one of its ancestors
    descends: torch.Tensor | None  # [T, T] float: ancestors transposed (None: a chain, no rank past 0)
    slot_rank: torch.Tensor  # [T] long: (depth − 1) · width + rank, where a node's token sits in the top-k
    family_slots: torch.Tensor | None  # [P] the slot each family's children come from (None: slot = place)
    node_slots: torch.Tensor  # [T] the slot each node's children come from (a leaf: the last)
    # Draws at T > 0: round r draws the rank-r child of every family (a node with children) at once.
    draw_uniforms: (
        torch.Tensor | slice
    )  # [W · P] the node whose uniform family f's round-r draw takes (r · P + f)
    draw_place: torch.Tensor | None  # [T] node n's place in [root, round 0's draws, round 1's, ...] (None: n)
    # I.i.d. draws: every family's ranks in one draw, laid out family by family so that no copy is made.
    family_uniforms: (
        torch.Tensor | slice
    )  # [P · W] the node whose uniform family f's rank-r draw takes (f · W + r)
    family_place: torch.Tensor | None  # [T] node n's place in [root, family 0's draws, family 1's, ...]
    node_family: torch.Tensor  # [T] the family node n was drawn in (the root: 0)
    node_rank: torch.Tensor  # [T] its rank there (the root: −1, always drafted)
    ranks: torch.Tensor  # [T] each node's place among its siblings (the root: 0)


class _Shape:
    """One tree over the block's slots, its widest family, and its index tensors per device, made once."""

    def __init__(self, tree: StaticTree) -> None:
        self.tree = tree
        self.width = max(tree.width(n) for n in range(tree.size))
        self._layouts: dict[torch.device, _Layout] = {}

    def layout(self, device: torch.device) -> _Layout:
        """The tree's index tensors on ``device``, built once. Round ``r`` draws the rank-``r`` child of
        every family (a node with children) at once, a family without one included (its draw is never
        read): a round is then one scatter and one inverse CDF, with no gathers of the families left."""
        if device not in self._layouts:
            t, width = self.tree, self.width

            def index(values: list[int]) -> torch.Tensor | slice:
                start = values[0] if values else 0
                if values == list(range(start, start + len(values))):
                    return slice(start, start + len(values))
                return torch.tensor(values, device=device)

            families = [n for n in range(t.size) if t.width(n)]
            family_of = {f: i for i, f in enumerate(families)}
            child = {(t.parents[n], t.ranks[n]): n for n in range(1, t.size)}
            uniforms = [child.get((f, rank), f) for rank in range(width) for f in families]  # f: unused
            place = [0] + [1 + t.ranks[n] * len(families) + family_of[t.parents[n]] for n in range(1, t.size)]
            by_family = [child.get((f, rank), f) for f in families for rank in range(width)]
            family_place = [0] + [1 + family_of[t.parents[n]] * width + t.ranks[n] for n in range(1, t.size)]
            parents = torch.tensor(t.parents, device=device)
            depths = torch.tensor(t.depths, device=device)
            ancestors = ancestor_matrix(parents[None])[0]
            slots = [t.depths[n] for n in range(t.size) if t.width(n)]
            self._layouts[device] = _Layout(
                parents,
                depths,
                ancestors,
                ancestors.T.float() if width > 1 else None,
                (depths - 1).clamp_min(0) * width + torch.tensor(t.ranks, device=device),
                None if slots == list(range(len(slots))) else torch.tensor(slots, device=device),
                depths.clamp_max(t.depth - 1),
                index(uniforms),
                None if place == list(range(t.size)) else torch.tensor(place, device=device),
                index(by_family),
                None if family_place == list(range(t.size)) else torch.tensor(family_place, device=device),
                torch.tensor([0] + [family_of[t.parents[n]] for n in range(1, t.size)], device=device),
                torch.tensor([-1, *t.ranks[1:]], device=device),
                torch.tensor(t.ranks, device=device),
            )
        return self._layouts[device]


class BlockTreeBuilder(DraftTreeBuilder):
    """A chain or a static tree over the slots of one block, drafted by one drafter forward."""

    graph_safe = True
    drafts_blocks = True

    def __init__(self, config: BlockTreeConfig) -> None:
        if config.depth < 1:
            raise ValueError(f"a block tree drafts at least one level, got tree.depth={config.depth}")
        if config.preset is not None and config.paths is not None:
            raise ValueError("a block tree takes tree.preset or tree.paths, not both")
        if config.preset is not None and config.preset not in STATIC_TREES:
            raise ValueError(f"unknown static tree {config.preset!r}; known: {sorted(STATIC_TREES)}")
        if config.cut is not None and not 0.0 < config.cut <= 1.0:
            raise ValueError(f"tree.cut is a probability in (0, 1] (or null: no cut), got {config.cut}")
        self.cut, self.with_replacement = config.cut, config.with_replacement
        tree = STATIC_TREES[config.preset] if config.preset else config.paths or []
        chain = {(0,) * d for d in range(1, config.depth + 1)}
        paths = chain | {tuple(p) for p in tree if len(p) <= config.depth}
        self.configured_tree = static_tree(sorted(paths, key=lambda p: (len(p), p)))
        self._shapes: dict[int, _Shape] = {}  # by node count: each budget's tree, laid out once

    def shape(self, budget: TreeBudget) -> _Shape:
        """The tree under ``budget``: the configured tree's first ``nodes − 1`` rank paths (shortest
        first, then by rank), as ``static.py`` cuts it."""
        full = self.configured_tree
        size = budget.cap(full.size)
        if size not in self._shapes:
            self._shapes[size] = _Shape(first_nodes(full, size))
        return self._shapes[size]

    def max_nodes(self, budget: TreeBudget) -> int:
        """The tree's nodes: its ``depth − 1`` query rows take no more scratch slots than that."""
        return self.shape(budget).tree.size

    def for_vocabulary(self, vocab_size: int) -> BlockTreeBuilder:
        """Ranks past the vocabulary are dropped, with their subtrees: a node has no more children than
        there are tokens."""
        kept = [p for p in self.configured_tree.paths if max(p) < vocab_size]
        if len(kept) == len(self.configured_tree.paths):
            return self
        fitted = copy.copy(self)
        fitted.configured_tree, fitted._shapes = static_tree(kept), {}
        return fitted

    def check_drafter(self, drafter: Drafter) -> None:
        if drafter.block_slots < self.configured_tree.depth:
            raise ValueError(
                f"a block tree of depth {self.configured_tree.depth} needs a drafter that drafts blocks of "
                f"at least that many tokens; this {drafter.config.kind} drafter drafts "
                f"{drafter.block_slots or 'none'} (train one with drafter.kind=block, or lower tree.depth)"
            )

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        if state.tokens is None:
            raise ValueError("BlockTreeBuilder reads the committed tokens above the block: StepState.tokens")
        shape = self.shape(state.budget)
        logits = state.root_logits[:, None]  # slot 1: the root's catch-up row
        if shape.tree.depth > 1:
            _, block = ctx.drafter_block(state.root_feats, self._query_rows(ctx, state, shape.tree.depth - 1))
            logits = torch.cat([logits, block], 1)  # [R, depth, V]
        return self._draw(ctx, state, shape, logits)

    @step_kernel
    def _query_rows(self, ctx: DraftContext, state: StepState, count: int) -> DrafterRows:
        """Rows ``j = 1 .. depth − 1`` of the block: the token ``m + j`` each drafts (m committed), at its
        row position, laid out as a chain in scratch columns from the root's on (row j sees the committed
        rows up to the root's and the rows 1 .. j, so a shorter block drafts the same first rows),
        carrying the committed token above it: zero embeddings in the first image row, and where the block
        reaches past a row's width to tokens not committed yet."""
        committed = state.committed
        batch, device = len(committed), committed.device
        n_img, cols = ctx.target.num_image_tokens, ctx.target.grid[1]
        index = committed[:, None] + shared_arange(count, device)[None]  # the token before each drafted one
        column = index - 1  # row j's scratch column: the root's, then one per row
        above = index - (cols - 1)  # the token above the drafted one
        known = above >= 0
        if count >= cols:  # rows that reach a token of the block's own row: not committed
            known = known & (shared_arange(count, device) < cols - 1)
        embeds = ctx.drafter_embeds(state.tokens.gather(1, above.clamp_min(0)))
        embeds = embeds * per_stream(known, len(embeds) // batch)[..., None]
        slots, vis = ctx.target.image_slot(column), chain_visibility(column, n_img)
        return ctx.drafter_inputs(None, index.clamp_max(n_img), slots, vis, next_embeds=embeds)

    def levels(self, q: torch.Tensor) -> torch.Tensor:
        """[B] long: the levels drafted under the cut, from the slots' confidences ``q`` [B, depth, V] (the
        confidence the tree's draws use, ``draft_confidence``). Slot d's largest q predicts the chance a
        depth-d draft is accepted, so the running product over slots 1 .. d predicts that the chain reaches
        depth d; it never rises, so the levels kept are the first ones. Level 1 is always drafted: the
        verification forward runs anyway, and a step with no draft commits only AR's token. Each row's
        levels depend on its own q alone, and on no token drawn (that keeps verification exact)."""
        reach = q.amax(-1).float().cumprod(1)  # [B, depth]: max reductions only, no vocabulary-wide selection
        return (reach >= self.cut).sum(1).clamp_min(1)

    @step_kernel
    def _draw(self, ctx: DraftContext, state: StepState, shape: _Shape, logits: torch.Tensor) -> DraftTree:
        """The tree's tokens from the slots' drafter ``logits`` [R, depth, V]: slot d's top-k at T = 0,
        sampled from slot d's q at T > 0, without replacement or i.i.d. (see the module docstring). A
        rank-0 child draws from its slot's whole q, so only later ranks drawn without replacement can run
        past q's support."""
        t, batch, layout = shape.tree, len(state.roots), shape.layout(state.roots.device)
        valid = state.depth_limit[:, None] >= layout.depths[None]  # [B, T]: within the image
        # [B, depth, V]: q at T > 0; at T = 0 its order is the processed logits' before top-k and top-p, so
        # its first ranks are theirs, without the top-k filter's vocabulary-wide selection
        q = ctx.draft_confidence(logits)
        if self.cut is not None:
            valid = valid & (layout.depths[None] <= self.levels(q)[:, None])
        if ctx.sampling.greedy:
            top = top_k_low_index_first(q, shape.width)[1].flatten(1)  # [B, depth·width]
            tokens = top.gather(1, layout.slot_rank[None].expand(batch, -1))
            tokens = torch.cat([state.roots[:, None], tokens[:, 1:]], 1)
            q_nodes = None
        else:  # q: no top-k filter (the module docstring)
            u = state.rng.uniform(Purpose.DRAFT, t.size)
            mass = q if layout.family_slots is None else q.index_select(1, layout.family_slots)  # [B, P, V]
            if self.with_replacement or shape.width == 1:  # every rank of every family in one draw
                draws = inverse_cdf_draws(mass, _columns(u, layout.family_uniforms).view(*mass.shape[:2], -1))
                tokens, place = torch.cat([state.roots[:, None], draws.flatten(1)], 1), layout.family_place
            else:
                u, place = _columns(u, layout.draw_uniforms), layout.draw_place
                tokens, valid = _draw_without_replacement(layout, shape.width, state.roots, mass, u, valid)
            if place is not None:
                tokens = tokens.index_select(1, place)
            q_nodes = q.index_select(1, layout.node_slots)  # each node's children's q
        return DraftTree(
            tokens,
            layout.parents.expand(batch, -1),
            layout.depths.expand(batch, -1),
            valid,
            q_nodes,
            sampled=not ctx.sampling.greedy,
            depth_bound=t.depth,
            width_bound=shape.width,
            ancestors=layout.ancestors[None],
            sibling_ranks=layout.ranks[None],
            chain=t.size == t.depth + 1,  # as many nodes as levels: one path, stored in order
            with_replacement=self.with_replacement and not ctx.sampling.greedy,
        )


def _draw_without_replacement(
    layout: _Layout, width: int, roots: torch.Tensor, mass: torch.Tensor, u: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``r`` draws the rank-``r`` child of every family at once from the ``mass`` [B, P, V] its
    earlier ranks left, a family without one included (its draw is never read). Returns the tokens
    [B, 1 + W · P] (the ``roots``, then round by round) and ``valid`` with the children past a family's
    support left out, with their subtrees."""
    mass = mass.to(torch.float64, copy=True)  # each family's mass not drawn yet
    families = mass.shape[1]
    support = (mass > 0).sum(-1).index_select(1, layout.node_family)  # a family whose q holds r tokens
    valid = valid & (support > layout.node_rank)  # or fewer has no rank-r child
    drawn = [roots[:, None]]
    for rank in range(width):
        if rank:
            mass.scatter_(-1, drawn[-1][..., None], 0.0)
        drawn.append(inverse_cdf(mass, u[:, rank * families : (rank + 1) * families]))
    return torch.cat(drawn, 1), (~valid).float() @ layout.descends == 0  # drafted: it and its ancestors


def _columns(u: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """Columns ``index`` of ``u`` [B, T]: a view where they are a range, else one gather."""
    return u[:, index] if isinstance(index, slice) else u.index_select(1, index)
