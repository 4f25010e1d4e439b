"""EAGLE-2's dynamic draft tree as tensor ops: no device→host reads, an op count independent of the batch.

From the root take the ``top_k`` most likely children; then for ``depth`` rounds expand the frontier
(the ``top_k`` newest nodes with the highest cumulative log q) into ``top_k`` children each, one batched
drafter forward per round; keep the ``total_tokens - 1`` best nodes, parents before children. Drafts
are deterministic (q is a point mass on each child). It builds the node-by-node reference builder's
trees (``tests/reference_builders.py``) in fixed padded shapes: a host-side *envelope* (``R`` rounds,
``K`` wide; PEANUT overrides ``envelope``), a ``K``-wide frontier and ``K·K`` candidates per round, so a
step's host work does not grow with the batch or the tree. Ties are fixed (``topk`` leaves them open);
docs/decoding.md, "Drafting", gives the keys.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, TreeConfig
from vdtrain.decode.kernels import step_kernel
from vdtrain.decode.rows import image_columns
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from vdtrain.decode.builders.base import DraftContext
    from vdtrain.decode.rows import ImageColumns


def topk_low_index_first(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest float32 ``values`` [..., N] along the last dim, equal values in ascending index
    order → (values, indices), [..., k] each.

    One ``topk`` over an int64 key: the float's order-preserving int32 image in the high half, the
    reversed index in the low half (so the key is unique and ties resolve the same on every device).
    """
    n = values.shape[-1]
    bits = (values.float() + 0.0).view(torch.int32).long()  # + 0.0 folds −0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = ordered * 2**32 + (n - 1 - torch.arange(n, device=values.device))
    index = key.topk(k, dim=-1).indices
    return values.gather(-1, index), index


def ranked(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` best entries of ``scores`` [..., N] along the last dim: the ``valid``
    [..., N] ones first, by (−score, index)."""
    key = torch.where(valid, scores, float("-inf"))
    return key.sort(dim=-1, descending=True, stable=True).indices[..., :k]


class Layer(NamedTuple):
    """Nodes made in one round, in creation order."""

    tokens: torch.Tensor  # [B, n]
    scores: torch.Tensor  # [B, n] cumulative log q, float64
    parents: torch.Tensor  # [B, n] flat node index of the parent
    depths: torch.Tensor  # [B, n]
    valid: torch.Tensor  # [B, n]


class BuildPlan(NamedTuple):
    """What a build fixes for all its rounds: each row's shape and the drafter scratch layout."""

    rounds: torch.Tensor  # [B] expansion rounds of each row's tree
    kid_ok: torch.Tensor  # [B, K·K] candidates inside the row's width
    own: torch.Tensor  # [rounds, K, rounds·K] bool: the scratch column of round r's frontier node j
    slots: torch.Tensor  # [B, rounds·K] drafter cache slot of each scratch column
    columns: ImageColumns  # committed columns, and where the scratch columns go


@dataclass
class Frontier:
    """The nodes a round expands, with what their drafter rows need."""

    tokens: torch.Tensor  # [B, K]
    score: torch.Tensor  # [B, K]
    node: torch.Tensor  # [B, K] flat node index
    feats: torch.Tensor  # [R, K, H] the parents' drafter features
    seen: torch.Tensor  # [B, K, rounds·K] scratch columns each row sees
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
    (``check_vocabulary``): the envelope grows as ``top_k · (depth + 1)`` scratch slots and ``top_k²``
    candidates per round, so an uncapped setting (600 on 512 tokens) made every step crawl while its trees
    were the capped ones. ``keep_deepest_path`` (PEANUT): the best-scoring
    path to the deepest level drafted is kept whatever the node budget prunes.
    """

    keep_deepest_path: ClassVar[bool] = False
    graph_safe: ClassVar[bool] = True

    def __init__(self, config: DynamicTreeConfig) -> None:
        top_k, depth, total_tokens = config.top_k, config.depth, config.total_tokens
        if top_k < 1 or depth < 0 or total_tokens < 2:
            raise ValueError(
                f"dynamic tree needs top_k >= 1, depth >= 0 and total_tokens >= 2 "
                f"(got top_k={top_k}, depth={depth}, total_tokens={total_tokens})"
            )
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.configured_total = total_tokens

    def limit_nodes(self, nodes: int | None) -> None:
        """Keep the best ``nodes`` (the drafted rounds stay; fewer nodes are selected and verified)."""
        self.total_tokens = self.configured_total if nodes is None else min(self.configured_total, nodes)

    def check_vocabulary(self, vocab_size: int) -> None:
        if self.top_k > vocab_size:
            warnings.warn(
                f"tree.top_k={self.top_k} exceeds the target's vocabulary ({vocab_size} image tokens): a "
                f"node cannot have more distinct children than there are tokens, so top_k is {vocab_size}",
                stacklevel=3,
            )
            self.top_k = vocab_size

    def max_nodes(self) -> int:
        return max(self.total_tokens, 1 + self.top_k * (self.depth + 1))

    def shape(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(expansion rounds [B], top_k [B]) for this step's trees, on the state's device."""
        batch, device = len(state.roots), state.roots.device
        return (
            torch.full((batch,), self.depth, dtype=torch.long, device=device),
            torch.full((batch,), self.top_k, dtype=torch.long, device=device),
        )

    def envelope(self, state: StepState) -> tuple[int, int]:
        """Host bound (rounds, top_k) on this step's ``shape``: the padded shapes. Called after ``shape``."""
        return self.depth, self.top_k

    @staticmethod
    def _logq(ctx: DraftContext, logits: torch.Tensor) -> torch.Tensor:
        """Drafter ``logits`` [R, ..., V] → log q [B, ..., V] (q floored at 1e-30: ranks stay defined)."""
        return ctx.draft_probs(logits).clamp_min(1e-30).log()

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        vocab, device = state.root_logits.shape[-1], state.roots.device
        rounds, widths = self.shape(state)
        rounds, widths = rounds.to(device), widths.to(device).clamp_max(vocab)
        depth_cap, k_cap = self.envelope(state)
        size = min(k_cap, vocab)  # K: frontier width and children per frontier node
        if depth_cap * size > self.max_nodes():
            raise ValueError(
                f"{type(self).__name__}: an envelope of {depth_cap} rounds x {size} nodes needs "
                f"{depth_cap * size} drafter scratch slots but max_nodes() reserves {self.max_nodes()}"
            )
        torch._assert_async(
            ((rounds <= depth_cap) & (widths <= size)).all(),
            f"{type(self).__name__}.shape gave a (rounds, top_k) outside envelope ({depth_cap}, {size})",
        )
        grown, front, rows = self._root_children(ctx, state, rounds, widths, depth_cap, size)
        for r in range(1, depth_cap + 1):
            f_hat, logits = ctx.drafter_forward(front.feats, rows)
            if r < depth_cap:
                layer, front, rows = self._expand(ctx, state, front, f_hat, logits, r, depth_cap, size)
                grown = [*grown, layer]
            else:
                return self._last_round(ctx, state, front, logits, grown, depth_cap, size)
        return self._select(*(torch.cat(column, 1) for column in zip(*grown, strict=True)), depth_cap, size)

    @step_kernel
    def _root_children(self, ctx, state: StepState, rounds, widths, depth_cap: int, size: int):
        """Depth 1 (the root's children, round 1's frontier in rank order) and round 1's drafter rows, for
        ``rounds`` [B] expansion rounds and ``widths`` [B] top-k per prompt (``shape``). Returns ([the
        root's layer, depth 1's], the ``Frontier``, the drafter rows: None without rounds)."""
        roots, limit = state.roots, state.depth_limit
        batch, device = len(roots), roots.device
        col = torch.arange(size, device=device)
        kid_ok = (col[None, :, None] < widths[:, None, None]) & (col[None, None, :] < widths[:, None, None])
        front_logq, front_tok = topk_low_index_first(self._logq(ctx, state.root_logits), size)
        front_score = front_logq.double()
        root = Layer(
            roots[:, None],
            front_score.new_zeros(batch, 1),
            torch.full_like(roots[:, None], -1),
            torch.zeros_like(roots[:, None]),
            torch.ones_like(roots[:, None], dtype=torch.bool),
        )
        first = Layer(
            front_tok,
            front_score,
            torch.zeros_like(front_tok),
            torch.ones_like(front_tok),
            (limit >= 1)[:, None] & (col < widths[:, None]),
        )
        # Drafter scratch column of frontier node j in round r: (r−1)·K + j, after any committed column.
        n_img, base = ctx.target.num_image_tokens, state.committed - 1
        cols = torch.arange(depth_cap * size, device=device)
        plan = BuildPlan(
            rounds,
            kid_ok.flatten(1),
            torch.eye(depth_cap * size, dtype=torch.bool, device=device).view(
                depth_cap, size, depth_cap * size
            ),
            ctx.target.image_slot(base[:, None] + cols),
            image_columns(base, base, depth_cap * size, n_img - 1 + depth_cap * size),
        )
        front = Frontier(
            front_tok,
            front_score,
            (1 + col).expand(batch, -1),
            state.root_feats[:, None].expand(-1, size, -1),  # parent features of the frontier rows
            torch.zeros(batch, size, depth_cap * size, dtype=torch.bool, device=device),
            plan,
        )
        if depth_cap == 0:  # no expansion round
            return [root, first], front, None
        front, rows = self._frontier_rows(ctx, state, front, 1, depth_cap, size)
        return [root, first], front, rows

    def _frontier_rows(self, ctx, state: StepState, front: Frontier, r: int, depth_cap: int, size: int):
        """Round ``r``'s drafter rows: frontier node ``j`` at its scratch column, seeing its ancestors'
        scratch columns and its own."""
        plan = front.plan
        seen = front.seen | plan.own[r - 1]
        slots = plan.slots[:, (r - 1) * size : r * size]
        index = (state.committed - 1 + r).clamp_max(ctx.target.num_image_tokens)[:, None].expand(-1, size)
        vis = plan.columns.rows(seen)
        return replace(front, seen=seen), ctx.drafter_inputs(front.tokens, index, slots, vis)

    def _candidates(self, ctx, state: StepState, front: Frontier, logits, r: int, size: int) -> Layer:
        """Round ``r``'s ``K·K`` candidates from the frontier's drafter ``logits`` [R, K, V]: frontier node
        ``j``'s child of rank ``c`` at ``j·K + c``."""
        kid_logq, kid_tok = topk_low_index_first(self._logq(ctx, logits), size)  # [B, K, K]
        grow = (front.plan.rounds >= r) & (state.depth_limit >= r + 1)
        tokens = kid_tok.flatten(1)
        return Layer(
            tokens,
            (front.score[:, :, None] + kid_logq.double()).flatten(1),
            front.node[:, :, None].expand(-1, -1, size).flatten(1),
            torch.full_like(tokens, r + 1),
            grow[:, None] & front.plan.kid_ok,
        )

    @step_kernel
    def _expand(
        self, ctx, state: StepState, front: Frontier, f_hat, logits, r: int, depth_cap: int, size: int
    ):
        """Round ``r``'s candidates (from the frontier's ``f_hat`` [R, K, H] and ``logits`` [R, K, V]), the
        best ``K`` of them as round ``r + 1``'s frontier, and its drafter rows."""
        layer = self._candidates(ctx, state, front, logits, r, size)
        pick = ranked(layer.scores, layer.valid, size)  # next frontier [B, K]
        src = pick // size  # its parents' frontier positions
        streams = f_hat.shape[0] // len(pick)
        nxt = Frontier(
            layer.tokens.gather(1, pick),
            layer.scores.gather(1, pick),
            1 + size + (r - 1) * size * size + pick,  # flat index of the candidate
            f_hat.gather(1, src.repeat(streams, 1)[..., None].expand(-1, -1, f_hat.shape[-1])),
            front.seen.gather(1, src[..., None].expand(-1, -1, front.seen.shape[-1])),
            front.plan,
        )
        nxt, rows = self._frontier_rows(ctx, state, nxt, r + 1, depth_cap, size)
        return layer, nxt, rows

    @step_kernel
    def _last_round(self, ctx, state: StepState, front: Frontier, logits, grown, depth_cap: int, size: int):
        """The last round's candidates (from the frontier's ``logits`` [R, K, V]) added to the layers
        ``grown`` so far, then the tree."""
        grown = [*grown, self._candidates(ctx, state, front, logits, depth_cap, size)]
        return self._select(*(torch.cat(column, 1) for column in zip(*grown, strict=True)), depth_cap, size)

    def _select(
        self,
        tokens: torch.Tensor,
        scores: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        valid: torch.Tensor,
        depth_cap: int,
        width: int,
    ) -> DraftTree:
        """Keep the best ``total_tokens − 1`` of the candidate nodes (``tokens``, ``scores``, ``parents``,
        ``depths``, ``valid``: [B, N] each; a parent outranks its children: log q <= 0), laid out by depth
        then creation order; padding nodes as the old builder writes them. The envelope
        bounds the tree's depth and widest node on the host (batched acceptance loops that often)."""
        batch, count = tokens.shape
        if self.keep_deepest_path:
            scores = torch.where(
                self._deepest_path(scores, parents, depths, valid, depth_cap), float("inf"), scores
            )
        keep = min(self.total_tokens, count) - 1
        kept = 1 + ranked(scores[:, 1:], valid[:, 1:], keep)
        order = torch.where(valid.gather(1, kept), kept, kept + count).sort(dim=1).values
        kept, kept_valid = order % count, order < count
        pad = self.total_tokens - 1 - keep
        nodes = torch.cat([torch.zeros_like(kept[:, :1]), kept, kept.new_zeros(batch, pad)], 1)
        node_ok = torch.cat(
            [torch.ones_like(kept_valid[:, :1]), kept_valid, kept_valid.new_zeros(batch, pad)], 1
        )
        new_index = torch.zeros_like(tokens).scatter_(
            1, kept, torch.arange(1, keep + 1, device=tokens.device).expand(batch, -1)
        )
        new_parents = new_index.gather(1, parents.gather(1, nodes).clamp_min(0))
        new_parents[:, 0] = -1
        return DraftTree(
            torch.where(node_ok, tokens.gather(1, nodes), 0),
            torch.where(node_ok, new_parents, 0),
            torch.where(node_ok, depths.gather(1, nodes), 1),
            node_ok,
            None,
            False,
            depth_bound=min(depth_cap + 1, self.total_tokens - 1),
            width_bound=min(width, self.total_tokens - 1),
        )

    @staticmethod
    def _deepest_path(
        scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor, depth_cap: int
    ) -> torch.Tensor:
        """[B, N] bool: the non-root nodes on the path to the best (first on ties) deepest node, where the
        deepest level is 2 or more (``scores``, ``parents``, ``depths``, ``valid``: [B, N] each)."""
        deepest = torch.where(valid, depths, -1).max(dim=1, keepdim=True).values
        best = torch.where(valid & (depths == deepest), scores, float("-inf")).argmax(dim=1, keepdim=True)
        on_path = torch.zeros_like(valid)
        node = best
        for _ in range(depth_cap + 1):  # the deepest node is at most depth_cap + 1 levels down
            on_path = on_path.scatter(1, node, True)
            node = parents.gather(1, node).clamp_min(0)
        on_path[:, 0] = False
        return on_path & (deepest >= 2)
