"""PEANUT: adjacency-adaptive dynamic draft trees (ALGORITHMS.md §5; lossless with exact acceptance).

EAGLE-2 dynamic trees (``DynamicTreeBuilder``) whose depth d̂ and width (top-k) k̂ change per tree and
per prompt. Each tree's (d̂, k̂) is chosen in two phases:

1. **Initialisation** from a per-prompt grid over the image (h × w, raster order) holding the (d, k)
   of the tree each position belongs to. The tree rooted at position (i, j) starts from
   (d̃, k̃) = the grid at
   - ``horizontal`` (= ``horizontal_repeat``, default): (i, j−1); in the first column (i−1, j), the
     position above;
   - ``vertical`` (= ``vertical_repeat``): (i−1, j); in the first row (i, j−1), the position to the left;
   - ``random``: d̃ ~ U{d_min+1 .. d_max−1}, k̃ ~ U{k_min+1 .. k_max−1}, drawn from the prompt's own
     generator (the one verification uses; a builder-owned one seeded with ``seed + b`` when the engine
     passes none), so the draws follow the prompt whatever the batching.
   The first tree of a prompt (rooted at position 0, no neighbour) starts from (d_init, k_init).
2. **Bisectional adaptation** from α = the previous tree's accepted draft tokens (bonus excluded) /
   that tree's depth: positive (α ≥ β; with β = 1 every level was used) → d̂ = d̃ + l_d, k̂ = k̃ − l_k
   (deeper, narrower); negative → d̂ = d̃ − l_d, k̂ = k̃ + l_k (shallower, wider). The first tree is
   not adapted (there is no previous tree).

Bounds are open, as written in the paper: d_min < d̂ < d_max and k_min < k̂ < k_max, i.e. the integers
d_min+1 .. d_max−1 and k_min+1 .. k_max−1. The depth is always clamped. The width is clamped only when
the unclamped new depth d̃ ± l_d > 1: the drafting cost C_S = k̂²(d̂ − 1) + k̂ grows with k̂² only for
trees of more than one level, so a tree shrinking to one level may widen past k_max. Such a width is
still capped at the node budget ``total_tokens − 1`` (more first-level children than that could not be
kept) — or k_max − 1 if that is larger — and at the vocabulary; the next positive tree clamps it back.

Depth mapping. d̂ is the number of draft levels: the most draft tokens one tree can have accepted, so
α ≤ 1 and α = 1 means every level was used. ``DynamicTreeBuilder.depth`` counts expansion rounds after
the root's children, so PEANUT builds ``rounds = d̂ − 1`` (d̂ = 1: the root's k̂ children only). The
node budget is EAGLE-2's fixed ``total_tokens`` (59 with the root by default; the paper does not scale
it with the tree). So that a tree really has d̂ levels when that budget would prune its deepest ones,
the best-scoring path to the deepest level is always kept; the other nodes are EAGLE-2's best by
cumulative log q. The engine's per-step tree depth (``DecodeStats.depth_per_step``, hence d̄) is then
d̂ — less only where the image ends first — and α's denominator is that same depth.

Grid bookkeeping. After verification the tree's (d̂, k̂) is written at its root and at every position
it committed (accepted drafts and the bonus). A root was committed by the previous tree and is
overwritten by the tree rooted there, so each position holds the last tree it belonged to; the
horizontal neighbour of a root inside a row is therefore always the previous tree.
"""

from __future__ import annotations

import torch

from vdtrain.decode.acceptance import Verdict
from vdtrain.decode.engine import DynamicTreeBuilder, SpeculativeEngine, _Node, _StepState
from vdtrain.decode.trees import DraftTree

PEANUT_INITS = ("horizontal", "vertical", "random")
# The paper's names ("Horizontal Repeat", ...), as TreeConfig.init spells them (shared with SJD's inits).
_INIT_ALIASES = {"horizontal_repeat": "horizontal", "vertical_repeat": "vertical"}


class PeanutTreeBuilder(DynamicTreeBuilder):
    """EAGLE-2 trees with per-tree, per-prompt depth and width (see the module docstring).

    ``d_init``/``k_init``: the first tree's shape. ``grid`` (h, w) is taken from the engine's target
    at the first ``build``; pass it to drive ``shape``/``observe`` without an engine.
    """

    def __init__(
        self,
        init: str = "horizontal",
        beta: float = 1.0,
        l_d: int = 1,
        l_k: int = 10,
        d_min: int = 0,
        d_max: int = 10,
        k_min: int = 3,
        k_max: int = 40,
        d_init: int = 5,
        k_init: int = 10,
        total_tokens: int = 59,
        seed: int = 0,
        grid: tuple[int, int] | None = None,
    ) -> None:
        init = _INIT_ALIASES.get(init, init)
        if init not in PEANUT_INITS:
            raise ValueError(
                f"unknown PEANUT initialisation {init!r}; use horizontal_repeat, vertical_repeat or random"
            )
        if l_d < 0 or l_k < 0:
            raise ValueError(f"PEANUT steps must be >= 0 (got l_d={l_d}, l_k={l_k})")
        if d_min < 0 or d_max - d_min < 2 or k_min < 0 or k_max - k_min < 2:
            raise ValueError(
                f"PEANUT bounds are open intervals holding at least one integer, d_min >= 0, k_min >= 0 "
                f"(got d in ({d_min}, {d_max}), k in ({k_min}, {k_max}))"
            )
        if not (d_min < d_init < d_max and k_min < k_init < k_max):
            raise ValueError(
                f"PEANUT's initial tree must lie inside the bounds: d_init={d_init} in ({d_min}, {d_max}), "
                f"k_init={k_init} in ({k_min}, {k_max})"
            )
        super().__init__(top_k=k_init, depth=d_init - 1, total_tokens=total_tokens)
        self.init, self.beta, self.l_d, self.l_k = init, beta, l_d, l_k
        self.d_min, self.d_max, self.k_min, self.k_max = d_min, d_max, k_min, k_max
        self.d_init, self.k_init, self.seed = d_init, k_init, seed
        self.k_ceiling = max(total_tokens - 1, k_max - 1)  # widest tree ever (an unrestricted width)
        self.grid = grid
        self.reset(0)

    # --- the rule ------------------------------------------------------------------------------------
    def max_nodes(self) -> int:
        # Drafter scratch: (rounds) × (the batch's widest frontier) columns; the target tree: total_tokens.
        return max(self.total_tokens, 1 + self.k_ceiling * (self.d_max - 1))

    def adapt(self, d: int, k: int, alpha: float) -> tuple[int, int]:
        """Bisectional adaptation of the initial (d̃, k̃) given the previous tree's acceptance rate α."""
        positive = alpha >= self.beta
        raw_d = d + self.l_d if positive else d - self.l_d
        raw_k = k - self.l_k if positive else k + self.l_k
        new_d = min(max(raw_d, self.d_min + 1), self.d_max - 1)
        if raw_d > 1:
            new_k = min(max(raw_k, self.k_min + 1), self.k_max - 1)
        else:  # a one-level tree: its cost is linear in k, the width is not restricted
            new_k = min(max(raw_k, 1), self.k_ceiling)
        return new_d, new_k

    def neighbour(self, position: int) -> int | None:
        """The grid position the tree rooted at ``position`` is initialised from (None: none)."""
        if position <= 0 or self.init == "random":
            return None
        w = self.grid[1]
        i, j = divmod(position, w)
        if self.init == "horizontal":
            return position - 1 if j > 0 else position - w
        return position - w if i > 0 else position - 1

    def choose(self, b: int, position: int, generator: torch.Generator | None) -> tuple[int, int]:
        """(d̂, k̂) of prompt ``b``'s tree rooted at image ``position``."""
        if self.init == "random":
            g = generator if generator is not None else self._own_generators[b]
            d = int(torch.randint(self.d_min + 1, self.d_max, (1,), generator=g, device=g.device))
            k = int(torch.randint(self.k_min + 1, self.k_max, (1,), generator=g, device=g.device))
        else:
            src = self.neighbour(position)
            d, k = (-1, -1) if src is None else (int(self.depth_grid[b, src]), int(self.width_grid[b, src]))
            if d < 0:
                d, k = self.d_init, self.k_init
        if self.alpha[b] is None:
            return d, k
        return self.adapt(d, k, self.alpha[b])

    # --- engine hooks --------------------------------------------------------------------------------
    def reset(self, batch: int) -> None:
        self.batch = batch
        self.depth_grid = self.width_grid = None  # [B, h·w], −1 where unset; allocated with the grid
        self.alpha: list[float | None] = [None] * batch  # the previous tree's acceptance rate
        self.planned: list[tuple[int, int]] = [(self.d_init, self.k_init)] * batch
        self.history: list[list[tuple[int, int, int, int]]] = [[] for _ in range(batch)]  # (root, d̂, k̂, acc)
        self._own_generators = [torch.Generator().manual_seed(self.seed + b) for b in range(batch)]
        if self.grid is not None:
            self._allocate()

    def _allocate(self) -> None:
        n = self.grid[0] * self.grid[1]
        self.depth_grid = torch.full((self.batch, n), -1, dtype=torch.long)
        self.width_grid = torch.full((self.batch, n), -1, dtype=torch.long)

    def build(self, engine: SpeculativeEngine, state: _StepState) -> DraftTree:
        grid = tuple(engine.target.grid)
        if self.grid != grid or self.depth_grid is None:
            self.grid = grid
            self._allocate()
        return super().build(engine, state)

    def shape(self, state: _StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(rounds = d̂ − 1 [B], width = k̂ [B]) for this step's trees (``build`` caps the width at the
        vocabulary)."""
        if self.depth_grid is None:
            if self.grid is None:
                raise ValueError("PEANUT needs the image grid: build through the engine or pass grid=(h, w)")
            self._allocate()
        n = self.depth_grid.shape[1]
        for b in range(len(state.roots)):
            root = int(state.committed[b]) - 1
            if root < n - 1:  # finished prompts keep their last plan
                self.planned[b] = self.choose(b, root, state.generators[b])
        rounds = torch.tensor([d - 1 for d, _ in self.planned], dtype=torch.long)
        widths = torch.tensor([k for _, k in self.planned], dtype=torch.long)
        return rounds, widths

    def observe(
        self, tree: DraftTree, verdicts: list[Verdict | None], p_nodes: torch.Tensor, roots_at: torch.Tensor
    ) -> None:
        depths = tree.max_depth().tolist()
        for b, verdict in enumerate(verdicts):
            if verdict is None:
                continue
            d, k = self.planned[b]
            root, accepted = int(roots_at[b]), len(verdict.path)
            self.depth_grid[b, root : root + accepted + 2] = d  # root, accepted drafts, bonus
            self.width_grid[b, root : root + accepted + 2] = k
            if depths[b] > 0:  # a depth-0 tree (the image's last token) says nothing about α
                self.alpha[b] = accepted / depths[b]
            self.history[b].append((root, d, k, accepted))

    def _select(self, nodes: list[list[_Node]], state: _StepState, device) -> DraftTree:
        # Keep the best path to the deepest level drafted, so the tree has d̂ levels whatever the budget
        # prunes; EAGLE-2's ranking fills the rest (``build`` discards ``nodes`` after this call).
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

    # --- views ---------------------------------------------------------------------------------------
    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth and width grids as [B, h, w] (−1 where no tree has been yet)."""
        h, w = self.grid
        return self.depth_grid.view(-1, h, w), self.width_grid.view(-1, h, w)
