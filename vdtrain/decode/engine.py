"""The speculative decoding loop: draft a tree → verify it in one target forward → commit.

Drafting (how the tree is built) and acceptance (which drafted tokens are kept) are separate parts;
the loop only moves tokens, features and KV entries between them. It runs a batch of prompts, each
with its own progress, with CFG as a batch of two streams (conditional rows, then null rows) for both
the target and the drafter.

Bookkeeping per prompt ``b`` with ``m`` committed image tokens ``x_0 .. x_{m-1}``:

- the *root* of the next tree is ``x_{m-1}``: committed but not yet seen by the target;
- target KV slots ``0 .. L+m-2`` are valid (prefix + ``x_0 .. x_{m-2}``); the tree goes to slots
  ``L+m-1 ..`` (node ``i`` at ``L+m-1+i``) and accepted nodes are moved down to ``L+m-1+depth``;
- drafter row ``s`` pairs the target feature ``f_s`` with the embedding of the token at slot ``s+1``
  (``vdtrain.drafter``); rows ``0 .. L+m-2`` are committed, and tree nodes at depth ``d`` take row
  position ``L+m-2+d`` in scratch slots after them. Expansion rows are recomputed from true target
  features once their tokens are accepted ("catch-up").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vdtrain.decode.acceptance import Verdict, verify_exact
from vdtrain.decode.ar import cfg_batch, split_cfg
from vdtrain.decode.sampling import SamplingConfig, next_tokens, probabilities, processed_logits
from vdtrain.decode.trees import DraftTree, StaticTree, ancestor_matrix
from vdtrain.drafter import Drafter, teacher_mask
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target


@dataclass
class DecodeStats:
    """Counts for one prompt; the metric definitions of ALGORITHMS.md §10 are derived from them."""

    target_forwards: int = 0  # including the prefill
    drafter_forwards: int = 0
    steps: int = 0  # verification steps
    committed_per_step: list[int] = field(default_factory=list)  # accepted drafts + bonus
    depth_per_step: list[int] = field(default_factory=list)  # depth of the drafted tree
    accept_map: list[tuple[int, int]] = field(default_factory=list)  # (image index of the root, accepted)
    relaxed_acceptances: int = 0  # accepted drafts that exact verification would have refused

    @property
    def tau(self) -> float:
        return sum(self.committed_per_step) / max(1, len(self.committed_per_step))

    @property
    def mean_depth(self) -> float:
        return sum(self.depth_per_step) / max(1, len(self.depth_per_step))


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, N]
    stats: list[DecodeStats]
    seconds: float


class DraftTreeBuilder:
    """Builds each step's tree; subclasses decide its shape (static, dynamic, adaptive, Jacobi).

    ``reset`` and ``observe`` let a builder keep per-prompt state across steps (PEANUT's depth/width
    grid, SJD's window); the plain trees ignore them.
    """

    needs_drafter: ClassVar[bool] = True  # False: drafts without a drafter model (SJD)

    def max_nodes(self) -> int:
        raise NotImplementedError

    def build(self, engine: SpeculativeEngine, state: _StepState) -> DraftTree:
        raise NotImplementedError

    def reset(self, batch: int) -> None:
        """A new ``generate`` call with ``batch`` prompts begins."""

    def observe(
        self, tree: DraftTree, verdicts: list[Verdict | None], p_nodes: torch.Tensor, roots_at: torch.Tensor
    ) -> None:
        """After verification: ``verdicts[b]`` for prompt ``b`` (None once it is finished), the target
        distribution at every node ``p_nodes`` [B, T, V], and each tree's root image index."""


@dataclass
class _StepState:
    """What a tree builder needs to know about the current step."""

    roots: torch.Tensor  # [B] root tokens
    root_feats: torch.Tensor | None  # [R, H] drafter feature predicted for the root's slot (R = streams·B)
    root_logits: torch.Tensor | None  # [R, V] drafter logits for the root's children (None: no drafter)
    committed: torch.Tensor  # [B] m
    depth_limit: torch.Tensor  # [B] max tree depth allowed (image tokens left to draft)
    generators: Sequence[torch.Generator | None]


# accept(tree, row, p_nodes [T, V], greedy, generator) -> Verdict. A rule with ``needs_soft_p = True`` is
# also given ``p_relax=`` [T, V] at T = 0: the temperature-1 softmax of the same filtered logits.
Acceptance = Callable[[DraftTree, int, torch.Tensor, bool, "torch.Generator | None"], Verdict]
StepHook = Callable[[KVCache, torch.Tensor, torch.Tensor], None]


class SpeculativeEngine:
    """``builder`` drafts the trees, ``accept`` verifies one prompt's tree (default: exact)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        builder: DraftTreeBuilder,
        sampling: SamplingConfig,
        accept: Acceptance = verify_exact,
    ) -> None:
        if drafter is not None:
            drafter.attach(target)  # refuses a drafter trained for another target
        elif builder.needs_drafter:
            raise ValueError(f"{type(builder).__name__} drafts with a drafter model: pass one")
        self.target, self.drafter, self.builder, self.sampling, self.accept = (
            target,
            drafter,
            builder,
            sampling,
            accept,
        )

    # --- distributions ---------------------------------------------------------------------------
    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → the pipeline's processed logits [B, ..., V] (CFG combined)."""
        return processed_logits(*split_cfg(logits, self.sampling), self.sampling)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q: the drafter's distribution made by the one pipeline; at T=0 a softmax of the same
        filtered logits (so top-k ranking and cumulative scores are defined)."""
        if self.sampling.greedy:
            return self.draft_logits(logits).softmax(-1)
        return probabilities(*split_cfg(logits, self.sampling), self.sampling)

    # --- masks -------------------------------------------------------------------------------------
    @staticmethod
    def _mask(cond_mask: torch.Tensor, image_visibility: torch.Tensor) -> torch.Tensor:
        """Prefix columns from the caption mask, then the image-slot visibility: [R, 1, S, L + K]."""
        rows, steps = image_visibility.shape[0], image_visibility.shape[1]
        prefix = cond_mask[:, None, :].expand(rows, steps, -1)
        return torch.cat([prefix, image_visibility], dim=-1)[:, None]

    @staticmethod
    def _visibility(
        committed_cols: torch.Tensor, tree_cols: torch.Tensor, tree_vis: torch.Tensor, width: int
    ):
        """Per row: image columns ``< committed_cols[b]`` visible, plus ``tree_vis`` [B, S, S'] placed at
        columns ``tree_cols[b] ..``; ``width`` columns in all."""
        batch, steps, tree = tree_vis.shape
        device = tree_vis.device
        cols = torch.arange(width, device=device)
        vis = (cols[None, :] < committed_cols[:, None])[:, None, :].expand(batch, steps, width).clone()
        place = tree_cols[:, None] + torch.arange(tree, device=device)[None, :]  # [B, S']
        vis.scatter_(2, place[:, None, :].expand(batch, steps, tree), tree_vis)
        return vis

    # --- drafter -----------------------------------------------------------------------------------
    def drafter_rows(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor | None,
        positions: torch.Tensor,
        slots: torch.Tensor,
        image_vis: torch.Tensor,
        next_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run drafter rows (features [R, S, H] + next tokens [B, S]) → (f̂ [R, S, H], logits [R, S, V])."""
        streams = feats.shape[0] // positions.shape[0]
        if next_embeds is None:
            next_embeds = self.drafter.embed(tokens.repeat(streams, 1))
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        mask = self._mask(self._cond_mask, rep(image_vis))
        out = self.drafter(feats, next_embeds, rep(positions), mask, self._dcache, rep(slots))
        self._draft_calls += 1
        return out, self.drafter.logits(out)

    # --- the loop ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, cond: Condition, generators: Sequence[torch.Generator | None], on_step: StepHook | None = None
    ) -> DecodeResult:
        """Image tokens for ``cond``; ``on_step(target_cache, committed, tokens)`` runs after each commit."""
        target, sampling = self.target, self.sampling
        start_time = time.perf_counter()
        batch, n_img, prefix = len(cond), target.num_image_tokens, target.prefix_length
        stream = cfg_batch(target, cond, sampling)
        streams = len(stream) // batch
        device = target.token_embedding.weight.device
        extra = self.builder.max_nodes() + 1
        self._cond_mask = stream.mask
        self._draft_calls = 0
        tcache = target.new_cache(len(stream), extra_slots=extra)
        use_drafter = self.builder.needs_drafter
        if use_drafter:
            self._dcache = self.drafter.new_cache(len(stream), target.max_seq_len + extra)
        self.builder.reset(batch)
        stats = [DecodeStats() for _ in range(batch)]

        # Prefill the target, sample x_0 like AR, and catch the drafter up on the prefix.
        pre = target.prefill(stream, tcache)
        out = torch.zeros(batch, n_img, dtype=torch.long, device=device)
        out[:, 0] = next_tokens(*split_cfg(pre.logits[:, -1], sampling), sampling, generators)
        committed = torch.ones(batch, dtype=torch.long, device=device)
        for st in stats:
            st.target_forwards += 1
            st.drafter_forwards += int(use_drafter)
        root_feats = root_logits = None
        if use_drafter:
            # Drafter rows 0 .. L-1: zero embeddings inside the prefix, then x_0 (as in training).
            pos = torch.arange(prefix, device=device)
            next_emb = torch.cat(
                [
                    pre.hidden.new_zeros(len(stream), prefix - 1, pre.hidden.shape[-1]),
                    self.drafter.embed(out[:, :1].repeat(streams, 1)),
                ],
                dim=1,
            )
            mask = teacher_mask(stream.mask, prefix)
            feat = self.drafter(pre.hidden, next_emb, pos, mask, self._dcache, pos)
            self._draft_calls += 1
            root_feats, root_logits = feat[:, -1], self.drafter.logits(feat[:, -1])

        while bool((committed < n_img).any()):
            active = committed < n_img
            state = _StepState(
                roots=out.gather(1, (committed - 1)[:, None]).squeeze(1),
                root_feats=root_feats,
                root_logits=root_logits,
                committed=committed,
                depth_limit=torch.where(active, n_img - 1 - committed, 0),
                generators=generators,
            )
            calls_before = self._draft_calls
            tree = self.builder.build(self, state)
            tree.valid &= active[:, None] | (torch.arange(tree.size, device=device) == 0)[None]
            hidden, p_nodes, p_relax = self._verify(stream, tcache, tree, committed)
            verdicts: list[Verdict | None] = []
            for b in range(batch):
                extra = {} if p_relax is None else {"p_relax": p_relax[b]}
                verdicts.append(
                    self.accept(tree, b, p_nodes[b], sampling.greedy, generators[b], **extra)
                    if active[b]
                    else None
                )
            roots_at = committed - 1
            self.builder.observe(tree, verdicts, p_nodes, roots_at)
            root_feats, root_logits = self._commit(tree, verdicts, committed, out, hidden, tcache, streams)
            depths = tree.max_depth()
            for b, verdict in enumerate(verdicts):
                if verdict is None:
                    continue
                st = stats[b]
                st.steps += 1
                st.target_forwards += 1
                st.drafter_forwards += self._draft_calls - calls_before
                st.committed_per_step.append(len(verdict.path) + 1)
                st.depth_per_step.append(int(depths[b]))
                st.accept_map.append((int(roots_at[b]), len(verdict.path)))
                st.relaxed_acceptances += verdict.relaxed
            if on_step is not None:
                on_step(tcache, committed, out)
        return DecodeResult(out, stats, time.perf_counter() - start_time)

    def _verify(self, stream: Condition, tcache, tree: DraftTree, committed: torch.Tensor):
        """One target forward over every tree; returns hidden [R, T, H], p [B, T, V] and, at T = 0 for
        rules that ask for it, the softmax of the same filtered logits [B, T, V] (else None)."""
        streams = len(stream) // len(committed)
        base = committed - 1  # image slot of the root
        anc = ancestor_matrix(tree.parents) & tree.valid[:, None, :]
        anc |= torch.eye(tree.size, dtype=torch.bool, device=anc.device)
        width = int(base.max()) + tree.size
        vis = self._visibility(base, base, anc, width)
        # Padding nodes may lie past the image; clamp their (ignored) positions into the RoPE table.
        index = (base[:, None] + tree.depths).clamp_max(self.target.num_image_tokens - 1)
        slots = self.target.prefix_length + base[:, None] + torch.arange(tree.size, device=base.device)
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        result = self.target.forward_tokens(
            stream, rep(tree.tokens), rep(index), tcache, rep(slots), rep(vis)
        )
        p = probabilities(*split_cfg(result.logits, self.sampling), self.sampling)
        p_relax = None
        if self.sampling.greedy and getattr(self.accept, "needs_soft_p", False):
            p_relax = processed_logits(*split_cfg(result.logits, self.sampling), self.sampling).softmax(-1)
        return result.hidden, p, p_relax

    def _commit(self, tree, verdicts, committed, out, hidden, tcache, streams):
        """Write accepted tokens, move their KV into place, and catch the drafter up on them.

        Returns the drafter's feature and logits for the next root (its last catch-up row)."""
        batch, device = len(verdicts), committed.device
        prefix = self.target.prefix_length
        paths = [v.path if v is not None else [] for v in verdicts]
        longest = max(len(p) for p in paths) + 1
        # Root + accepted nodes per prompt in depth order; padded by repeating the last node.
        nodes = torch.tensor(
            [[0, *p] + [p[-1] if p else 0] * (longest - 1 - len(p)) for p in paths], device=device
        )
        counts = torch.tensor([len(p) + 1 for p in paths], device=device)
        active = torch.tensor([v is not None for v in verdicts], device=device)
        base = committed - 1  # image slot of the root
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        # Target KV: node i sits at slot L+base+i; its committed place is L+base+depth (= its index here).
        src = prefix + base[:, None] + nodes
        dst = torch.minimum(prefix + base[:, None] + torch.arange(longest, device=device)[None, :], src)
        tcache.move(torch.arange(batch * streams, device=device), rep(src), rep(dst))
        # The committed tokens: accepted drafts, then the bonus (padding: 0, never read).
        new_tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
        for b, v in enumerate(verdicts):
            if v is None:
                continue
            seq = torch.tensor([*tree.tokens[b, v.path].tolist(), v.bonus], device=device)
            new_tokens[b, : len(seq)] = seq
            out[b, committed[b] : committed[b] + len(seq)] = seq
        if not self.builder.needs_drafter:
            committed += torch.where(active, counts, 0)
            return None, None
        # Drafter rows L+base .. : feature of the root / accepted node, embedding of the token after it.
        feats = hidden.gather(1, rep(nodes)[..., None].expand(-1, -1, hidden.shape[-1]))
        slots = prefix + base[:, None] + torch.arange(longest, device=device)[None, :]
        positions = slots.clamp_max(self.target.max_seq_len - 1)  # padding rows only
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        vis = self._visibility(base, base, causal.expand(batch, -1, -1), int(base.max()) + longest)
        f_hat, logits = self.drafter_rows(feats, new_tokens, positions, slots, vis)
        last = rep(counts - 1)[:, None, None]
        committed += torch.where(active, counts, 0)
        return (
            f_hat.gather(1, last.expand(-1, 1, f_hat.shape[-1])).squeeze(1),
            logits.gather(1, last.expand(-1, 1, logits.shape[-1])).squeeze(1),
        )


class StaticTreeBuilder(DraftTreeBuilder):
    """A fixed tree (EAGLE-1, LANTERN++): top-k children at T = 0; at T > 0 children sampled without
    replacement from q, which is kept for the SpecInfer acceptance rule."""

    def __init__(self, tree: StaticTree) -> None:
        self.tree = tree

    def max_nodes(self) -> int:
        return self.tree.size

    def build(self, engine: SpeculativeEngine, state: _StepState) -> DraftTree:
        t, sampling = self.tree, engine.sampling
        batch, device = len(state.roots), state.roots.device
        size, vocab = t.size, state.root_logits.shape[-1]
        tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
        tokens[:, 0] = state.roots
        parents = torch.tensor(t.parents, device=device).expand(batch, -1).clone()
        depths = torch.tensor(t.depths, device=device).expand(batch, -1).clone()
        valid = depths <= state.depth_limit[:, None]
        q_nodes = torch.zeros(batch, size, vocab, device=device) if not sampling.greedy else None
        feats_of = {0: state.root_feats}  # node → drafter feature predicted at its slot
        logits_of = {0: state.root_logits}
        for depth in range(1, t.depth + 1):
            if depth > int(state.depth_limit.max()):
                break
            level = t.nodes_at(depth)
            for parent in sorted({t.parents[i] for i in level}):
                kids = [i for i in level if t.parents[i] == parent]
                q = engine.draft_probs(logits_of[parent])  # [B, V]
                if sampling.greedy:
                    picks = engine.draft_logits(logits_of[parent]).topk(len(kids), dim=-1).indices
                else:
                    q_nodes[:, parent] = q
                    picks = torch.stack(
                        [
                            torch.multinomial(q[b], len(kids), replacement=False, generator=g)
                            for b, g in enumerate(state.generators)
                        ]
                    )
                for node in kids:
                    tokens[:, node] = picks[:, t.ranks[node]]
            if depth == t.depth or depth >= int(state.depth_limit.max()):
                break
            # One drafter forward over this level to get its nodes' children distributions.
            level_t = torch.tensor(level, device=device)
            parent_feats = torch.stack([feats_of[t.parents[i]] for i in level], dim=1)  # [R, S, H]
            row = (state.committed - 2 + depth).clamp_max(engine.target.num_image_tokens - 1)
            positions = (engine.target.prefix_length + row)[:, None].expand(-1, len(level))
            slots = engine.target.prefix_length + state.committed[:, None] - 1 + (level_t - 1)[None, :]
            anc = ancestor_matrix(parents)[:, level_t][:, :, 1:]  # [B, S, T-1] over non-root nodes
            vis = engine._visibility(
                state.committed - 1, state.committed - 1, anc, int(state.committed.max()) - 1 + size - 1
            )
            f_hat, logits = engine.drafter_rows(parent_feats, tokens[:, level_t], positions, slots, vis)
            for j, node in enumerate(level):
                feats_of[node], logits_of[node] = f_hat[:, j], logits[:, j]
        return DraftTree(tokens, parents, depths, valid, q_nodes, sampled=not sampling.greedy)


@dataclass
class _Node:
    token: int
    parent: int  # index into the row's node list
    depth: int
    score: float  # cumulative log q from the root
    col: int = -1  # drafter scratch column once the node has been expanded


class DynamicTreeBuilder(DraftTreeBuilder):
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

    def max_nodes(self) -> int:
        return max(self.total_tokens, 1 + self.top_k * (self.depth + 1))

    def shape(self, state: _StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth rounds [B], top_k [B]) for this step's trees."""
        batch = len(state.roots)
        return (
            torch.full((batch,), self.depth, dtype=torch.long),
            torch.full((batch,), self.top_k, dtype=torch.long),
        )

    def build(self, engine: SpeculativeEngine, state: _StepState) -> DraftTree:
        batch, device = len(state.roots), state.roots.device
        prefix = engine.target.prefix_length
        rounds, widths = self.shape(state)
        limit = state.depth_limit.cpu()
        logq = engine.draft_probs(state.root_logits).clamp_min(1e-30).log().cpu()  # [B, V]
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
            positions = prefix + (state.committed - 2 + r).clamp_max(engine.target.num_image_tokens - 1)
            vis_full = engine._visibility(base, base, vis.to(device), int(base.max()) + width)
            f_hat, logits = engine.drafter_rows(
                parent_feats, toks, positions[:, None].expand(-1, size), slots, vis_full
            )
            child_logq = engine.draft_probs(logits).clamp_min(1e-30).log().cpu()  # [B, S, V]
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

    def _select(self, nodes: list[list[_Node]], state: _StepState, device) -> DraftTree:
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
