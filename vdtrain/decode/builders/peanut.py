"""PEANUT: adjacency-adaptive dynamic draft trees (lossless with exact acceptance).

EAGLE-2 dynamic trees (``vdtrain.decode.builders.dynamic``) whose depth d̂ (draft levels) and width
(top-k) k̂ change per tree and per prompt: initialised from a per-prompt grid over the image holding the
(d, k) of the tree each position belongs to (the neighbour left or above, or random), then adapted
bisectionally from α = the previous tree's accepted drafts / its depth (deeper and narrower when α ≥ β,
else shallower and wider), within the paper's open bounds. The best path to the deepest level is always
kept, so a tree really has d̂ levels. The grids, α and the plan are device tensors. docs/decoding.md,
"PEANUT", has the fallbacks, the bounds and the width rule of one-level trees, and the node budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.builders.base import StepOutcome, StepState, TreeConfig
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.graphs import DeviceLog, recording
from vdtrain.decode.kernels import shared_arange
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from vdtrain.decode.builders.base import DraftContext

PEANUT_INITS = ("horizontal", "vertical", "random")
# The paper's names ("Horizontal Repeat", ...), as PeanutTreeConfig.init spells them (shared with SJD's).
_INIT_ALIASES = {"horizontal_repeat": "horizontal", "vertical_repeat": "vertical"}


@dataclass
class PeanutTreeConfig(TreeConfig):
    """PEANUT's EAGLE-2 trees adapted per tree (``PeanutTreeBuilder``). ``d`` counts draft levels
    (= dynamic depth + 1)."""

    kind: str = "peanut"
    init: str = "horizontal_repeat"  # horizontal_repeat (the paper's default) | vertical_repeat | random
    total_tokens: int = 59  # nodes kept, root included
    beta: float = 1.0  # positive threshold on α = accepted drafts / tree depth
    l_d: int = 1  # depth step
    l_k: int = 10  # width (top-k) step (paper: 10 for LlamaGen, 3 for Chameleon-family targets)
    d_min: int = 0  # open bounds d_min < d < d_max
    d_max: int = 10
    k_min: int = 3  # open bounds k_min < k < k_max (paper: (3, 40) LlamaGen, (3, 14) Chameleon)
    k_max: int = 40
    d_init: int = 5  # the first tree's depth (draft levels) and width
    k_init: int = 10
    init_seed: int = 0  # random init: seed of the fallback generators (when the engine passes none)


class PeanutTreeBuilder(DynamicTreeBuilder):
    """EAGLE-2 trees with per-tree, per-prompt depth and width (see the module docstring).

    ``d_init``/``k_init``: the first tree's shape. ``grid`` (h, w) is taken from the engine's target
    at the first ``build``; pass it to drive ``shape``/``observe`` without an engine. The per-prompt
    state (grids, α, the planned shape) lives on the device; ``shape`` and ``observe`` are tensor code.
    """

    keep_deepest_path = True
    own_shape = True  # per-prompt depth and width under the envelope
    # Stepped from Python, the padded shapes follow the batch's planned trees (a read of the device per
    # step); in a recorded step they are the widest and deepest any tree can have (``envelope``).
    graph_safe = True

    def __init__(self, config: PeanutTreeConfig, grid: tuple[int, int] | None = None) -> None:
        init, l_d, l_k, total_tokens = config.init, config.l_d, config.l_k, config.total_tokens
        d_min, d_max, d_init = config.d_min, config.d_max, config.d_init
        k_min, k_max, k_init = config.k_min, config.k_max, config.k_init
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
        super().__init__(DynamicTreeConfig(top_k=k_init, depth=d_init - 1, total_tokens=total_tokens))
        self.init, self.beta, self.l_d, self.l_k = init, config.beta, l_d, l_k
        self.d_min, self.d_max, self.k_min, self.k_max = d_min, d_max, k_min, k_max
        self.d_init, self.k_init, self.seed = d_init, k_init, config.init_seed
        self.k_ceiling = max(total_tokens - 1, k_max - 1)  # widest tree ever (an unrestricted width)
        self.grid = grid
        self.planned: torch.Tensor | None = None
        self.reset(0)

    # --- the rule ------------------------------------------------------------------------------------
    def max_nodes(self, budget: TreeBudget) -> int:
        # Drafter scratch: (rounds) × (the batch's widest frontier) columns; the target tree: ``tree_size``.
        return max(self.tree_size(budget), 1 + self.k_ceiling * (self.d_max - 1))

    def adapt(self, d, k, alpha):
        """Bisectional adaptation of the initial (d̃, k̃) given the previous tree's acceptance rate α
        (``d``, ``k``, ``alpha``: ints, or tensors [B] of one shape)."""
        d, k, alpha = torch.as_tensor(d), torch.as_tensor(k), torch.as_tensor(alpha)
        positive = alpha >= self.beta
        raw_d = torch.where(positive, d + self.l_d, d - self.l_d)
        raw_k = torch.where(positive, k - self.l_k, k + self.l_k)
        new_d = raw_d.clamp(self.d_min + 1, self.d_max - 1)
        # A one-level tree: its cost is linear in k, the width is not restricted.
        new_k = torch.where(
            raw_d > 1, raw_k.clamp(self.k_min + 1, self.k_max - 1), raw_k.clamp(1, self.k_ceiling)
        )
        return new_d, new_k

    def neighbour(self, position: torch.Tensor) -> torch.Tensor:
        """The grid position the tree rooted at ``position`` [B] is initialised from (−1: none)."""
        w = self.grid[1]
        row, col = position // w, position % w
        if self.init == "horizontal":
            src = torch.where(col > 0, position - 1, position - w)
        else:
            src = torch.where(row > 0, position - w, position - 1)
        return torch.where(position > 0, src, -1)

    # --- engine hooks --------------------------------------------------------------------------------
    def reset(self, batch: int) -> None:
        if self.planned is not None and self.batch == batch:
            self._restart()  # in place: a recorded step replays on these tensors
            return
        self.batch = batch
        self.depth_grid = self.width_grid = None  # [B, h·w + 1], −1 where unset; the last column is scratch
        self.alpha: torch.Tensor | None = None  # [B] the previous tree's acceptance rate, NaN before one
        self.planned = None  # [B, 2] (d̂, k̂) of the current tree
        self.log: DeviceLog | None = None  # per verified step: (verified, root, d̂, k̂, accepted) [B, 5]
        # Draws when the engine passes no per-prompt randomness: seeded with ``seed + b``.
        self._own_rng = RowRandom(torch.arange(batch, dtype=torch.long) + self.seed)
        if self.grid is not None:
            self._allocate(torch.device("cpu"))

    def _allocate(self, device: torch.device) -> None:
        n = self.grid[0] * self.grid[1]
        long = {"dtype": torch.long, "device": device}
        self.depth_grid = torch.empty(self.batch, n + 1, **long)
        self.width_grid = torch.empty(self.batch, n + 1, **long)
        self.alpha = torch.empty(self.batch, device=device)
        self.planned = torch.empty(self.batch, 2, **long)
        self.log = DeviceLog(n, self.batch, 5, device=device)  # a step commits at least one token
        self._restart()

    def _restart(self) -> None:
        """No tree yet, in place."""
        self.depth_grid.fill_(-1)
        self.width_grid.fill_(-1)
        self.alpha.fill_(float("nan"))
        self.planned[:, 0], self.planned[:, 1] = self.d_init, self.k_init
        self.log.clear()
        self._own_rng.reseed(torch.arange(self.batch, dtype=torch.long) + self.seed)

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        grid, device = tuple(ctx.target.grid), state.roots.device
        if self.grid != grid or self.depth_grid is None or self.depth_grid.device != device:
            self.grid = grid
            self._allocate(device)
        return super().build(ctx, state)

    def shape(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(rounds = d̂ − 1 [B], width = k̂ [B]) for this step's trees."""
        if self.depth_grid is None:
            if self.grid is None:
                raise ValueError("PEANUT needs the image grid: build through the engine or pass grid=(h, w)")
            self._allocate(state.committed.device)
        n = self.grid[0] * self.grid[1]
        root = state.committed - 1
        if self.init == "random":
            rng = state.rng
            if rng is None:
                rng = self._own_rng
                rng.advance()
            u = rng.uniform(Purpose.SHAPE, 2).to(root.device)
            d = self.d_min + 1 + (u[:, 0] * (self.d_max - self.d_min - 1)).long()
            k = self.k_min + 1 + (u[:, 1] * (self.k_max - self.k_min - 1)).long()
        else:
            src = self.neighbour(root)
            d = self.depth_grid.gather(1, src.clamp_min(0)[:, None]).squeeze(1)
            k = self.width_grid.gather(1, src.clamp_min(0)[:, None]).squeeze(1)
            unset = (src < 0) | (d < 0)
            d, k = torch.where(unset, self.d_init, d), torch.where(unset, self.k_init, k)
        new_d, new_k = self.adapt(d, k, self.alpha.nan_to_num(0.0))
        has_alpha = ~self.alpha.isnan()
        d, k = torch.where(has_alpha, new_d, d), torch.where(has_alpha, new_k, k)
        update = (root < n - 1)[:, None]  # finished prompts keep their last plan
        self.planned.copy_(torch.where(update, torch.stack([d, k], 1), self.planned))
        return self.planned[:, 0] - 1, self.planned[:, 1]

    def envelope(self, state: StepState) -> tuple[int, int]:
        """The batch's largest (rounds, width) this step: PEANUT's one read of the device per step. A
        recorded step (``vdtrain.decode.graphs``) cannot read it, so it pads to the largest of any step
        (the same trees: padding rows never rank before real ones), about twice the drafter rows."""
        if recording():
            return self.d_max - 2, self.k_ceiling
        rounds, width = self.planned.amax(0).tolist()
        return rounds - 1, width

    def observe(self, outcome: StepOutcome) -> None:
        verdict, verified, roots_at = outcome.verdict, outcome.verified, outcome.roots_at
        n = self.depth_grid.shape[1] - 1
        tree = outcome.tree
        depth, accepted = tree.max_depth(), verdict.accepted
        # The tree's (d̂, k̂) at its root, its accepted drafts and its bonus; other columns → scratch.
        j = shared_arange(verdict.path.shape[1] + 2, roots_at.device)[None]
        write = verified[:, None] & (j <= accepted[:, None] + 1)
        at = torch.where(write, roots_at[:, None] + j, n)
        self.depth_grid.scatter_(1, at, self.planned[:, :1].expand_as(at))
        self.width_grid.scatter_(1, at, self.planned[:, 1:].expand_as(at))
        # A depth-0 tree (the image's last token) says nothing about α.
        measured = verified & (depth > 0)
        self.alpha.copy_(torch.where(measured, accepted / depth.clamp_min(1), self.alpha))
        self.log.append(torch.stack([verified.long(), roots_at, *self.planned.unbind(1), accepted], 1))

    # --- views ---------------------------------------------------------------------------------------
    @property
    def history(self) -> list[list[tuple[int, int, int, int]]]:
        """Per prompt, (root, d̂, k̂, accepted drafts) of every verified tree (read back on demand)."""
        rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.batch)]
        if self.log is None:
            return rows
        for step in self.log.tolist():
            for b, (verified, root, d, k, accepted) in enumerate(step):
                if verified:
                    rows[b].append((root, d, k, accepted))
        return rows

    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth and width grids as [B, h, w] (−1 where no tree has been yet)."""
        h, w = self.grid
        return self.depth_grid[:, :-1].reshape(-1, h, w), self.width_grid[:, :-1].reshape(-1, h, w)
