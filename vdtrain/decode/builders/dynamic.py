"""EAGLE-2's dynamic draft tree as tensor ops: no device→host reads, an op count independent of the batch.

From the root take the ``top_k`` most likely children; then for ``depth`` rounds expand the frontier
(the ``top_k`` newest nodes with the highest cumulative log q) into ``top_k`` children each, one batched
drafter forward per round; keep the ``total_tokens - 1`` best nodes, parents before children. Drafts
are deterministic (q is a point mass on each child); q here is the drafter's confidence, its softmax
before top-k and top-p (``DraftContext.draft_confidence``). It builds the node-by-node reference builder's
trees (``tests/reference_builders.py``) in fixed padded shapes: a host-side *envelope* (``R`` rounds,
``K`` wide; PEANUT overrides ``envelope``), a ``K``-wide frontier and ``K·K`` candidates per round, so a
step's host work does not grow with the batch or the tree. Ties are fixed (``topk`` leaves them open);
docs/decoding.md, "Drafting", gives the keys.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, TreeConfig
from vdtrain.decode.kernels import shared_arange, shared_eye, shared_full, step_kernel
from vdtrain.decode.rows import DrafterRows, image_columns, per_stream
from vdtrain.decode.selection import top_k_low_index_first
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from vdtrain.decode.builders.base import DraftContext


def ranked(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` best entries of ``scores`` [..., N] along the last dim: the ``valid``
    [..., N] ones first, by (−score, index)."""
    key = torch.where(valid, scores, float("-inf"))
    return key.sort(dim=-1, descending=True, stable=True).indices[..., :k]


class Layer(NamedTuple):
    """Nodes made in one round, in creation order."""

    tokens: torch.Tensor  # [B, n]
    scores: torch.Tensor  # [B, n] cumulative −log q (lower is likelier), float64; +inf outside the tree
    parents: torch.Tensor  # [B, n / K or 1] flat node index of the parent of each K nodes (root: −1)
    valid: torch.Tensor  # [B, n]
    # A node's depth follows from its flat index (``_depths``): the root, K children, K·K a round; its
    # parent too: the layers' ``parents`` joined hold node i's at (i + K − 1) // K (``_parents``).


class BuildPlan(NamedTuple):
    """What a build fixes for all its rounds: each row's shape and every round's drafter rows."""

    rounds: torch.Tensor  # [B] expansion rounds of each row's tree
    valid: torch.Tensor  # [B, rounds, K·K] bool: round r's candidates (at r − 1) within the row's shape
    rows: DrafterRows | None  # every round's drafter rows, round r's frontier node j at row (r−1)·K + j
    # (its scratch column), each seeing the committed columns and its own: made once per build


@dataclass
class Frontier:
    """The nodes a round expands, with what their drafter rows need."""

    tokens: torch.Tensor  # [B, K]
    score: torch.Tensor  # [B, K]
    node: torch.Tensor  # [B, K] flat node index
    feats: torch.Tensor  # [R, K, H] the parents' drafter features
    seen: torch.Tensor  # [R, 1, K, L + W] the rows' drafter mask: the plan's, plus their ancestors' columns
    plan: BuildPlan


@dataclass
class DynamicTreeConfig(TreeConfig):
    """EAGLE-2's dynamic tree (``DynamicTreeBuilder``)."""

    kind: str = "dynamic"
    top_k: int = 10  # children per expanded node and frontier width
    depth: int = 5  # expansion rounds after the root's children
    total_tokens: int = 59  # nodes kept, root included


class DynamicTreeBuilder(DraftTreeBuilder):
    """EAGLE-2's dynamic tree in padded tensor shapes, with per-prompt ``depth`` and ``top_k`` (``shape``).

    A ``top_k`` above the target's vocabulary is capped to it, with a warning, when the engine is built
    (``for_vocabulary``): the envelope grows as ``top_k · (depth + 1)`` scratch slots and ``top_k²``
    candidates per round, so an uncapped setting (600 on 512 tokens) made every step crawl while its trees
    were the capped ones. ``keep_deepest_path`` (PEANUT): the best-scoring
    path to the deepest level drafted is kept whatever the node budget prunes. A call's node budget
    (``StepState.budget``) keeps fewer of the drafted nodes: the rounds are drafted all the same.
    """

    keep_deepest_path: ClassVar[bool] = False
    graph_safe: ClassVar[bool] = True
    # True: ``shape`` gives per-prompt (rounds, top_k) of its own under ``envelope`` (PEANUT), which each
    # build checks on the device; False: every tree is the envelope (EAGLE-2), nothing to check.
    own_shape: ClassVar[bool] = False

    def __init__(self, config: DynamicTreeConfig) -> None:
        top_k, depth, total_tokens = config.top_k, config.depth, config.total_tokens
        if top_k < 1 or depth < 0 or total_tokens < 2:
            raise ValueError(
                f"dynamic tree needs top_k >= 1, depth >= 0 and total_tokens >= 2 "
                f"(got top_k={top_k}, depth={depth}, total_tokens={total_tokens})"
            )
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens

    def for_vocabulary(self, vocab_size: int) -> DynamicTreeBuilder:
        if self.top_k <= vocab_size:
            return self
        warnings.warn(
            f"tree.top_k={self.top_k} exceeds the target's vocabulary ({vocab_size} image tokens): a "
            f"node cannot have more distinct children than there are tokens, so top_k is {vocab_size}",
            stacklevel=3,
        )
        fitted = copy.copy(self)
        fitted.top_k = vocab_size
        return fitted

    def tree_size(self, budget: TreeBudget) -> int:
        return budget.cap(self.total_tokens)

    def max_nodes(self, budget: TreeBudget) -> int:
        return max(self.tree_size(budget), 1 + self.top_k * (self.depth + 1))

    def shape(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(expansion rounds [B], top_k [B]) for this step's trees, on the state's device."""
        batch, device = len(state.roots), state.roots.device
        return (
            shared_full(self.depth, device, torch.long).expand(batch),
            shared_full(self.top_k, device, torch.long).expand(batch),
        )

    def envelope(self, state: StepState) -> tuple[int, int]:
        """Host bound (rounds, top_k) on this step's ``shape``: the padded shapes. Called after ``shape``."""
        return self.depth, self.top_k

    @staticmethod
    def _top_children(ctx: DraftContext, logits: torch.Tensor, size: int):
        """(log q [..., K], tokens [..., K]): the ``K`` likeliest tokens by the drafter's confidence q
        (``ctx.draft_confidence``) of ``logits`` [R, ..., V], ties to the lower id, with no selection over
        the whole vocabulary (``selection.top_k_low_index_first``). q is floored at 1e-30 (ranks stay
        defined)."""
        return top_k_low_index_first(ctx.draft_confidence(logits).clamp_min(1e-30).log(), size)

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        vocab, device = state.root_logits.shape[-1], state.roots.device
        rounds, widths = self.shape(state)
        rounds, widths = rounds.to(device), widths.to(device).clamp_max(vocab)
        depth_cap, k_cap = self.envelope(state)
        size = min(k_cap, vocab)  # K: frontier width and children per frontier node
        room, kept = self.max_nodes(state.budget), self.tree_size(state.budget)
        if depth_cap * size > room:
            raise ValueError(
                f"{type(self).__name__}: an envelope of {depth_cap} rounds x {size} nodes needs "
                f"{depth_cap * size} drafter scratch slots but max_nodes() reserves {room}"
            )
        if self.own_shape:
            torch._assert_async(
                ((rounds <= depth_cap) & (widths <= size)).all(),
                f"{type(self).__name__}.shape gave a (rounds, top_k) outside envelope ({depth_cap}, {size})",
            )
        grown, front, rows = self._root_children(ctx, state, rounds, widths, depth_cap, size)
        for r in range(1, depth_cap + 1):
            f_hat, logits = ctx.drafter_forward(front.feats, rows)
            if r < depth_cap:
                layer, front, rows = self._expand(
                    ctx, state, front, f_hat, logits, r=r, depth_cap=depth_cap, size=size
                )
                grown = [*grown, layer]
            else:
                return self._last_round(
                    ctx, state, front, logits, grown, depth_cap=depth_cap, size=size, kept=kept
                )
        columns = (torch.cat(column, 1) for column in zip(*grown, strict=True))
        return self._select(*columns, depth_cap, size, kept)

    @step_kernel
    def _root_children(self, ctx, state: StepState, rounds, widths, depth_cap: int, size: int):
        """Depth 1 (the root's children, round 1's frontier in rank order) and round 1's drafter rows, for
        ``rounds`` [B] expansion rounds and ``widths`` [B] top-k per prompt (``shape``). Returns ([the
        root's layer, depth 1's], the ``Frontier``, the drafter rows: None without rounds).

        Every round's row layout (positions, slots, the committed columns and the row's own scratch
        column in its mask) and every round's candidate validity are made here once; a round only adds
        its rows' embeddings and ancestors (a GPU step is bound by kernel launches)."""
        roots, limit = state.roots, state.depth_limit
        batch, device = len(roots), roots.device
        col = shared_arange(size, device)
        front_logq, front_tok = self._top_children(ctx, state.root_logits, size)
        r = shared_arange(depth_cap + 1, device)
        room = limit[:, None] > r  # [B, 1 + rounds]: room below depth r + 1
        wide = col < widths[:, None]  # [B, K]: ranks within the row's width
        first_ok = room[:, :1] & wide
        # Scores are cumulative −log q, +inf where a node is not in the tree (ranking reads no mask).
        # float32 −log q widened to float64 exactly, by the ``where`` itself (one kernel).
        inf = shared_full(float("inf"), device, torch.float64).expand(batch, size)  # not 0-dim: it promotes
        front_score = torch.where(first_ok, front_logq.neg(), inf)
        root = Layer(
            roots[:, None],
            shared_full(0.0, device, front_score.dtype).expand(batch, 1),
            shared_full(-1, device, torch.long).expand(batch, 1),
            shared_full(True, device, torch.bool).expand(batch, 1),
        )
        first = Layer(front_tok, front_score, shared_full(0, device, torch.long).expand(batch, 1), first_ok)
        # Round r grows a row's candidates j·K + c (j, c < its width) if it has r rounds and room below.
        kid_ok = wide[:, :, None] & wide[:, None, :]
        grow = (rounds[:, None] >= r[1:]) & room[:, 1:]  # [B, rounds]
        valid = grow[:, :, None] & kid_ok.flatten(1)[:, None]  # [B, rounds, K·K]
        rows = None
        if depth_cap:  # the rows of every round: frontier node j of round r at scratch column (r−1)·K + j
            n_img, base = ctx.target.num_image_tokens, state.committed - 1
            cols = shared_arange(depth_cap * size, device)
            own = shared_eye(depth_cap * size, device).expand(batch, -1, -1)
            columns = image_columns(base, base, depth_cap * size, n_img - 1 + depth_cap * size)
            rows = ctx.drafter_inputs(
                None,
                (state.committed[:, None] + cols // size).clamp_max(n_img),  # base + 1 + round
                ctx.target.image_slot(base[:, None] + cols),
                columns.rows(own),
                next_embeds=state.root_feats[:, None, :0],  # a round brings its own (``_frontier_rows``)
            )
        front = Frontier(
            front_tok,
            front_score,
            shared_arange(size + 1, device)[1:].expand(batch, -1),  # flat node indices 1 .. K
            state.root_feats[:, None].expand(-1, size, -1),  # parent features of the frontier rows
            None if rows is None else rows.mask[:, :, :size],
            BuildPlan(rounds, valid, rows),
        )
        if depth_cap == 0:  # no expansion round
            return [root, first], front, None
        return [root, first], front, self._frontier_rows(ctx, front, 1, size)

    @staticmethod
    def _frontier_rows(ctx, front: Frontier, r: int, size: int) -> DrafterRows:
        """Round ``r``'s drafter rows: the plan's rows of the round with the frontier's embeddings and
        mask (its ancestors' scratch columns and its own)."""
        rows, at = front.plan.rows, slice((r - 1) * size, r * size)
        return DrafterRows(
            ctx.drafter_embeds(front.tokens),
            rows.positions[:, at],
            front.seen,
            rows.slots[:, at],
            rows.predicts[:, at],
            r,  # the frontier's depth
        )

    def _candidates(self, ctx, state: StepState, front: Frontier, logits, r: int, size: int) -> Layer:
        """Round ``r``'s ``K·K`` candidates from the frontier's drafter ``logits`` [R, K, V]: frontier node
        ``j``'s child of rank ``c`` at ``j·K + c``."""
        plan = front.plan
        kid_logq, kid_tok = self._top_children(ctx, logits, size)  # [B, K, K]
        tokens = kid_tok.flatten(1)
        # float64 − float32 subtracts in float64: the float32 log q widened exactly, as ``.double()`` would
        # (the same as adding −log q: negation is exact).
        inf = shared_full(float("inf"), logits.device, torch.float64)
        valid = plan.valid[:, r - 1]
        scores = torch.where(valid, torch.sub(front.score[:, :, None], kid_logq).flatten(1), inf)
        return Layer(tokens, scores, front.node, valid)

    @step_kernel
    def _expand(
        self, ctx, state: StepState, front: Frontier, f_hat, logits, *, r: int, depth_cap: int, size: int
    ):
        """Round ``r``'s candidates (from the frontier's ``f_hat`` [R, K, H] and ``logits`` [R, K, V]), the
        best ``K`` of them as round ``r + 1``'s frontier, and its drafter rows."""
        layer = self._candidates(ctx, state, front, logits, r, size)
        # Valid candidates first by (score, index): invalid ones score +inf (``ranked`` without a mask).
        ranking = layer.scores.sort(dim=-1, stable=True)
        pick = ranking.indices[:, :size]  # next frontier
        src = per_stream(pick // size, f_hat.shape[0] // len(pick))  # its parents' frontier positions
        mask = front.seen.gather(2, src[:, None, :, None].expand(-1, 1, -1, front.seen.shape[-1]))
        own = front.plan.rows.mask[:, :, r * size : (r + 1) * size]  # committed columns and its own
        nxt = Frontier(
            layer.tokens.gather(1, pick),
            ranking.values[:, :size],  # their scores
            1 + size + (r - 1) * size * size + pick,  # flat index of the candidate
            f_hat.gather(1, src[..., None].expand(-1, -1, f_hat.shape[-1])),
            mask | own,
            front.plan,
        )
        return layer, nxt, self._frontier_rows(ctx, nxt, r + 1, size)

    @step_kernel
    def _last_round(
        self, ctx, state: StepState, front: Frontier, logits, grown, *, depth_cap: int, size: int, kept: int
    ):
        """The last round's candidates (from the frontier's ``logits`` [R, K, V]) added to the layers
        ``grown`` so far, then the tree of ``kept`` nodes."""
        grown = [*grown, self._candidates(ctx, state, front, logits, depth_cap, size)]
        columns = (torch.cat(column, 1) for column in zip(*grown, strict=True))
        return self._select(*columns, depth_cap, size, kept)

    def _select(
        self,
        tokens: torch.Tensor,
        scores: torch.Tensor,
        parents: torch.Tensor,
        valid: torch.Tensor,
        depth_cap: int,
        width: int,
        total: int,
    ) -> DraftTree:
        """A tree of ``total`` nodes: the root and the best ``total − 1`` of the candidate nodes
        (``tokens``, ``scores``, ``valid``: [B, N] each, ``parents`` as the layers hold them; a parent
        outranks its children: log q <= 0), laid out by depth then creation order; padding nodes as the
        node-by-node reference builder writes them (tests/reference_builders.py). The envelope bounds the
        tree's depth and widest node on the host (batched acceptance loops that often)."""
        batch, count = tokens.shape
        if self.keep_deepest_path:
            every = shared_arange(count, tokens.device)
            path = self._deepest_path(
                scores, self._parents(parents, every, width), self._depths(every, width), valid, depth_cap
            )
            scores = scores.masked_fill(path, float("-inf"))
        keep = min(total, count) - 1
        # ``ranked`` by −log q, without its mask: a node outside the tree already scores +inf.
        kept = 1 + scores[:, 1:].sort(dim=-1, stable=True).indices[:, :keep]
        order = torch.where(valid.gather(1, kept), kept, kept + count).sort(dim=1).values
        kept, kept_bad = order % count, order >= count
        pad = total - 1 - keep
        nodes = F.pad(kept, (1, pad))  # the root first; padding nodes are node 0
        node_bad = F.pad(kept_bad, (1, 0))  # the root is good; padding nodes are not
        node_bad = F.pad(node_bad, (0, pad), value=True) if pad else node_bad
        new_index = (
            shared_full(0, tokens.device, torch.long)
            .expand_as(tokens)
            .scatter(1, kept, shared_arange(keep + 1, tokens.device)[1:].expand(batch, -1))
        )
        new_parents = new_index.gather(1, self._parents(parents, nodes, width).clamp_min(0))
        new_parents[:, 0] = -1
        return DraftTree(
            tokens.gather(1, nodes).masked_fill(node_bad, 0),
            new_parents.masked_fill(node_bad, 0),
            self._depths(nodes, width).masked_fill(node_bad, 1),
            ~node_bad,
            None,
            False,
            depth_bound=min(depth_cap + 1, total - 1),
            width_bound=min(width, total - 1),
        )

    @staticmethod
    def _parents(parents: torch.Tensor, nodes: torch.Tensor, width: int) -> torch.Tensor:
        """The parent of flat node indices ``nodes`` [..., n] from the layers' joined ``parents`` [B, ·]
        (the root's −1, the root for depth 1, then each round's frontier: one entry per K children)."""
        return parents.gather(
            1, (nodes + (width - 1)).div(width, rounding_mode="floor").expand(len(parents), -1)
        )

    @staticmethod
    def _depths(nodes: torch.Tensor, width: int) -> torch.Tensor:
        """The depth of flat node indices ``nodes`` [..., n] whose first is the root (node 0): nodes
        1 .. K are depth 1, then each round's K·K candidates one deeper (K = ``width``)."""
        depths = (nodes + (2 * width * width - 1 - width)).div(width * width, rounding_mode="floor")
        # the root (elsewhere node 0 is padding, whose depth the caller sets); a fill: the assignment
        # ``depths[..., 0] = 0`` copied a host scalar, which an H100's graph capture refused
        depths.select(-1, 0).fill_(0)
        return depths

    @staticmethod
    def _deepest_path(
        scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor, depth_cap: int
    ) -> torch.Tensor:
        """[B, N] bool: the non-root nodes on the path to the best (first on ties) deepest node, where the
        deepest level is 2 or more (``scores``, ``parents``, ``depths``, ``valid``: [B, N] each)."""
        deepest = torch.where(valid, depths, -1).max(dim=1, keepdim=True).values
        best = torch.where(valid & (depths == deepest), scores, float("inf")).argmin(dim=1, keepdim=True)
        on_path = torch.zeros_like(valid)
        node = best
        for _ in range(depth_cap + 1):  # the deepest node is at most depth_cap + 1 levels down
            on_path = on_path.scatter(1, node, True)
            node = parents.gather(1, node).clamp_min(0)
        on_path[:, 0] = False
        return on_path & (deepest >= 2)
