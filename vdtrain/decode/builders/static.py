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

from typing import TYPE_CHECKING

import torch

from vdtrain.decode.builders.base import DraftTreeBuilder, StepState
from vdtrain.decode.rng import Purpose, inverse_cdf
from vdtrain.decode.trees import DraftTree, StaticTree, ancestor_matrix

if TYPE_CHECKING:
    from vdtrain.decode.engine import SpeculativeEngine


class StaticTreeBuilder(DraftTreeBuilder):
    """A fixed tree: top-k children at T = 0; at T > 0 children sampled without replacement from q."""

    def __init__(self, tree: StaticTree) -> None:
        self.tree = tree
        self.levels = [tree.nodes_at(d) for d in range(1, tree.depth + 1)]
        # Per level: (parent, its children in rank order) for every parent with children there.
        self.families = [
            [
                (p, [i for i in level if tree.parents[i] == p])
                for p in sorted({tree.parents[i] for i in level})
            ]
            for level in self.levels
        ]
        self.width = max(len(kids) for families in self.families for _, kids in families)
        self._layout: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def max_nodes(self) -> int:
        return self.tree.size

    def layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents [T], depths [T], ancestor mask [T, T]) on ``device``, built once."""
        if device not in self._layout:
            parents = torch.tensor(self.tree.parents, device=device)
            depths = torch.tensor(self.tree.depths, device=device)
            self._layout[device] = (parents, depths, ancestor_matrix(parents[None])[0])
        return self._layout[device]

    def build(self, engine: SpeculativeEngine, state: StepState) -> DraftTree:
        t, sampling = self.tree, engine.sampling
        batch, device = len(state.roots), state.roots.device
        size, vocab = t.size, state.root_logits.shape[-1]
        n_img = engine.target.num_image_tokens
        parents, depths, ancestors = self.layout(device)
        tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
        tokens[:, 0] = state.roots
        valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
        valid[:, 0] = True
        q_nodes = None if sampling.greedy else torch.zeros(batch, size, vocab, device=device)
        u = None if sampling.greedy else state.rng.uniform(Purpose.DRAFT, size)
        feats_of, logits_of = {0: state.root_feats}, {0: state.root_logits}
        base = state.committed - 1
        for depth, (level, families) in enumerate(zip(self.levels, self.families, strict=True), start=1):
            reach = state.depth_limit >= depth  # [B]
            for parent, kids in families:
                kids = kids[:vocab]  # never more children than tokens
                if sampling.greedy:
                    picks = engine.draft_logits(logits_of[parent]).topk(len(kids), dim=-1).indices
                    drawn = [(picks[:, r], reach) for r in range(len(kids))]
                else:
                    q = engine.draft_probs(logits_of[parent])  # [B, V]
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
                break
            # One drafter forward over this level to get its nodes' children distributions.
            level_t = torch.tensor(level, device=device)
            parent_feats = torch.stack([feats_of[t.parents[i]] for i in level], dim=1)  # [R, S, H]
            index = (state.committed - 1 + depth).clamp_max(n_img)[:, None].expand(-1, len(level))
            slots = engine.target.image_slot(base[:, None] + (level_t - 1)[None, :])
            seen = ancestors[level_t][:, 1:].expand(batch, -1, -1)  # [B, S, T-1] over non-root nodes
            vis = engine._visibility(base, base, seen, n_img - 1 + size - 1)
            f_hat, logits = engine.drafter_rows(parent_feats, tokens[:, level_t], index, slots, vis)
            for j, node in enumerate(level):
                feats_of[node], logits_of[node] = f_hat[:, j], logits[:, j]
        return DraftTree(
            tokens,
            parents.expand(batch, -1),
            depths.expand(batch, -1),
            valid,
            q_nodes,
            sampled=not sampling.greedy,
            depth_bound=t.depth,
            width_bound=self.width,
        )
