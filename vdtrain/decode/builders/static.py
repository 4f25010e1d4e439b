"""Static draft trees (EAGLE-1, LANTERN++) as batched tensor programs.

The tree's shape is fixed, so everything about it (levels, each parent's children in rank order, the
ancestor mask) is laid out once. Each step runs one drafter forward per level over every row at once.

Children at T = 0 are the drafter's top-k. At T > 0 they are sampled without replacement from q, one
child after another by inverse CDF on the mass not drawn yet (each child ``c`` with its own per-prompt
uniform, ``Purpose.DRAFT`` at index ``c``); q is kept for the SpecInfer rule. A node drafts at most as
many children as q has tokens: a child drawn past q's support would be judged with q = 0 and accepted
for free, so the ranks beyond it stay undrafted (``valid`` False), as do their descendants and every
node deeper than the image has tokens left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, TreeConfig
from vdtrain.decode.kernels import step_kernel
from vdtrain.decode.rng import Purpose, inverse_cdf
from vdtrain.decode.rows import visibility
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


class _Layout(NamedTuple):
    parents: torch.Tensor  # [T]
    depths: torch.Tensor  # [T]
    ancestors: torch.Tensor  # [T, T] bool
    levels: list[torch.Tensor]  # per depth: its nodes
    ranks: torch.Tensor  # [T] each node's place among its siblings (the root: 0)


class _Shape:
    """One tree's levels, each level's families (a parent and its children in rank order), its widest
    family, and its index tensors per device, made once."""

    def __init__(self, tree: StaticTree) -> None:
        self.tree = tree
        self.levels = [tree.nodes_at(d) for d in range(1, tree.depth + 1)]
        self.families = [
            [
                (p, [i for i in level if tree.parents[i] == p])
                for p in sorted({tree.parents[i] for i in level})
            ]
            for level in self.levels
        ]
        self.width = max(len(kids) for families in self.families for _, kids in families)
        self._layout: dict[torch.device, _Layout] = {}

    def layout(self, device: torch.device) -> _Layout:
        if device not in self._layout:
            parents = torch.tensor(self.tree.parents, device=device)
            depths = torch.tensor(self.tree.depths, device=device)
            levels = [torch.tensor(level, device=device) for level in self.levels]
            ranks = torch.tensor(self.tree.ranks, device=device)
            self._layout[device] = _Layout(parents, depths, ancestor_matrix(parents[None])[0], levels, ranks)
        return self._layout[device]


class LevelBuffers(NamedTuple):
    """The tree's buffers while its levels are drawn."""

    tokens: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
    q: torch.Tensor | None  # [B, T, V] the distribution each node's children came from (T > 0)
    u: torch.Tensor | None  # [B, T] each node's draw (T > 0)


@dataclass
class StaticTreeConfig(TreeConfig):
    """A fixed tree of drafter ranks: a named one (``preset``) or explicit rank ``paths``."""

    kind: str = "static"
    preset: str | None = None  # a named tree (eagle1, lantern_pp)
    paths: list[list[int]] | None = None  # explicit rank paths instead of a preset


class StaticTreeBuilder(DraftTreeBuilder):
    """A fixed tree: top-k children at T = 0; at T > 0 children sampled without replacement from q."""

    graph_safe = True

    def __init__(self, config: StaticTreeConfig) -> None:
        """``config``'s tree; exactly one of ``preset`` and ``paths`` names it."""
        if (config.preset is None) == (config.paths is None):
            raise ValueError("a static tree needs exactly one of tree.preset or tree.paths")
        if config.preset is not None and config.preset not in STATIC_TREES:
            raise ValueError(f"unknown static tree {config.preset!r}; known: {sorted(STATIC_TREES)}")
        paths = STATIC_TREES[config.preset] if config.preset else [tuple(p) for p in config.paths]
        self.configured_tree = static_tree(paths)
        self._shapes: dict[int, _Shape] = {}  # by node count: each budget's tree, laid out once

    def shape(self, budget: TreeBudget) -> _Shape:
        """The tree under ``budget``: the configured tree's first ``nodes - 1`` rank paths (shortest first,
        then by rank: every kept path's parent and lower-ranked siblings are kept too)."""
        full = self.configured_tree
        size = budget.cap(full.size)
        if size not in self._shapes:
            self._shapes[size] = _Shape(first_nodes(full, size))
        return self._shapes[size]

    def max_nodes(self, budget: TreeBudget) -> int:
        return self.shape(budget).tree.size

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        shape = self.shape(state.budget)
        layout = shape.layout(state.roots.device)
        feats_of, logits_of = {0: state.root_feats}, {0: state.root_logits}
        drafted = None
        for depth in range(1, shape.tree.depth + 1):
            drafted, rows = self._draw(
                ctx,
                state,
                shape,
                layout,
                depth=depth,
                drafted=drafted,
                feats_of=feats_of,
                logits_of=logits_of,
            )
            if rows is None:
                break
            parent_feats, inputs = rows
            f_hat, logits = ctx.drafter_forward(parent_feats, inputs)
            for j, node in enumerate(shape.levels[depth - 1]):
                feats_of[node], logits_of[node] = f_hat[:, j], logits[:, j]
        batch = len(state.roots)
        return DraftTree(
            drafted.tokens,
            layout.parents.expand(batch, -1),
            layout.depths.expand(batch, -1),
            drafted.valid,
            drafted.q,
            sampled=not ctx.sampling.greedy,
            depth_bound=shape.tree.depth,
            width_bound=shape.width,
            sibling_ranks=layout.ranks[None],
        )

    @step_kernel
    def _draw(
        self,
        ctx,
        state: StepState,
        shape: _Shape,
        layout: _Layout,
        *,
        depth: int,
        drafted,
        feats_of,
        logits_of,
    ):
        """Level ``depth``'s children of the tree ``shape`` from their parents' drafter logits
        (``logits_of``: node → [R, V]; ``feats_of``: node → [R, H]; ``drafted`` None: the first level,
        with the tree's buffers made here); then, unless it is the deepest level, the drafter rows of this
        level's nodes (their parents' features, the inputs). Returns (``LevelBuffers``, rows or None)."""
        t, sampling = shape.tree, ctx.sampling
        batch, device = len(state.roots), state.roots.device
        size, vocab = t.size, state.root_logits.shape[-1]
        n_img = ctx.target.num_image_tokens
        if drafted is None:
            tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
            tokens[:, 0] = state.roots
            valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
            valid[:, 0] = True
            q_nodes = None if sampling.greedy else torch.zeros(batch, size, vocab, device=device)
            u = None if sampling.greedy else state.rng.uniform(Purpose.DRAFT, size)
            drafted = LevelBuffers(tokens, valid, q_nodes, u)
        tokens, valid, q_nodes, u = drafted
        reach = state.depth_limit >= depth  # [B]
        for parent, kids in shape.families[depth - 1]:
            kids = kids[:vocab]  # never more children than tokens
            if sampling.greedy:
                picks = ctx.draft_logits(logits_of[parent]).topk(len(kids), dim=-1).indices
                drawn = [(picks[:, r], reach) for r in range(len(kids))]
            else:
                q = ctx.draft_probs(logits_of[parent])  # [B, V]
                q_nodes[:, parent] = q
                left, drawn = q.double(), []
                for kid in kids:
                    token = inverse_cdf(left, u[:, kid])
                    drawn.append((token, reach & (left > 0).any(-1)))  # past the support: undrafted
                    left = left.scatter(1, token[:, None], 0.0)
            for kid, (token, ok) in zip(kids, drawn, strict=True):
                tokens[:, kid] = token
                valid[:, kid] = valid[:, parent] & ok
        if depth == t.depth:
            return drafted, None
        # One drafter forward over this level to get its nodes' children distributions.
        level = shape.levels[depth - 1]
        level_t = layout.levels[depth - 1]
        parent_feats = torch.stack([feats_of[t.parents[i]] for i in level], dim=1)  # [R, S, H]
        base = state.committed - 1
        index = (state.committed - 1 + depth).clamp_max(n_img)[:, None].expand(-1, len(level))
        slots = ctx.target.image_slot(base[:, None] + (level_t - 1)[None, :])
        seen = layout.ancestors[level_t][:, 1:].expand(batch, -1, -1)  # [B, S, T-1] over non-root nodes
        vis = visibility(base, base, seen, n_img - 1 + size - 1)
        inputs = ctx.drafter_inputs(tokens[:, level_t], index, slots, vis, offset=depth)
        return drafted, (parent_feats, inputs)
