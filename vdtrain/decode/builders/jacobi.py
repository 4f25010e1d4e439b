"""SJD: speculative Jacobi decoding, drafter-free and lossless, as a draft-tree builder.

A window of ``W`` drafts is a chain rooted at the last committed token; each draft carries the proposal
it was drawn from (a fresh token: its point mass; a refined one: the target distribution computed for
its position last step), so the engine's exact walk with ``sampled=True`` *is* SJD's verification (GSD
only changes the test). ``observe`` refines the positions the forward computed but did not commit (SJD's
Eq. 3) and refills the window with fresh tokens (``init``: random, or repeating / sampling from the
neighbour one column left or one row up). All prompts' windows are device tensors of fixed shape, changed
with tensor ops only; every draw is a per-prompt ``RowRandom`` uniform. docs/decoding.md, "SJD and GSD
on SJD", has the refinement, the stored distributions the ``*_sample`` inits read, and the fallbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from vdtrain.decode.budget import TreeBudget
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
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from vdtrain.decode.builders.base import DraftContext

INITS = ("random", "horizontal_repeat", "horizontal_sample", "vertical_repeat", "vertical_sample")


@dataclass
class _Windows:
    """Every prompt's Jacobi state: entry ``k`` of row ``b`` is the refined draft (and its proposal) for
    image position ``start[b] + k``, for ``k < count[b]``."""

    start: torch.Tensor  # [B] long: the committed count the window was refined for (−1: none yet)
    count: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, W] long
    q: torch.Tensor  # [B, W, V]
    board: torch.Tensor | None  # [B, N + W + 1] long: committed tokens by image index, −1 unknown (*_repeat)
    stored: torch.Tensor | None  # [B, S, V]: the distribution of the last committed position ≡ slot mod S
    stored_at: torch.Tensor | None  # [B, S] long: the position each slot holds, −1 none (*_sample)

    def restart(self) -> _Windows:
        """The state before any step, in place (a recorded step replays on these tensors)."""
        for tensor, value in (
            (self.start, -1),
            (self.count, 0),
            (self.tokens, 0),
            (self.q, 0.0),
            (self.board, -1),
            (self.stored, 0.0),
            (self.stored_at, -1),
        ):
            if tensor is not None:
                tensor.fill_(value)
        return self


@dataclass
class JacobiTreeConfig(TreeConfig):
    """SJD's Jacobi window (``JacobiWindowBuilder``); no drafter."""

    kind: str = "jacobi"
    window: int = 16  # W: draft tokens per Jacobi window
    init: str = "random"  # fresh drafts: random | {horizontal,vertical}_{repeat,sample}
    coupling: str = "none"  # an old draft's next one: none (a fresh draw, SJD) | maximal | gumbel (SCD)


class JacobiWindowBuilder(DraftTreeBuilder):
    """SJD's Jacobi window as a chain tree of ``window`` drafts, kept and refined across steps; a call's
    node budget (``StepState.budget``) shortens the window to ``nodes − 1`` drafts."""

    needs_drafter = False
    graph_safe = True  # the window is made at the first step and then updated in place

    def __init__(self, config: JacobiTreeConfig) -> None:
        window, init, coupling = config.window, config.init, config.coupling
        if window < 1:
            raise ValueError(f"the Jacobi window needs at least one draft token, got window={window}")
        if init not in INITS:
            raise ValueError(f"unknown Jacobi initialisation {init!r}; known: {list(INITS)}")
        if coupling not in COUPLINGS:
            raise ValueError(f"unknown Jacobi coupling {coupling!r}; known: {list(COUPLINGS)}")
        self.window, self.init, self.coupling = window, init, coupling
        self._chains: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._windows: _Windows | None = None
        self.reset(0)

    def max_nodes(self, budget: TreeBudget) -> int:
        return budget.cap(self.window + 1)

    def reset(self, batch: int) -> None:
        win = self._windows
        self._windows = win.restart() if win is not None and win.tokens.shape[0] == batch else None

    def _chain_ancestors(self, length: int, device: torch.device) -> torch.Tensor:
        """[1, length, length] bool: a chain's ancestor matrix (node i sees j <= i), made once."""
        if (device, length) not in self._chains:
            self._chains[device, length] = torch.ones(length, length, dtype=torch.bool, device=device).tril()[
                None
            ]
        return self._chains[device, length]

    def _windows_for(
        self, batch: int, size: int, n_img: int, vocab: int, width: int, device: torch.device
    ) -> _Windows:
        """The windows of ``size`` drafts (made anew for another batch, size or device)."""
        win = self._windows
        if win is None or win.tokens.shape[:2] != (batch, size) or win.tokens.device != device:
            long = {"dtype": torch.long, "device": device}
            slots = width if self.init == "vertical_sample" else 1
            sample, repeat = self.init.endswith("_sample"), self.init.endswith("_repeat")
            win = self._windows = _Windows(
                torch.empty(batch, **long),
                torch.empty(batch, **long),
                torch.empty(batch, size, **long),
                torch.empty(batch, size, vocab, device=device),
                torch.empty(batch, n_img + size + 1, **long) if repeat else None,
                torch.empty(batch, slots, vocab, device=device) if sample else None,
                torch.empty(batch, slots, **long) if sample else None,
            ).restart()
        return win

    # --- drafting ------------------------------------------------------------------------------------
    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        if state.rng is None:
            raise ValueError("JacobiWindowBuilder draws from the run's RowRandom: StepState.rng is None")
        target = ctx.target
        batch, device = len(state.roots), state.roots.device
        size = self.max_nodes(state.budget)  # the window's drafts and the root
        win = self._windows_for(
            batch, size - 1, target.num_image_tokens, target.vocab_size, target.grid[1], device
        )
        return self._draft(ctx, state, win, shared_arange(size, device), self._chain_ancestors(size, device))

    @step_kernel
    def _draft(
        self, ctx: DraftContext, state: StepState, win: _Windows, chain: torch.Tensor, ancestors: torch.Tensor
    ) -> DraftTree:
        """The window as a chain tree: the kept refined drafts, then fresh ones (``chain`` [W + 1]:
        arange(W + 1), ``ancestors`` [W + 1, W + 1]: the chain's ancestor matrix)."""
        target = ctx.target
        batch = len(state.roots)
        n_img, vocab, size = target.num_image_tokens, target.vocab_size, win.tokens.shape[1]
        width = target.grid[1]
        entries = chain[None, :size]
        m = state.committed
        n = state.depth_limit.clamp(0, size)  # never draft past the last image token
        keep = torch.minimum(win.count, n).masked_fill(win.start != m, 0)
        kept = entries < keep[:, None]  # [B, W]
        u = state.rng.uniform(Purpose.DRAFT, size, 2)  # [B, W, 2]: a uniform token, a stored-dist draw
        uniform = (u[..., 0] * vocab).long().clamp_max(vocab - 1)
        fresh = uniform
        if self.init != "random":
            fresh = self._initial(win, state, width, keep, uniform, u[..., 1], entries)
        drafts = torch.where(kept, win.tokens, fresh)
        point = torch.zeros_like(win.q).scatter_(2, drafts[..., None], 1.0)
        q = torch.where(kept[..., None], win.q, point)
        q = q.masked_fill((entries >= n[:, None])[..., None], 0.0)
        depths = chain[None]
        return DraftTree(
            torch.cat([state.roots[:, None], drafts], 1),
            (depths - 1).expand(batch, -1),
            depths.expand(batch, -1),
            depths <= n[:, None],
            torch.nn.functional.pad(q, (0, 0, 0, 1)),  # the last node has no children: q = 0
            sampled=True,
            depth_bound=max(1, min(size, n_img - 2)),
            width_bound=1,
            ancestors=ancestors,
            chain=True,
        )

    def _initial(
        self,
        win: _Windows,
        state: StepState,
        width: int,
        keep: torch.Tensor,
        uniform: torch.Tensor,
        u: torch.Tensor,
        entries: torch.Tensor,
    ) -> torch.Tensor:
        """[B, W]: the freshly initialised token of every window entry (meaningful where it is fresh),
        from ``keep`` [B] refined entries kept, ``uniform`` [B, W] random tokens, ``u`` [B, W] draws for
        the ``_sample`` inits and ``entries`` [1, W] (arange).

        The fresh positions are ``first = m + keep`` onwards; the walk from position ``k`` goes left
        (``step`` 1) or up (``step`` = the grid's width) and may take ``reach`` steps before leaving the
        row or the image. It meets its first non-fresh position after ``hops`` steps."""
        size = win.tokens.shape[1]
        horizontal = self.init.startswith("horizontal")
        step = 1 if horizontal else width
        m = state.committed[:, None]
        k = m + entries  # [B, W] image positions
        first = m + keep[:, None]
        reach = k % width if horizontal else k // width
        hops = ((k - first).div(step, rounding_mode="floor") + 1).clamp_min(1)
        if self.init.endswith("_repeat"):
            walk = torch.minimum(hops, reach)  # 0 without a neighbour: the uniform token at k itself
            source = k - walk * step
            known = source < first  # a committed or refined token (else a fresh one that drew uniformly)
            refined = win.tokens.gather(1, (source - m).clamp(0, size - 1))
            win.board.scatter_(1, m - 1, state.roots[:, None])  # the root is committed
            token = torch.where(source >= m, refined, win.board.gather(1, source.clamp_min(0)))
            # Past an unknown token the walk's last fresh position drew uniformly; the rest copy it.
            origin = torch.where(known, source + step, source)
            copied = uniform.gather(1, (origin - m).clamp(0, size - 1))
            return torch.where(known & (token >= 0), token, copied)
        source = (k - hops * step).clamp_min(0)
        slots = win.stored.shape[1]
        refined = source >= m  # a refined draft: its q; else a committed position: the ring, if it holds it
        slot = source % slots
        held = win.stored_at.gather(1, slot) == source
        has = (hops <= reach) & (refined | held)
        index = torch.where(refined, slots + source - m, slot).clamp(0, slots + size - 1)
        dists = torch.cat([win.stored, win.q], 1).gather(1, index[..., None].expand(-1, -1, win.q.shape[-1]))
        return torch.where(has, inverse_cdf(dists, u), uniform)

    # --- after verification --------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        win = self._windows
        if win is None:
            raise RuntimeError("JacobiWindowBuilder.observe before build: no window to refine")
        o, device = outcome, outcome.p_nodes.device
        ring = None if win.stored is None else shared_arange(win.stored.shape[1], device)
        chain = shared_arange(win.tokens.shape[1] + 1, device)
        new = self._refine(
            o.tree, o.verdict, o.verified, o.p_nodes, o.roots_at, win,
            chain=chain, ring=ring, rng=o.rng, greedy=o.greedy,
        )  # fmt: skip
        write_in_place(win, new)

    @step_kernel
    def _refine(
        self, tree, verdict, verified, p_nodes, roots_at, win: _Windows, *, chain, ring, rng, greedy
    ) -> _Windows:
        """The next window: every entry refined from the target's p ``p_nodes`` [B, T, V] where
        ``verified`` [B] (``roots_at`` [B]: each root's image index; ``chain``: arange(W + 1), ``ring``:
        arange(S) of the stored distributions; ``rng``, ``greedy``: the step's, ``StepOutcome``)."""
        win = replace(win)  # a new state: the kernel changes none of its inputs' attributes
        size, vocab, last = win.tokens.shape[1], p_nodes.shape[-1], tree.size - 1
        m, accepted = roots_at + 1, verdict.accepted
        entries = chain[None]
        # Refinement: entry k of the next window is position m + a + 1 + k, predicted by node a + 1 + k.
        nodes = (accepted[:, None] + 1 + entries[:, :size]).clamp_max(last)
        p = p_nodes.gather(1, nodes[..., None].expand(-1, -1, vocab))  # [B, W, V]
        count = (tree.max_depth() - accepted).clamp_min(0)  # positions m + a + 1 .. m + n
        start = m + accepted + 1
        refined = self._redraw(tree, nodes, p, start, count, rng, greedy)
        if win.board is not None:  # committed: the a accepted drafts (positions m ..) and the bonus
            at = m[:, None] + entries
            drafts = tree.tokens.gather(1, (entries + 1).clamp_max(last).expand(len(m), -1))
            new = torch.where(entries == accepted[:, None], verdict.bonus[:, None], drafts)
            write = verified[:, None] & (entries <= accepted[:, None])
            win.board.scatter_(1, at, torch.where(write, new, win.board.gather(1, at)))
        if win.stored is not None:  # slot s: the last committed position ≡ s, p at its node if new
            slots = win.stored.shape[1]
            top = (m + accepted)[:, None]
            held = top - (top - ring[None]) % slots
            node = held - m[:, None]
            new = verified[:, None] & (node >= 0)
            dist = p_nodes.gather(1, node.clamp(0, last)[..., None].expand(-1, -1, vocab))
            win.stored = torch.where(new[..., None], dist.to(win.stored.dtype), win.stored)
            win.stored_at = torch.where(new, held, win.stored_at)
        win.start = torch.where(verified, start, win.start)
        win.count = torch.where(verified, count, win.count)
        win.tokens = torch.where(verified[:, None], refined, win.tokens)
        win.q = torch.where(verified[:, None, None], p.to(win.q.dtype), win.q)
        return win

    def _redraw(self, tree, nodes, p, start, count, rng: RowRandom, greedy: bool) -> torch.Tensor:
        """Each entry's next draft, a draw from its new ``p`` [B, W, V] (``nodes`` [B, W]: the node whose p
        it is; entry k is image position ``start + k``, ``start`` [B]; ``count`` [B]: the entries the
        forward drafted before, plus one): afresh (SJD), or coupled with the old draft in ``tree`` (SCD);
        the argmax at T = 0."""
        size = p.shape[1]
        if greedy:
            return p.argmax(-1)
        if self.coupling == "gumbel":
            positions = start[:, None] + shared_arange(size, p.device)[None]
            return gumbel_max(p, rng.keyed(Purpose.GUMBEL, positions, p.shape[-1]))
        if self.coupling == "maximal":
            last = tree.size - 1
            drafted = shared_arange(size, p.device)[None] < count[:, None] - 1  # the last had no draft
            old = tree.tokens.gather(1, (nodes + 1).clamp_max(last))
            q = tree.q.gather(1, nodes[..., None].expand(-1, -1, p.shape[-1]))
            u = rng.uniform(Purpose.REFINE, size, 2)
            return maximal_coupling(old, p, torch.where(drafted[..., None], q, 0.0), u[..., 0], u[..., 1])
        return inverse_cdf(p, rng.uniform(Purpose.REFINE, size))
