"""The node-by-node EAGLE-2 builder the tensor builder (``vdtrain.decode.builders.dynamic``) replaced,
kept as the reference its tests compare trees against: plain Python lists, one ``topk`` per node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vdtrain.decode.builders.base import DraftTreeBuilder, StepState
from vdtrain.decode.rows import visibility
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from vdtrain.decode.budget import TreeBudget
    from vdtrain.decode.builders.base import DraftContext


@dataclass
class _Node:
    token: int
    parent: int  # index into the row's node list
    depth: int
    score: float  # cumulative log q from the root
    col: int = -1  # drafter scratch column once the node has been expanded


class ReferenceDynamicTreeBuilder(DraftTreeBuilder):
    """EAGLE-2's context-aware dynamic tree, with per-prompt ``depth`` and ``top_k`` (PEANUT adapts
    them per tree; EAGLE-2 keeps them fixed).

    From the root take the ``top_k`` most likely children; then for ``depth`` rounds expand the
    frontier — the ``top_k`` nodes of the newest layer with the highest cumulative log-probability —
    each into its ``top_k`` children, one batched drafter forward per round. Finally keep the
    ``total_tokens - 1`` best nodes by cumulative log-probability (ancestors always outrank their
    descendants), parents before children. Drafts are deterministic: verification treats q as a
    point mass on each child.
    """

    def __init__(self, top_k: int = 10, depth: int = 5, total_tokens: int = 59) -> None:
        if top_k < 1 or depth < 0 or total_tokens < 2:
            raise ValueError(
                f"dynamic tree needs top_k >= 1, depth >= 0 and total_tokens >= 2 "
                f"(got top_k={top_k}, depth={depth}, total_tokens={total_tokens})"
            )
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens

    def max_nodes(self, budget: TreeBudget) -> int:
        return max(self.total_tokens, 1 + self.top_k * (self.depth + 1))

    def shape(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth rounds [B], top_k [B]) for this step's trees."""
        batch = len(state.roots)
        return (
            torch.full((batch,), self.depth, dtype=torch.long),
            torch.full((batch,), self.top_k, dtype=torch.long),
        )

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        batch, device = len(state.roots), state.roots.device
        prefix = ctx.target.prefix_length
        rounds, widths = self.shape(state)
        widths = widths.clamp_max(state.root_logits.shape[-1])  # no more children than tokens
        limit = state.depth_limit.cpu()
        logq = ctx.draft_confidence(state.root_logits).clamp_min(1e-30).log().cpu()  # [B, V]
        nodes: list[list[_Node]] = [[_Node(int(state.roots[b]), -1, 0, 0.0)] for b in range(batch)]
        frontier: list[list[int]] = []
        for b in range(batch):
            k = int(widths[b]) if limit[b] >= 1 else 0
            top = logq[b].topk(k)
            nodes[b] += [_Node(int(t), 0, 1, float(s)) for s, t in zip(top.values, top.indices, strict=True)]
            frontier.append(list(range(1, 1 + k)))
        feats_of = {(b, 0): state.root_feats[b::batch] for b in range(batch)}  # per stream rows
        k_max = int(widths.max())
        for r in range(1, int(rounds.max()) + 1):
            grow = [b for b in range(batch) if r <= rounds[b] and r + 1 <= limit[b] and frontier[b]]
            if not grow:
                break
            size = max(len(frontier[b]) for b in grow)
            # Batched drafter forward over every growing row's frontier (padded by repeating a node).
            picks = [
                frontier[b] + [frontier[b][-1]] * (size - len(frontier[b])) if b in grow else [0] * size
                for b in range(batch)
            ]
            for b in grow:
                for j, i in enumerate(frontier[b]):
                    nodes[b][i].col = (r - 1) * k_max + j
            toks = torch.tensor([[nodes[b][i].token for i in picks[b]] for b in range(batch)], device=device)
            parent_feats = torch.stack(
                [
                    torch.stack(
                        [feats_of.get((b, nodes[b][i].parent), state.root_feats[b::batch]) for i in picks[b]],
                        dim=1,
                    )
                    for b in range(batch)
                ],
                dim=1,
            )  # [streams, B, S, H]
            parent_feats = parent_feats.reshape(-1, size, parent_feats.shape[-1])
            width = (r - 1) * k_max + size
            vis = torch.zeros(batch, size, width, dtype=torch.bool)
            for b in grow:
                for j, i in enumerate(picks[b]):
                    a = i
                    while a > 0:
                        vis[b, j, nodes[b][a].col] = True
                        a = nodes[b][a].parent
            base = state.committed - 1
            slots = prefix + base[:, None] + ((r - 1) * k_max + torch.arange(size, device=device))[None, :]
            index = (state.committed - 1 + r).clamp_max(ctx.target.num_image_tokens)
            vis_full = visibility(base, base, vis.to(device), int(base.max()) + width)
            rows = ctx.drafter_inputs(toks, index[:, None].expand(-1, size), slots, vis_full)
            f_hat, logits = ctx.drafter_forward(parent_feats, rows)
            child_logq = ctx.draft_confidence(logits).clamp_min(1e-30).log().cpu()  # [B, S, V]
            for b in grow:
                k = int(widths[b])
                layer = []
                for j, i in enumerate(frontier[b]):
                    feats_of[(b, i)] = f_hat[b::batch, j]
                    top = child_logq[b, j].topk(k)
                    for s, t in zip(top.values, top.indices, strict=True):
                        layer.append(len(nodes[b]))
                        nodes[b].append(_Node(int(t), i, r + 1, nodes[b][i].score + float(s)))
                frontier[b] = sorted(layer, key=lambda n, b=b: -nodes[b][n].score)[:k]
        return self._select(nodes, state, device)

    def _select(self, nodes: list[list[_Node]], state: StepState, device) -> DraftTree:
        batch, size = len(nodes), self.total_tokens
        tokens = torch.zeros(batch, size, dtype=torch.long)
        parents = torch.full((batch, size), -1, dtype=torch.long)
        depths = torch.zeros(batch, size, dtype=torch.long)
        valid = torch.zeros(batch, size, dtype=torch.bool)
        for b, row in enumerate(nodes):
            ranked = sorted(range(1, len(row)), key=lambda i, row=row: (-row[i].score, row[i].depth, i))
            keep = {0}
            for i in ranked:  # ancestors outrank descendants; the check guards ties at -inf
                if len(keep) == size:
                    break
                if row[i].parent in keep:
                    keep.add(i)
            order = sorted(keep, key=lambda i, row=row: (row[i].depth, i))
            where = {old: new for new, old in enumerate(order)}
            for new, old in enumerate(order):
                tokens[b, new] = row[old].token
                parents[b, new] = where[row[old].parent] if old else -1
                depths[b, new] = row[old].depth
                valid[b, new] = True
            parents[b, len(order) :] = 0
            depths[b, len(order) :] = 1
        return DraftTree(
            tokens.to(device), parents.to(device), depths.to(device), valid.to(device), None, False
        )


class ReferenceDeepestPathBuilder(ReferenceDynamicTreeBuilder):
    """PEANUT's selection on the reference builder: the best path to the deepest level is always kept."""

    def _select(self, nodes: list[list[_Node]], state: StepState, device) -> DraftTree:
        for row in nodes:
            deepest = max(node.depth for node in row)
            if deepest < 2:
                continue
            best = max(
                (i for i, node in enumerate(row) if node.depth == deepest), key=lambda i, r=row: r[i].score
            )
            while best > 0:
                row[best].score = float("inf")
                best = row[best].parent
        return super()._select(nodes, state, device)
