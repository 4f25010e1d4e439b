"""SJD-PAC (Kang et al., CVPR 2026): SJD with proactive drafting and adaptive continuation, lossless.

A drafter-free tree builder on the engine's unchanged exact walk (``sampled=True``). A window of L
(``tokens_per_forward``, the root included) is a full ``width``-ary tree of ``levels`` levels and a
chain off the all-rank-0 leaf; each depth has one column (a proposal and up to W draws from it
without replacement), so whichever node the walk reaches its children are draws from its stored ``q``.
``observe`` continues every later position along the continuation path (keep a draft with
min(1, p/q), else redraw from its own node's residual), so the next window's drafts are draws from p.
All prompts' windows are device tensors of fixed shape; every draw is a per-prompt ``RowRandom``
uniform. docs/decoding.md, "SJD-PAC", has the layout, the continuation path, and the four places the
authors' release departs from the target distribution (B1–B4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from vdtrain.decode.builders.base import (
    DraftTreeBuilder,
    StepOutcome,
    StepState,
    TreeConfig,
    write_in_place,
)
from vdtrain.decode.coupling import COUPLINGS, gumbel_max, maximal_coupling
from vdtrain.decode.kernels import shared_arange, step_kernel
from vdtrain.decode.rng import Purpose, RowRandom, inverse_cdf
from vdtrain.decode.trees import DraftTree, static_tree

if TYPE_CHECKING:
    from vdtrain.decode.budget import TreeBudget
    from vdtrain.decode.builders.base import DraftContext


FRESH_Q = ("uniform", "point")  # a fresh draft's proposal: uniform over the vocabulary, or its point mass


def tree_nodes(width: int, levels: int) -> int:
    """Nodes of a full ``width``-ary tree with ``levels`` levels, the root included."""
    return levels if width == 1 else (width**levels - 1) // (width - 1)


@dataclass
class _Windows:
    """Every prompt's continued drafts: entry ``k`` of row ``b`` is the rank-0 token (and its proposal)
    for image position ``start[b] + k``, for ``k < count[b]``."""

    start: torch.Tensor  # [B] long: the committed count the window was continued for (−1: none yet)
    count: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, M] long
    q: torch.Tensor  # [B, M, V]

    def restart(self) -> _Windows:
        """The state before any step, in place (a recorded step replays on these tensors)."""
        self.start.fill_(-1)
        for tensor in (self.count, self.tokens, self.q):
            tensor.zero_()
        return self


@dataclass(frozen=True)
class _Layout:
    """The window's shape on one device."""

    parents: torch.Tensor  # [T]
    depths: torch.Tensor  # [T]
    path_ranks: torch.Tensor  # [T, max(D − 1, 1)]: ranks along a node's path at the branching depths
    column_slot: torch.Tensor  # [T]: (depth − 1)·W + rank, where a node's token sits in the [M, W] columns
    q_column: torch.Tensor  # [T]: the column whose q a node stores (its depth; clamped for the deepest)
    onward: torch.Tensor  # [T, M + 1]: the continuation path from each node, its node at every depth


@dataclass
class SjdPacTreeConfig(TreeConfig):
    """SJD-PAC's window (``SjdPacBuilder``): a full ``width``-ary tree of ``levels`` levels, then a chain;
    no drafter. ``tokens_per_forward`` is L (the release's max_num_new_tokens; its CLI's default is 16).
    SJD's window W (``JacobiTreeConfig.window``) counts drafts only; SJD-PAC's W is ``width``."""

    kind: str = "sjd_pac"
    tokens_per_forward: int = 64  # L: tokens per forward, the root included (docs/decoding.md)
    width: int = 3  # W: tokens drafted per tree level (proactive drafting)
    levels: int = 3  # D: tree levels, the root included (the release's tree_depth)
    coupling: str = "maximal"  # continuation: maximal (the release's, SCD's π_MC) | gumbel (SCD's π_GS)
    fresh_q: str = "uniform"  # a fresh draft's q: uniform (the release) | point (its point mass, SCD)


class SjdPacBuilder(DraftTreeBuilder):
    """SJD-PAC's window: a full W-ary tree of D levels plus a chain, L nodes, carried across steps."""

    needs_drafter = False
    graph_safe = True  # the window is made at the first step and then updated in place

    def __init__(self, config: SjdPacTreeConfig) -> None:
        length, width, levels = config.tokens_per_forward, config.width, config.levels
        coupling, fresh_q = config.coupling, config.fresh_q
        if width < 1 or levels < 1:
            raise ValueError(f"SJD-PAC needs width >= 1 and levels >= 1, got width={width}, levels={levels}")
        if coupling not in COUPLINGS[1:]:
            raise ValueError(f"SJD-PAC continues by coupling: maximal or gumbel, got {coupling!r}")
        if fresh_q not in FRESH_Q:
            raise ValueError(f"unknown fresh_q {fresh_q!r}; known: {list(FRESH_Q)}")
        self.coupling, self.fresh_q = coupling, fresh_q
        nodes = tree_nodes(width, levels)
        if length < max(nodes, 2):
            raise ValueError(
                f"SJD-PAC tokens_per_forward={length} cannot hold its tree: a {width}-ary tree of {levels} "
                f"levels has {nodes} nodes (root included) and the window needs at least one draft"
            )
        self.tokens_per_forward, self.width, self.levels = length, width, levels
        self.main_depth = levels - 1 + length - nodes
        level: list[tuple[int, ...]] = [()]
        paths = [(0,) * d for d in range(levels, self.main_depth + 1)]  # the chain
        for _ in range(levels - 1):
            level = [(*p, r) for p in level for r in range(width)]
            paths += level
        self.shape = static_tree(paths)
        self.first_child = [-1] * self.shape.size
        for i in range(self.shape.size - 1, 0, -1):  # the lowest index among a node's children is its rank 0
            self.first_child[self.shape.parents[i]] = i
        self.main = [0] * (self.main_depth + 1)  # main[d]: the all-rank-0 node at depth d
        for d in range(1, self.main_depth + 1):
            self.main[d] = self.first_child[self.main[d - 1]]
        self._layouts: dict[torch.device, _Layout] = {}
        self._windows: _Windows | None = None
        self.reset(0)

    def max_nodes(self, budget: TreeBudget) -> int:
        return self.tokens_per_forward  # its proactive tree keeps its shape whatever the budget

    def reset(self, batch: int) -> None:
        win = self._windows
        self._windows = win.restart() if win is not None and win.tokens.shape[0] == batch else None

    def layout(self, device: torch.device) -> _Layout:
        """The host-side tree layout on ``device``, made once."""
        if device not in self._layouts:
            shape, branching = self.shape, max(self.levels - 1, 1)
            full_paths = ((), *shape.paths)
            path_ranks = [(*p, *(0,) * branching)[:branching] for p in full_paths]
            slots = [0] + [
                (d - 1) * self.width + r for d, r in zip(shape.depths[1:], shape.ranks[1:], strict=True)
            ]
            # From node i: its ancestors up to its depth, then rank-0 children, then the main path's node
            # once there are none (a leaf off the main path, or past the full tree).
            onward = []
            for i in range(shape.size):
                row = []
                for j in range(self.main_depth + 1):
                    node = i
                    while shape.depths[node] > j:
                        node = shape.parents[node]
                    while shape.depths[node] < j:
                        child = self.first_child[node]
                        node = child if child >= 0 else self.main[j]
                    row.append(node)
                onward.append(row)
            tables = (
                shape.parents,
                shape.depths,
                path_ranks,
                slots,
                [min(d, self.main_depth - 1) for d in shape.depths],
                onward,
            )
            self._layouts[device] = _Layout(
                *(torch.tensor(t, dtype=torch.long, device=device) for t in tables)
            )
        return self._layouts[device]

    def _windows_for(self, batch: int, vocab: int, device: torch.device) -> _Windows:
        win = self._windows
        if win is None or win.tokens.shape[0] != batch or win.tokens.device != device:
            long = {"dtype": torch.long, "device": device}
            win = self._windows = _Windows(
                torch.empty(batch, **long),
                torch.empty(batch, **long),
                torch.empty(batch, self.main_depth, **long),
                torch.empty(batch, self.main_depth, vocab, device=device),
            ).restart()
        return win

    # --- drafting ------------------------------------------------------------------------------------
    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        if state.rng is None:
            raise ValueError("SjdPacBuilder draws from the run's RowRandom: StepState.rng is None")
        batch, device = len(state.roots), state.roots.device
        win = self._windows_for(batch, ctx.target.vocab_size, device)
        return self._draft(ctx, state, self.layout(device), win)

    @step_kernel
    def _draft(self, ctx: DraftContext, state: StepState, lay: _Layout, win: _Windows) -> DraftTree:
        """The tree: the continued main path, fresh columns after it, proactive siblings at the branching
        depths."""
        batch, device = len(state.roots), state.roots.device
        vocab, width, deep = ctx.target.vocab_size, self.width, self.main_depth
        n = state.depth_limit.clamp(0, deep)  # never draft past the last image token
        keep = torch.where(win.start == state.committed, torch.minimum(win.count, n), 0)
        continued = shared_arange(deep, device)[None] < keep[:, None]  # [B, M]
        u = state.rng.uniform(Purpose.DRAFT, deep, width)  # [B, M, W]: (column, rank)
        fresh = (u[..., 0] * vocab).long().clamp_max(vocab - 1)
        rank0 = torch.where(continued, win.tokens, fresh)
        fresh_q = (
            1.0 / vocab
            if self.fresh_q == "uniform"
            else torch.zeros_like(win.q).scatter_(2, fresh[..., None], 1.0)
        )
        cols_q = torch.where(continued[..., None], win.q, fresh_q)  # [B, M, V]
        counts = torch.ones(batch, max(self.levels - 1, 1), dtype=torch.long, device=device)
        siblings = rank0.new_zeros(batch, deep, width - 1)
        for d in range(min(self.levels - 1, deep) if width > 1 else 0):  # the branching depths
            left = cols_q[:, d].double().scatter(1, rank0[:, d, None], 0.0)
            for r in range(1, width):  # without replacement: the mass not drawn yet
                has = (left > 0).any(-1)  # past q's support: this rank and its subtree stay undrafted
                token = inverse_cdf(left, u[:, d, r])
                siblings[:, d, r - 1] = token
                counts[:, d] += has
                left = left.scatter(1, token[:, None], 0.0)
        cols = torch.cat([rank0[..., None], siblings], -1).view(batch, deep * width)
        tokens = torch.cat([state.roots[:, None], cols.index_select(1, lay.column_slot[1:])], 1)
        depths = lay.depths[None]
        valid = (depths <= n[:, None]) & (lay.path_ranks[None] < counts[:, None, :]).all(-1)
        holders = depths < n[:, None]  # nodes with children store their children's column q
        q = cols_q.index_select(1, lay.q_column)
        q = torch.where(holders[..., None], q, 0.0)
        depth_bound = max(1, min(deep, ctx.target.num_image_tokens - 2))
        return DraftTree(
            tokens,
            lay.parents.expand(batch, -1),
            depths.expand(batch, -1),
            valid,
            q,
            True,
            depth_bound=depth_bound,
            width_bound=width,
        )

    # --- after verification --------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        if self._windows is None:
            raise RuntimeError("SjdPacBuilder.observe before build: no window to continue")
        o, lay = outcome, self.layout(outcome.p_nodes.device)
        new = self._continue_window(
            o.tree, o.verdict, o.verified, o.p_nodes, o.roots_at, lay,
            win=self._windows, rng=o.rng, greedy=o.greedy,
        )  # fmt: skip
        write_in_place(self._windows, new)

    @step_kernel
    def _continue_window(
        self, tree, verdict, verified, p_nodes, roots_at, lay: _Layout, *, win: _Windows, rng, greedy
    ):
        """The next window: the continuation of the accepted path, kept or redrawn (SJD-PAC's adaptive
        continuation), from ``p_nodes`` [B, T, V] where ``verified`` [B] (``roots_at`` [B]: each root's
        image index; ``rng``, ``greedy``: the step's, ``StepOutcome``)."""
        win, deep = replace(win), self.main_depth  # a new state: no input's attributes change
        vocab = p_nodes.shape[-1]
        accepted = verdict.accepted
        last = torch.zeros_like(accepted)  # the last accepted node (the root if none)
        if verdict.path.shape[1]:
            at = (accepted - 1).clamp(0, verdict.path.shape[1] - 1)[:, None]
            last = torch.where(accepted > 0, verdict.path.gather(1, at).squeeze(1), last)
        onward = lay.onward.index_select(0, last)  # [B, M + 1]: the continuation path by depth
        # Entry k of the next window is depth j = a + 2 + k: its draft sits at c_j, its p and q at c_{j−1}.
        k = shared_arange(deep, p_nodes.device)[None]
        holder = onward.gather(1, (accepted[:, None] + 1 + k).clamp_max(deep))
        node = onward.gather(1, (accepted[:, None] + 2 + k).clamp_max(deep))
        spread = holder[..., None].expand(-1, -1, vocab)
        p = p_nodes.gather(1, spread)  # [B, M, V]
        count = (tree.max_depth() - accepted).clamp_min(0)  # depths a + 2 .. n, and n + 1 (undrafted)
        if greedy:
            out = p.argmax(-1)
        else:
            undrafted = k >= count[:, None] - 1
            positions = (roots_at + accepted + 2)[:, None] + k if self.coupling == "gumbel" else None
            out = self._continue(
                tree.tokens.gather(1, node), p, tree.q.gather(1, spread), undrafted, positions, rng
            )
        win.start = torch.where(verified, roots_at + accepted + 2, win.start)
        win.count = torch.where(verified, count, win.count)
        win.tokens = torch.where(verified[:, None], out, win.tokens)
        win.q = torch.where(verified[:, None, None], p.to(win.q.dtype), win.q)
        return win

    def _continue(self, drafts, p, q, undrafted, positions, rng: RowRandom) -> torch.Tensor:
        """Each later position's next draft, a draw from its ``p`` [B, M, V]: the draft coupled with it
        (maximal: kept with min(1, p(x)/q(x)), else from norm(max(0, p − q)); gumbel: argmax(log p + G)
        with G fixed per image position, ``positions`` [B, M]; ``drafts`` [B, M] the drafts, ``q``
        [B, M, V] what they were drawn from). ``undrafted`` [B, M] entries (past the deepest draft) are
        drawn from p."""
        if self.coupling == "gumbel":
            return gumbel_max(p, rng.keyed(Purpose.GUMBEL, positions, p.shape[-1]))
        u = rng.uniform(Purpose.CONTINUE, drafts.shape[1], 2)  # [B, M, 2]: keep test, redraw
        return maximal_coupling(drafts, p, torch.where(undrafted[..., None], 0.0, q), u[..., 0], u[..., 1])
