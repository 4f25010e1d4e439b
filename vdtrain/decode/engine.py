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

A *schedule* (``vdtrain.decode.vvs``) may skip a step's verification (VVS): the step commits a drafted
path without the target; ``pending[b]`` of those tokens sit before the next root, unseen by the target,
with drafter rows computed from stale cached features. The next verified step feeds them before its tree
in the same target forward ("post-verification"), which fills their KV in place and lets the catch-up
recompute their drafter rows from true features.
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
from vdtrain.decode.vvs import VerificationSchedule, unverified_path
from vdtrain.drafter import Drafter, teacher_mask
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target


@dataclass
class DecodeStats:
    """Counts for one prompt; the metric definitions of ALGORITHMS.md §10 are derived from them."""

    target_forwards: int = 0  # including the prefill; a skipped step (VVS) costs none
    drafter_forwards: int = 0
    steps: int = 0  # verification steps
    committed_per_step: list[int] = field(default_factory=list)  # accepted drafts + bonus
    depth_per_step: list[int] = field(default_factory=list)  # depth of the drafted tree
    accept_map: list[tuple[int, int]] = field(default_factory=list)  # (image index of the root, accepted)
    relaxed_acceptances: int = 0  # accepted drafts that exact verification would have refused
    skipped_steps: int = 0  # VVS: steps committed without verification
    committed_per_skip: list[int] = field(default_factory=list)  # VVS: tokens each skipped step committed

    @property
    def tau(self) -> float:
        """Mean tokens per *verified* step (skipped steps are not in ``committed_per_step``)."""
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
    """``builder`` drafts the trees, ``accept`` verifies one prompt's tree (default: exact), ``schedule``
    decides which steps are verified (default: all; VVS skips some, ``vdtrain.decode.vvs``)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        builder: DraftTreeBuilder,
        sampling: SamplingConfig,
        accept: Acceptance = verify_exact,
        schedule: VerificationSchedule | None = None,
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
        self.schedule = schedule if schedule is not None else VerificationSchedule()
        if self.schedule.can_skip and not builder.needs_drafter:
            raise ValueError(
                f"{type(builder).__name__} drafts without a drafter: skipping verification (VVS) needs one"
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

    # --- the loop ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, cond: Condition, generators: Sequence[torch.Generator | None], on_step: StepHook | None = None
    ) -> DecodeResult:
        """Image tokens for ``cond``; ``on_step(target_cache, committed, tokens)`` runs after each step.

        With a skipping schedule (VVS) ``self.pending[b]`` counts prompt ``b``'s committed tokens before
        its root that the target has not seen yet; its target KV is valid for the prefix and the first
        ``committed − 1 − pending`` image tokens."""
        target, sampling, schedule = self.target, self.sampling, self.schedule
        start_time = time.perf_counter()
        batch, n_img, prefix = len(cond), target.num_image_tokens, target.prefix_length
        stream = cfg_batch(target, cond, sampling)
        streams = len(stream) // batch
        device = target.token_embedding.weight.device
        extra = self.builder.max_nodes() + 1
        skipping = schedule.can_skip
        self._cond_mask = stream.mask
        self._draft_calls = 0
        # Post-verification feeds [unverified tokens ⊕ tree]: room for a chain as deep as a tree.
        tcache = target.new_cache(len(stream), extra_slots=extra + (extra if skipping else 0))
        use_drafter = self.builder.needs_drafter
        if use_drafter:
            self._dcache = self.drafter.new_cache(len(stream), target.max_seq_len + extra)
        self.builder.reset(batch)
        schedule.reset(batch)
        stats = [DecodeStats() for _ in range(batch)]
        self.pending = torch.zeros(batch, dtype=torch.long, device=device)
        last_skipped, step_no = [False] * batch, [0] * batch

        # Prefill the target, sample x_0 like AR, and catch the drafter up on the prefix.
        pre = target.prefill(stream, tcache)
        out = torch.zeros(batch, n_img, dtype=torch.long, device=device)
        out[:, 0] = next_tokens(*split_cfg(pre.logits[:, -1], sampling), sampling, generators)
        committed = torch.ones(batch, dtype=torch.long, device=device)
        # VVS feature cache: the target's feature at every slot it has verified ([R, L + N, H]).
        self._fcache = None
        if skipping:
            self._fcache = pre.hidden.new_zeros(len(stream), target.max_seq_len, pre.hidden.shape[-1])
            self._fcache[:, :prefix] = pre.hidden
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
            tree_calls = self._draft_calls - calls_before
            skip = [False] * batch
            if skipping:
                has_draft = tree.valid[:, 1:].any(dim=1).tolist()
                for b in range(batch):
                    if not active[b]:
                        continue
                    step_no[b] += 1
                    # Never two skips in a row; a tree without drafts (the last token) needs the target.
                    if not last_skipped[b] and has_draft[b]:
                        skip[b] = schedule.wants_skip(tree, b, step_no[b])
            skipped = torch.tensor(skip, device=device)
            verify = active & ~skipped
            verdicts: list[Verdict | None] = [None] * batch
            commit_calls = 0
            if bool(verify.any()):
                lead = torch.where(verify, self.pending, 0) if skipping else None
                hidden, p_nodes, p_relax = self._verify(stream, tcache, tree, committed, out, lead)
                for b in range(batch):
                    kwargs = {} if p_relax is None else {"p_relax": p_relax[b]}
                    if verify[b]:
                        verdicts[b] = self.accept(
                            tree, b, p_nodes[b], sampling.greedy, generators[b], **kwargs
                        )
                roots_at = committed - 1
                self.builder.observe(tree, verdicts, p_nodes, roots_at)
                calls_before = self._draft_calls
                root_feats, root_logits = self._commit(
                    tree, verdicts, committed, out, hidden, tcache, streams, lead
                )
                commit_calls = self._draft_calls - calls_before
                depths = tree.max_depth()
                for b, verdict in enumerate(verdicts):
                    if verdict is None:
                        continue
                    st = stats[b]
                    st.steps += 1
                    st.target_forwards += 1
                    st.drafter_forwards += tree_calls + commit_calls
                    st.committed_per_step.append(len(verdict.path) + 1)
                    st.depth_per_step.append(int(depths[b]))
                    st.accept_map.append((int(roots_at[b]), len(verdict.path)))
                    st.relaxed_acceptances += verdict.relaxed
            if any(skip):
                picks = {b: unverified_path(tree, b, generators[b]) for b in range(batch) if skip[b]}
                calls_before = self._draft_calls
                root_feats, root_logits = self._commit_unverified(
                    tree, picks, committed, out, streams, root_feats, root_logits
                )
                for b, nodes in picks.items():
                    st = stats[b]
                    st.skipped_steps += 1
                    st.committed_per_skip.append(len(nodes))
                    st.drafter_forwards += tree_calls + self._draft_calls - calls_before
                    self.pending[b] = len(nodes)
            if skipping:
                for b in range(batch):
                    if verify[b]:
                        self.pending[b] = 0
                    if active[b]:
                        last_skipped[b] = skip[b]
            if on_step is not None:
                on_step(tcache, committed, out)
        return DecodeResult(out, stats, time.perf_counter() - start_time)

    def _verify(self, stream: Condition, tcache, tree: DraftTree, committed, out, lead=None):
        """One target forward over every tree; returns hidden [R, S, H], p [B, T, V] and, at T = 0 for
        rules that ask for it, the softmax of the same filtered logits [B, T, V] (else None).

        ``lead[b]`` (VVS post-verification) unverified committed tokens before prompt ``b``'s root are fed
        first: row ``b`` is [those tokens ⊕ its tree ⊕ padding]; ``hidden`` covers all ``S`` rows, ``p``
        the tree nodes. Without a lead (or an all-zero one) ``S = T`` and this is the plain forward."""
        if lead is None or not bool(lead.any()):
            return self._verify_tree(stream, tcache, tree, committed)
        target, streams = self.target, len(stream) // len(committed)
        batch, size, chain = len(committed), tree.size, int(lead.max())
        width_rows, device = chain + size, committed.device
        base = committed - 1 - lead  # image index of the first token the target has not seen
        anc = ancestor_matrix(tree.parents) & tree.valid[:, None, :]
        anc |= torch.eye(size, dtype=torch.bool, device=device)
        # Row b: chain (causal) at 0 .. u-1, tree (sees the whole chain, its ancestors, itself) at
        # u .. u+T-1, padding (sees itself; its slots lie past the tree, never read) after.
        vis = torch.zeros(batch, width_rows, width_rows, dtype=torch.bool, device=device)
        tokens = torch.zeros(batch, width_rows, dtype=torch.long, device=device)
        index = base[:, None] + torch.arange(width_rows, device=device)[None, :]
        for b, u in enumerate(lead.tolist()):
            vis[b, :u, :u] = torch.ones(u, u, dtype=torch.bool, device=device).tril()
            vis[b, u : u + size, :u] = True
            vis[b, u : u + size, u : u + size] = anc[b]
            pad = torch.arange(u + size, width_rows, device=device)
            vis[b, pad, pad] = True
            tokens[b, :u] = out[b, base[b] : base[b] + u]
            tokens[b, u : u + size] = tree.tokens[b]
            index[b, u : u + size] = base[b] + u + tree.depths[b]
        index = index.clamp_max(target.num_image_tokens - 1)
        slots = target.prefix_length + base[:, None] + torch.arange(width_rows, device=device)[None, :]
        vis = self._visibility(base, base, vis, int(base.max()) + width_rows)
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        result = target.forward_tokens(stream, rep(tokens), rep(index), tcache, rep(slots), rep(vis))
        rows = rep(lead[:, None] + torch.arange(size, device=device)[None, :])
        logits = result.logits.gather(1, rows[..., None].expand(-1, -1, result.logits.shape[-1]))
        p = probabilities(*split_cfg(logits, self.sampling), self.sampling)
        p_relax = None
        if self.sampling.greedy and getattr(self.accept, "needs_soft_p", False):
            p_relax = processed_logits(*split_cfg(logits, self.sampling), self.sampling).softmax(-1)
        return result.hidden, p, p_relax

    def _verify_tree(self, stream: Condition, tcache, tree: DraftTree, committed: torch.Tensor):
        """The plain verification forward: the trees alone (their roots are the only unseen tokens)."""
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

    def _commit(self, tree, verdicts, committed, out, hidden, tcache, streams, lead=None):
        """Write accepted tokens, move their KV into place, and catch the drafter up on them.

        With a ``lead`` (VVS post-verification) the rows of the unverified tokens before the root, at the
        start of ``hidden``, are caught up too: their KV is already in place, their drafter rows (computed
        from stale features when they were committed) are recomputed from the target's true features,
        and the feature cache gets their features. Returns the drafter's feature and logits for the next
        root (its last catch-up row)."""
        batch, device = len(verdicts), committed.device
        prefix = self.target.prefix_length
        paths = [v.path if v is not None else [] for v in verdicts]
        leads = [0] * batch if lead is None else lead.tolist()
        # Rows of ``hidden`` to commit per prompt: the lead, then root + accepted nodes in depth order.
        seqs = [list(range(u)) + [u + n for n in (0, *p)] for u, p in zip(leads, paths, strict=True)]
        longest = max(len(q) for q in seqs)
        # Padded by repeating the last row.
        nodes = torch.tensor([q + [q[-1]] * (longest - len(q)) for q in seqs], device=device)
        counts = torch.tensor([len(p) + 1 for p in paths], device=device)  # newly committed tokens
        rows = torch.tensor([len(q) for q in seqs], device=device)  # caught-up rows
        active = torch.tensor([v is not None for v in verdicts], device=device)
        base = committed - 1 if lead is None else committed - 1 - lead  # image slot of the first row
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        # Target KV: row i sits at slot L+base+i; its committed place is L+base+(lead+depth) (<= i).
        src = prefix + base[:, None] + nodes
        dst = torch.minimum(prefix + base[:, None] + torch.arange(longest, device=device)[None, :], src)
        tcache.move(torch.arange(batch * streams, device=device), rep(src), rep(dst))
        # Each row's next token: the rest of the lead, then the accepted drafts, then the bonus.
        new_tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
        for b, v in enumerate(verdicts):
            if v is None:
                continue
            seq = torch.tensor([*tree.tokens[b, v.path].tolist(), v.bonus], device=device)
            u = leads[b]
            if u:
                new_tokens[b, :u] = out[b, base[b] + 1 : committed[b]]
            new_tokens[b, u : u + len(seq)] = seq
            out[b, committed[b] : committed[b] + len(seq)] = seq
        if not self.builder.needs_drafter:
            committed += torch.where(active, counts, 0)
            return None, None
        # Drafter rows L+base .. : feature of the row's token, embedding of the token after it.
        feats = hidden.gather(1, rep(nodes)[..., None].expand(-1, -1, hidden.shape[-1]))
        if self._fcache is not None:
            for b in range(batch):
                if verdicts[b] is not None:
                    n, lo = int(rows[b]), prefix + int(base[b])
                    self._fcache[b::batch, lo : lo + n] = feats[b::batch, :n]
        slots = prefix + base[:, None] + torch.arange(longest, device=device)[None, :]
        positions = slots.clamp_max(self.target.max_seq_len - 1)  # padding rows only
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        vis = self._visibility(base, base, causal.expand(batch, -1, -1), int(base.max()) + longest)
        f_hat, logits = self.drafter_rows(feats, new_tokens, positions, slots, vis)
        last = rep(rows - 1)[:, None, None]
        committed += torch.where(active, counts, 0)
        return (
            f_hat.gather(1, last.expand(-1, 1, f_hat.shape[-1])).squeeze(1),
            logits.gather(1, last.expand(-1, 1, logits.shape[-1])).squeeze(1),
        )

    def _commit_unverified(self, tree, picks, committed, out, streams, root_feats, root_logits):
        """VVS skipped step: commit ``picks[b]`` (tree nodes, depth 1 first) without the target.

        The drafter rows of the new tokens' predecessors (the old root and the picked drafts but the
        last) get *stale* features: the most recent cached target features, as many as tokens committed
        (VVS §4.3). With γ tokens committed after ``m``, row ``L+m−1+j`` (j < γ) pairs the cached feature
        of slot ``L+m−1−γ+j`` with the embedding of the token at slot ``L+m+j``; slots before 0 (a skip
        right after the prefill, γ > L) read slot 0. The target KV is left alone: the next verified step
        post-verifies the tokens. Returns the root feature/logits with the skipped prompts' rows replaced.
        """
        batch, device, prefix = len(committed), committed.device, self.target.prefix_length
        longest = max(len(nodes) for nodes in picks.values())
        base = committed - 1  # image slot of the root, the first row's token
        feats = self._fcache.new_zeros(batch * streams, longest, self._fcache.shape[-1])
        new_tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
        for b, nodes in picks.items():
            g, m = len(nodes), int(committed[b])
            seq = tree.tokens[b, nodes]
            out[b, m : m + g] = seq
            new_tokens[b, :g] = seq
            stale = (prefix + m - 1 - g + torch.arange(g, device=device)).clamp_min(0)
            feats[b::batch, :g] = self._fcache[b::batch][:, stale]
        slots = prefix + base[:, None] + torch.arange(longest, device=device)[None, :]
        positions = slots.clamp_max(self.target.max_seq_len - 1)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        vis = self._visibility(base, base, causal.expand(batch, -1, -1), int(base.max()) + longest)
        f_hat, logits = self.drafter_rows(feats, new_tokens, positions, slots, vis)
        root_feats, root_logits = root_feats.clone(), root_logits.clone()
        for b, nodes in picks.items():
            g = len(nodes)
            root_feats[b::batch] = f_hat[b::batch, g - 1]
            root_logits[b::batch] = logits[b::batch, g - 1]
            committed[b] += g
        return root_feats, root_logits


class StaticTreeBuilder(DraftTreeBuilder):
    """A fixed tree (EAGLE-1, LANTERN++): top-k children at T = 0; at T > 0 children sampled without
    replacement from q, which is kept for the SpecInfer acceptance rule.

    A node drafts at most as many children as q has tokens (the vocabulary at T = 0): a child drawn past
    q's support would be judged with q = 0 and accepted for free, so the ranks beyond it stay undrafted
    (``valid`` False) and the walk tries only real draws, in the order drawn. Children are drawn only for
    rows whose tree reaches their depth, so a prompt spends its generator the same way in any batch.
    """

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
        valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
        valid[:, 0] = True
        limits = state.depth_limit.tolist()
        q_nodes = torch.zeros(batch, size, vocab, device=device) if not sampling.greedy else None
        feats_of = {0: state.root_feats}  # node → drafter feature predicted at its slot
        logits_of = {0: state.root_logits}
        for depth in range(1, t.depth + 1):
            if depth > max(limits):
                break
            level = t.nodes_at(depth)
            for parent in sorted({t.parents[i] for i in level}):
                kids = [i for i in level if t.parents[i] == parent]  # rank order
                rows = [b for b in range(batch) if depth <= limits[b] and bool(valid[b, parent])]
                if not rows:
                    continue
                if sampling.greedy:
                    top = engine.draft_logits(logits_of[parent]).topk(min(len(kids), vocab), dim=-1)
                    drawn = {b: top.indices[b] for b in rows}
                else:
                    q = engine.draft_probs(logits_of[parent])  # [B, V]
                    q_nodes[:, parent] = q
                    drawn = {}
                    for b in rows:
                        n = min(len(kids), int((q[b] > 0).sum()))
                        drawn[b] = torch.multinomial(
                            q[b], n, replacement=False, generator=state.generators[b]
                        )
                for b, picks in drawn.items():
                    nodes = torch.tensor(kids[: len(picks)], device=device)
                    tokens[b, nodes] = picks
                    valid[b, nodes] = True
            if depth == t.depth or depth >= max(limits):
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
        widths = widths.clamp_max(state.root_logits.shape[-1])  # no more children than tokens
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
