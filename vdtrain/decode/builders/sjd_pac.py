"""SJD-PAC (Kang et al., CVPR 2026): SJD with proactive drafting and adaptive continuation, lossless.

A drafter-free tree builder; verification is the engine's exact walk (``acceptance.walk`` with
``sampled=True``), so the only work here is drafting, and drafting is exact when every child is a draw from
the ``q`` stored at its parent, siblings drawn without replacement (the walk's SpecInfer semantics).

**The window** (``window`` = L tokens per forward, the root included; the release's
``max_num_new_tokens``): a full ``width``-ary tree of ``levels`` levels, the root included (W, D), followed
by a chain hanging off the all-rank-0 leaf, L nodes in all. The main path (ranks 0 all the way) is
``(D − 1) + L − (W^D − 1)/(W − 1)`` drafts deep (53 for L 64, W 3, D 3; 5 for L 16). Every depth ``d`` has
one *column*: a proposal ``q_d`` and up to W tokens drawn from it without replacement; every node at depth
``d`` carries the column's token of its rank, and every node at depth ``d − 1`` stores ``q_d`` as the
distribution its children were drawn from. The draws do not depend on the parent, so whichever node the
walk reaches at depth ``d − 1``, its children are W draws without replacement from its stored ``q``.

**Proactive drafting.** The rank-0 token of a column is the continued (or fresh) draft; ranks 1 .. W − 1
are further draws from ``q_d`` without the earlier ranks. Where ``q_d`` has fewer tokens than W the missing
ranks (and their subtrees) stay undrafted (``valid`` False): a draw outside q's support would be judged
with q = 0.

**Adaptive continuation** (``observe``). The walk commits a accepted nodes and a bonus at depth a + 1 (from
p at the last accepted node when nothing was rejected there: all-accepted paths included). Every later
depth ``j`` keeps a draft: along the *continuation path* — from the last accepted node, its rank-0 child at
each depth, or the main path's node where that path has no children (a leaf off the main path) — the
node ``c_j`` holds the rank-0 token x of column j, the node before it on the path, ``c_{j−1}``, the
target p just computed for depth j and ``q_j``. x is kept with probability ``min(1, p(x)/q_j(x))``, else
replaced by a draw from ``norm(max(0, p − q_j))`` (its own node's residual): the result is a draw from p,
so it becomes the next window's draft with ``q = p``. The position after the deepest draft has a p but no
draft: a draw from p. p was conditioned on stale drafts; exactness does not need fresh context, only that
each draft is a draw from the q it is judged with (as in SJD's refinement,
``vdtrain.decode.builders.jacobi``).

**Fresh positions** (past what the last forward computed): uniform over the image tokens, ``q`` uniform
(the release's padding), so a fresh draft x is accepted with ``min(1, V·p(x))``.

At T = 0 p is one-hot: continuation takes its argmax (vanilla Jacobi), a continued column has no siblings,
a fresh one W distinct uniform tokens. Per-prompt windows live across steps; every draw uses the prompt's
own generator (``state.generators``).

The release departs from this in four places, each biased (docs/decoding.md): it commits the leaf path
with the longest accepted prefix (B1), draws the bonus uniformly when the whole main path is accepted
(B2), judges siblings drawn from a residual as if drawn from p (B3), and continues every later position
from the all-siblings residual (B4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, row_verdicts
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.trees import DraftTree, static_tree


def tree_nodes(width: int, levels: int) -> int:
    """Nodes of a full ``width``-ary tree with ``levels`` levels, the root included."""
    return levels if width == 1 else (width**levels - 1) // (width - 1)


@dataclass
class _Window:
    """One prompt's continued drafts: rank-0 tokens and their proposals for image positions ``start ..``."""

    start: int
    tokens: torch.Tensor  # [n] long
    q: torch.Tensor  # [n, V]


class SjdPacBuilder(DraftTreeBuilder):
    """SJD-PAC's window: a full W-ary tree of D levels plus a chain, L nodes, carried across steps."""

    needs_drafter = False

    def __init__(self, window: int = 64, width: int = 3, levels: int = 3) -> None:
        if width < 1 or levels < 1:
            raise ValueError(f"SJD-PAC needs width >= 1 and levels >= 1, got width={width}, levels={levels}")
        nodes = tree_nodes(width, levels)
        if window < max(nodes, 2):
            raise ValueError(
                f"SJD-PAC window={window} cannot hold its tree: a {width}-ary tree of {levels} levels has "
                f"{nodes} nodes (root included) and the window needs at least one draft"
            )
        self.window, self.width, self.levels = window, width, levels
        self.main_depth = levels - 1 + window - nodes
        level: list[tuple[int, ...]] = [()]
        paths = [(0,) * d for d in range(levels, self.main_depth + 1)]  # the chain
        for _ in range(levels - 1):
            level = [(*p, r) for p in level for r in range(width)]
            paths += level
        shape = static_tree(paths)
        self.parents = torch.tensor(shape.parents)
        self.depths = torch.tensor(shape.depths)
        self.ranks = torch.tensor(shape.ranks)
        # Ranks along each node's path at the branching depths 1 .. D − 1 (0 where the path is shorter).
        branching = max(levels - 1, 1)
        self.path_ranks = torch.tensor([(*p, *(0,) * branching)[:branching] for p in ((), *shape.paths)])
        self.first_child = [-1] * shape.size
        for i in range(shape.size - 1, 0, -1):  # the lowest index among a node's children is its rank 0
            self.first_child[shape.parents[i]] = i
        self.main = [0] * (self.main_depth + 1)  # main[d]: the all-rank-0 node at depth d
        for d in range(1, self.main_depth + 1):
            self.main[d] = self.first_child[self.main[d - 1]]
        self.reset(0)

    def max_nodes(self) -> int:
        return self.window

    def reset(self, batch: int) -> None:
        self._windows: list[_Window | None] = [None] * batch
        self._generators: Sequence[torch.Generator | None] = [None] * batch
        self._greedy = False

    # --- drafting ------------------------------------------------------------------------------------
    def build(self, engine: SpeculativeEngine, state: StepState) -> DraftTree:
        batch, device = len(state.roots), state.roots.device
        vocab, size = engine.target.vocab_size, self.window
        if len(self._windows) != batch:
            self.reset(batch)
        self._generators, self._greedy = state.generators, engine.sampling.greedy
        depths, ranks = self.depths.to(device), self.ranks.to(device)
        path_ranks = self.path_ranks.to(device)
        tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
        tokens[:, 0] = state.roots
        q = torch.zeros(batch, size, vocab, device=device)
        valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
        deepest = 0
        for b in range(batch):
            m, limit = int(state.committed[b]), int(state.depth_limit[b])
            n = max(0, min(self.main_depth, limit))  # never draft past the last image token
            deepest = max(deepest, n)
            window = self._windows[b]
            if window is None or window.start != m:  # a new prompt (or state from another run)
                window = _Window(m, tokens.new_zeros(0), q.new_zeros(0, vocab))
            keep = min(n, len(window.tokens))
            gen = state.generators[b]
            fresh = torch.randint(vocab, (n - keep,), generator=gen, device=device)
            cols_q = torch.cat([window.q[:keep], q.new_full((n - keep, vocab), 1.0 / vocab)])
            cols = tokens.new_zeros(n, self.width)
            cols[:, 0] = torch.cat([window.tokens[:keep], fresh])
            counts = tokens.new_ones(max(self.levels - 1, 1))
            for d in range(1, min(self.levels - 1, n) + 1):  # siblings at the branching depths
                rest = cols_q[d - 1].clone()
                rest[cols[d - 1, 0]] = 0
                k = min(self.width - 1, int((rest > 0).sum()))
                if k:
                    cols[d - 1, 1 : 1 + k] = torch.multinomial(rest, k, replacement=False, generator=gen)
                counts[d - 1] = 1 + k
            if n == 0:
                valid[b, 0] = True
                continue
            inside = depths <= n
            valid[b] = inside & (path_ranks < counts[None, :]).all(-1)
            drafts = torch.arange(1, size, device=device)[inside[1:]]
            tokens[b, drafts] = cols[depths[drafts] - 1, ranks[drafts]]
            holders = torch.arange(size, device=device)[depths < n]  # nodes with children: their column's q
            q[b, holders] = cols_q[depths[holders]]
        parents = self.parents.to(device).expand(batch, -1).clone()
        depths = depths.expand(batch, -1).clone()
        return DraftTree(tokens, parents, depths, valid, q, True, depth_bound=deepest, width_bound=self.width)

    # --- after verification --------------------------------------------------------------------------
    def observe(
        self,
        tree: DraftTree,
        verdict: BatchVerdict,
        verified: torch.Tensor,
        p_nodes: torch.Tensor,
        roots_at: torch.Tensor,
    ) -> None:
        verdicts = row_verdicts(verdict, verified)
        lengths = tree.max_depth()
        for b, verdict in enumerate(verdicts):
            if verdict is None:
                continue
            m, n, a = int(roots_at[b]) + 1, int(lengths[b]), len(verdict.path)
            # The continuation path c_a (last accepted node) .. c_n, one node per depth.
            chain = [verdict.path[-1] if a else 0]
            for d in range(a + 1, n + 1):
                child = self.first_child[chain[-1]]
                chain.append(child if child >= 0 and bool(tree.valid[b, child]) else self.main[d])
            ids = torch.tensor(chain, dtype=torch.long, device=p_nodes.device)
            parents, nodes = ids[1:], ids[2:]  # p for depths a+2 .. n+1; the drafts of depths a+2 .. n
            rows, held, gen = p_nodes[b, parents].clone(), parents[: len(nodes)], self._generators[b]
            continued = self._continue(tree.tokens[b, nodes], rows[: len(nodes)], tree.q[b, held], gen)
            if a < n:  # the position after the deepest draft: no draft, a draw from p
                last = rows[-1:].argmax(-1) if self._greedy else self._draw(rows[-1:], gen)
                continued = torch.cat([continued, last])
            self._windows[b] = _Window(m + a + 1, continued, rows)

    def _continue(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        """Each draft kept with min(1, p(x)/q(x)), else redrawn from norm(max(0, p − q)): a draw from p."""
        if not len(drafts):
            return drafts
        if self._greedy:
            return p.argmax(-1)
        p, q = p.double(), q.double()
        px = p.gather(1, drafts[:, None]).squeeze(1)
        qx = q.gather(1, drafts[:, None]).squeeze(1)
        device = generator.device if generator is not None else p.device
        u = torch.rand(len(drafts), generator=generator, device=device, dtype=torch.float64).to(p.device)
        rejected = (u * qx >= px).nonzero().flatten()
        out = drafts.clone()
        if len(rejected):
            residual = (p[rejected] - q[rejected]).clamp_min(0)
            empty = residual.sum(-1) <= 0  # p = q up to rounding: nothing to reject into, draw from p
            residual[empty] = p[rejected][empty]
            out[rejected] = self._draw(residual, generator)
        return out

    @staticmethod
    def _draw(rows: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.multinomial(rows, 1, generator=generator).squeeze(1)
