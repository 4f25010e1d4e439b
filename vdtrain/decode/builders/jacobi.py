"""SJD: speculative Jacobi decoding (ALGORITHMS.md §6), drafter-free and lossless, as a draft-tree builder.

A *window* of ``W`` draft tokens is drafted as a **chain**: the root is the last committed token, node
``i`` (depth ``i``) the draft for the ``i``-th position after it. Each draft carries the proposal vector it
was drawn from, ``tree.q[b, i - 1]`` (for node ``i``; ``q`` of a node is what its child was drawn from):

- a freshly initialised token: the point mass on it;
- a refined token: the target distribution computed for its position in the previous forward.

With ``sampled=True`` the engine's exact walk *is* SJD's verification: at node ``i`` accept the draft
``x`` with ``min(1, p(x)/q(x))`` (``p(x)`` for a point mass); at the first rejection draw the bonus from
``norm(max(0, p − q))`` (for a point mass: ``p`` without ``x``) and stop. GSD (``Grouped``) changes only
that test.

After the verdict (``observe``) the positions the target computed a distribution for but that were not
committed are *refined*: the one after the bonus up to the one after the last draft (the last node's
distribution included, as in the published code) are each re-drawn from the distribution just computed
for them (SJD's Eq. 3), which becomes their new ``q``. These distributions were conditioned on the old
drafts, including the rejected one; SJD keeps them anyway — a proposal may depend on anything drawn
before, verification stays exact because the token is a fresh draw from the ``q`` it is judged with.
The next window starts after the bonus with the refined tokens, cut to ``W`` (and to the image), and is
filled up to ``W`` with freshly initialised tokens (``init``):

- ``random``: uniform over the image tokens;
- ``horizontal_repeat`` / ``vertical_repeat``: the current token (committed or draft) one column left /
  one row up;
- ``horizontal_sample`` / ``vertical_sample``: a draw from the *stored distribution* one column left / one
  row up. The stored distribution of a position is the latest target distribution computed for it: the
  one it was committed under once committed (also for the bonus: ``p``, not the residual), its refined
  ``q`` while it is a draft. A fresh draft has none; the nearest stored distribution further left in the
  same row (further up the column) is used instead. The first image token (drawn from the prefill) has
  none either.

Fallbacks: the first column (horizontal), the first row (vertical), or no stored distribution
(``*_sample``): ``random``. A fresh token's ``q`` is always its point mass (ALGORITHMS.md §6, and the
published code), also for the ``*_sample`` inits. At T = 0 refinement takes the argmax (vanilla Jacobi).

Per-prompt state (window, board of tokens, stored distributions) lives across ``generate`` steps; draws
use the prompt's own generator (``state.generators``), so a sample depends on its seed only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState, row_verdicts
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.trees import DraftTree

INITS = ("random", "horizontal_repeat", "horizontal_sample", "vertical_repeat", "vertical_sample")


@dataclass
class _Prompt:
    """One prompt's Jacobi state: the window of drafts for image positions ``start ..``."""

    board: torch.Tensor  # [N] long: committed tokens and current drafts by image index, −1 unknown
    start: int  # image index of the window's first draft (= committed count when it is drafted)
    tokens: torch.Tensor  # [n] long: the drafts
    q: torch.Tensor  # [n, V]: the proposal each draft was drawn from
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # stored distributions (*_sample only)


class JacobiWindowBuilder(DraftTreeBuilder):
    """SJD's Jacobi window as a chain tree of ``window`` drafts, kept and refined across steps."""

    needs_drafter = False

    def __init__(self, window: int = 16, init: str = "random") -> None:
        if window < 1:
            raise ValueError(f"the Jacobi window needs at least one draft token, got window={window}")
        if init not in INITS:
            raise ValueError(f"unknown Jacobi initialisation {init!r}; known: {list(INITS)}")
        self.window, self.init = window, init
        self.reset(0)

    def max_nodes(self) -> int:
        return self.window + 1

    def reset(self, batch: int) -> None:
        self._prompts: list[_Prompt | None] = [None] * batch
        self._generators: Sequence[torch.Generator | None] = [None] * batch
        self._greedy = False
        self._width = 1

    @property
    def _stores(self) -> bool:
        return self.init.endswith("_sample")

    # --- drafting ------------------------------------------------------------------------------------
    def build(self, engine: SpeculativeEngine, state: StepState) -> DraftTree:
        target = engine.target
        batch, device = len(state.roots), state.roots.device
        n_img, vocab = target.num_image_tokens, target.vocab_size
        if len(self._prompts) != batch:
            self.reset(batch)
        self._generators, self._greedy, self._width = state.generators, engine.sampling.greedy, target.grid[1]
        size = self.window + 1
        tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
        tokens[:, 0] = state.roots
        q = torch.zeros(batch, size, vocab, device=device)
        depths = torch.arange(size, device=device).expand(batch, -1).clone()
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        for b in range(batch):
            m, limit = int(state.committed[b]), int(state.depth_limit[b])
            prompt = self._prompts[b]
            if prompt is None or prompt.start != m:  # a new prompt (or state from another run): afresh
                prompt = _Prompt(
                    torch.full((n_img,), -1, dtype=torch.long, device=device),
                    m,
                    torch.zeros(0, dtype=torch.long, device=device),
                    torch.zeros(0, vocab, device=device),
                )
                self._prompts[b] = prompt
            prompt.board[m - 1] = state.roots[b]
            n = max(0, min(self.window, limit))  # never draft past the last image token
            keep = min(n, len(prompt.tokens))
            fresh_tokens = []
            for k in range(m + keep, m + n):
                prompt.dists.pop(k, None)  # a fresh draft has no stored distribution
                token = self._initial(prompt, k, vocab, state.generators[b])
                prompt.board[k] = token
                fresh_tokens.append(token)
            fresh = torch.stack(fresh_tokens) if fresh_tokens else prompt.tokens[:0]
            prompt.tokens = torch.cat([prompt.tokens[:keep], fresh])
            prompt.q = torch.cat([prompt.q[:keep], torch.nn.functional.one_hot(fresh, vocab).to(q.dtype)])
            prompt.board[m + n :] = -1
            tokens[b, 1 : n + 1] = prompt.tokens
            q[b, :n] = prompt.q
            lengths[b] = n
        parents = (depths - 1).clone()
        return DraftTree(tokens, parents, depths, depths <= lengths[:, None], q, sampled=True)

    def _initial(
        self, prompt: _Prompt, k: int, vocab: int, generator: torch.Generator | None
    ) -> torch.Tensor:
        """A freshly initialised token for image position ``k`` (positions before it are all known)."""
        width = self._width
        row, col = divmod(k, width)
        horizontal = self.init.startswith("horizontal")
        has_neighbour = col > 0 if horizontal else row > 0
        if has_neighbour and self.init != "random":
            step = 1 if horizontal else width
            first = row * width if horizontal else 0  # the walk for a stored distribution stays in the row
            if self.init.endswith("_repeat"):
                token = prompt.board[k - step]
                if token >= 0:
                    return token.clone()
            else:
                for j in range(k - step, first - 1, -step):
                    dist = prompt.dists.get(j)
                    if dist is not None:
                        return torch.multinomial(dist, 1, generator=generator)[0]
        device = prompt.board.device
        return torch.randint(vocab, (), generator=generator, device=device)

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
            prompt = self._prompts[b]
            if verdict is None or prompt is None:
                continue
            m, n, a = int(roots_at[b]) + 1, int(lengths[b]), len(verdict.path)
            p = p_nodes[b]
            # Committed: the a accepted drafts (positions m .. m+a-1) and the bonus (position m+a).
            prompt.board[m : m + a] = tree.tokens[b, verdict.path]
            prompt.board[m + a] = verdict.bonus
            # Refinement: positions m+a+1 .. m+n from the distributions just computed for them (p_nodes at
            # the node before each: node d-1 predicts depth d), which become their proposals.
            rows = p[a + 1 : n + 1].clone()
            if not len(rows):
                refined = prompt.tokens[:0]
            elif self._greedy:
                refined = rows.argmax(-1)
            else:
                refined = torch.multinomial(rows, 1, generator=self._generators[b]).squeeze(1)
            prompt.start, prompt.tokens, prompt.q = m + a + 1, refined, rows
            prompt.board[m + a + 1 : m + n + 1] = refined
            prompt.board[m + n + 1 :] = -1
            if self._stores:
                for i in range(a + 1):
                    prompt.dists[m + i] = p[i].clone()
                for j in range(len(rows)):
                    prompt.dists[m + a + 1 + j] = rows[j]
                for k in [k for k in prompt.dists if k < prompt.start - self._width - 1]:
                    del prompt.dists[k]  # never looked up again: one row up is as far back as a walk goes
