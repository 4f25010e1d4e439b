"""The speculative decoding loop: draft a tree → verify it in one target forward → accept → commit.

Drafting (``vdtrain.decode.builders``), acceptance (``vdtrain.decode.acceptance``) and the verification
schedule (``vdtrain.decode.vvs``) are separate parts; the loop only moves tokens, features and KV entries
between them. It runs a batch of prompts, each with its own progress, with CFG as a batch of two streams
(conditional rows, then null rows) for both the target and the drafter.

Bookkeeping per prompt ``b`` with ``m`` committed image tokens ``x_0 .. x_{m-1}``:

- the *root* of the next tree is ``x_{m-1}``: committed but not yet seen by the target;
- target KV slots ``0 .. L+m-2`` are valid (prefix + ``x_0 .. x_{m-2}``); the tree goes to slots
  ``L+m-1 ..`` (node ``i`` at ``L+m-1+i``) and accepted nodes are moved down to ``L+m-1+depth``;
- drafter row ``s`` pairs the target feature ``f_s`` with the embedding of the token at slot ``s+1``
  (``vdtrain.drafter``); rows ``0 .. L+m-2`` are committed, and tree nodes at depth ``d`` take row
  position ``L+m-2+d`` in scratch slots after them. Expansion rows are recomputed from true target
  features once their tokens are accepted ("catch-up").

Speed. Every tensor in a step has a shape fixed by the method (tree size, depth bound, image length),
never by the batch's progress: attention masks span the whole image plus scratch, acceptance runs on
the whole batch at once (``accept_batch``) and commit is a handful of gathers and scatters. The loop
itself reads the device once per step (are prompts left?); statistics stay on the device until the
end. Randomness comes from ``RowRandom`` (counter-based, per prompt), so prompt ``i`` draws the same
numbers whatever it is batched with, without one op per row. The tensor work between two forwards is one
step kernel each (``vdtrain.decode.kernels``: ``drafter_inputs``, ``_tree_inputs``, ``_judge``,
``_commit_rows`` and the builders' own), which ``compile=true`` runs as compiled graphs.

A *schedule* (``vdtrain.decode.vvs``) may skip a step's verification (VVS): the step commits a drafted
path without the target; ``run.pending[b]`` of those tokens sit before the next root, unseen by the
target, with drafter rows computed from stale cached features. The next verified step feeds them before
its tree in the same target forward ("post-verification"), which fills their KV in place and lets the
catch-up recompute their drafter rows from true features. The schedule plans every prompt at once
(``VerificationSchedule.plan``, one read of the device), picks the skipped paths as tensors, and owns
both hooks the loop calls: ``verify`` (the step's target forward, post-verified tokens first) and
``commit_skipped``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vdtrain.decode.acceptance import EXACT, BatchVerdict, Rule, accept_batch
from vdtrain.decode.builders.base import DraftTreeBuilder, StepState
from vdtrain.decode.graphs import DeviceLog, Recorder, SplitStepGraph, StepGraph
from vdtrain.decode.kernels import compiled_step_kernels, step_kernel
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.sampling import (
    SamplingConfig,
    cfg_batch,
    distribution,
    next_tokens,
    probabilities,
    processed_logits,
    split_cfg,
)
from vdtrain.decode.trees import DraftTree, ancestor_matrix
from vdtrain.decode.vvs import StepPlan, VerificationSchedule
from vdtrain.drafter import Drafter
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target, prefix_and_image_mask


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


class ImageColumns(NamedTuple):
    """Where rows' visibility lands among the image columns (``SpeculativeEngine.image_columns``)."""

    prior: torch.Tensor  # [B, W] committed columns every row sees
    place: torch.Tensor  # [B, S'] the columns of the block

    def rows(self, block_vis: torch.Tensor) -> torch.Tensor:
        """Rows' visibility [B, S, W] from their visibility within the block [B, S, S']."""
        batch, steps, _ = block_vis.shape
        vis = self.prior[:, None, :].expand(batch, steps, -1).clone()
        return vis.scatter_(2, self.place[:, None, :].expand(batch, steps, -1), block_vis)


class DrafterRows(NamedTuple):
    """A drafter forward's inputs for every CFG stream (``SpeculativeEngine.drafter_inputs``)."""

    embeds: torch.Tensor  # [R, S, H] embeddings of the next tokens
    positions: torch.Tensor  # [R, S, ·] RoPE positions
    mask: torch.Tensor  # [R, 1, S, L + K] attention mask
    slots: torch.Tensor  # [R, S] drafter cache slots
    predicts: torch.Tensor  # [R, S] image index each row's logits predict


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, N]
    stats: list[DecodeStats]
    seconds: float


StepHook = Callable[[KVCache, torch.Tensor, torch.Tensor], None]


LOG_FIELDS = ("verified", "skipped", "committed", "depth", "root", "accepted", "relaxed")


class StepCalls(NamedTuple):
    """A step's drafter forwards, host ints (a recorded step replays the same calls)."""

    verify: int  # what a verified step cost (tree + catch-up)
    skip: int  # what a skipped step cost (tree + stale catch-up)


@dataclass
class DecodeRun:
    """Everything one ``generate`` call changes: caches, counters, randomness, the output buffer.

    ``out`` has ``width`` spare columns past the image so commit can scatter fixed-size blocks. A step
    changes the tensors here in place and never rebinds them, so it can be recorded once as a CUDA
    graph and replayed (``vdtrain.decode.graphs``)."""

    stream: Condition  # the CFG batch (cond rows, then null rows)
    batch: int
    streams: int
    generators: Sequence[torch.Generator | None]
    tcache: KVCache
    dcache: KVCache | None
    out: torch.Tensor  # [B, N + spare] committed tokens
    committed: torch.Tensor  # [B]
    rng: RowRandom
    chain: int  # room for post-verified tokens before a tree (VVS), else 0
    pending: torch.Tensor  # [B] VVS: committed tokens before the root the target has not seen
    fcache: torch.Tensor | None  # VVS: [R, L + N + spare, H] target feature at every verified slot
    root_feats: torch.Tensor | None  # [R, H] the drafter's feature for the next root (None: no drafter)
    root_logits: torch.Tensor | None  # [R, V] the drafter's logits for the next root's children
    log: DeviceLog  # per step: [len(LOG_FIELDS), B] counts
    draft_calls: int = 0
    calls: list[StepCalls] = field(default_factory=list)  # per step

    def restart(self, stream: Condition, generators: Sequence[torch.Generator | None]) -> None:
        """A new decode of the same shapes on these tensors, reset in place (a recorded step replays on
        them); the prefill then fills the caches and the root's drafter feature and logits."""
        self.stream.features.copy_(stream.features)
        self.stream.mask.copy_(stream.mask)
        self.generators = generators
        for cache in (self.tcache, self.dcache):
            if cache is not None:
                cache.k.zero_()
                cache.v.zero_()
        self.out.zero_()
        self.pending.zero_()
        if self.fcache is not None:
            self.fcache.zero_()
        self.log.clear()
        self.committed.fill_(1)
        self.rng.reseed(RowRandom.seeds_of(generators, self.out.device))
        self.draft_calls, self.calls = 0, []

    def verified_steps(self) -> list[bool]:
        """Per step so far: whether any prompt was verified (a VVS step may skip the target)."""
        return self.log.rows[: len(self.calls), LOG_FIELDS.index("verified")].any(1).tolist()


class Drafted(NamedTuple):
    """A step's first part (``SpeculativeEngine._draft``): the tree and the plan, flags unread."""

    tree: DraftTree
    plan: StepPlan
    active: torch.Tensor  # [B] prompts still decoding at the step's start
    roots_at: torch.Tensor  # [B] image index of each root
    depth: torch.Tensor  # [B] depth of the drafted tree
    calls: int  # drafter forwards the tree took


class _Recorded(NamedTuple):
    """The last decode whose step was recorded: a decode of the same shapes replays it on its run."""

    key: tuple
    run: DecodeRun
    step: Callable[[], StepCalls]  # a StepGraph, or a SplitStepGraph (VVS)


class SpeculativeEngine:
    """``builder`` drafts the trees, ``accept`` verifies them (default: exact), ``schedule`` decides which
    steps are verified (default: all; VVS skips some, ``vdtrain.decode.vvs``)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        builder: DraftTreeBuilder,
        sampling: SamplingConfig,
        accept: Rule = EXACT,
        schedule: VerificationSchedule | None = None,
    ) -> None:
        if drafter is not None:
            drafter.attach(target)  # refuses a drafter trained for another target
        elif builder.needs_drafter:
            raise ValueError(f"{type(builder).__name__} drafts with a drafter model: pass one")
        builder.check_vocabulary(target.vocab_size)
        if not isinstance(accept, Rule):
            raise TypeError(f"accept must be an acceptance Rule (vdtrain.decode.acceptance), got {accept!r}")
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
        self.run: DecodeRun | None = None
        self._recorded: _Recorded | None = None

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
    def image_columns(committed_cols: torch.Tensor, block_cols: torch.Tensor, block: int, width: int):
        """Per row: image columns ``< committed_cols[b]`` visible, and a block of ``block`` columns at
        ``block_cols[b] ..`` whose visibility each row brings; ``width`` columns in all."""
        device = committed_cols.device
        cols = torch.arange(width, device=device)
        place = block_cols[:, None] + torch.arange(block, device=device)[None, :]
        return ImageColumns(cols[None, :] < committed_cols[:, None], place)

    @staticmethod
    def _visibility(
        committed_cols: torch.Tensor, tree_cols: torch.Tensor, tree_vis: torch.Tensor, width: int
    ):
        """Per row: image columns ``< committed_cols[b]`` visible, plus ``tree_vis`` [B, S, S'] placed at
        columns ``tree_cols[b] ..``; ``width`` columns in all."""
        columns = SpeculativeEngine.image_columns(committed_cols, tree_cols, tree_vis.shape[2], width)
        return columns.rows(tree_vis)

    # --- drafter ---------------------------------------------------------------------------------
    @step_kernel
    def drafter_inputs(
        self,
        tokens: torch.Tensor | None,
        token_index: torch.Tensor,
        slots: torch.Tensor,
        image_vis: torch.Tensor,
        next_embeds: torch.Tensor | None = None,
    ) -> DrafterRows:
        """The drafter's inputs for rows pairing features with the next ``tokens`` [B, S] at image indices
        ``token_index`` [B, S], for every CFG stream. A row sits at the RoPE position of its feature's
        slot, ``rope_positions(token_index - 1)``."""
        run, target = self.run, self.target
        streams = run.streams
        if next_embeds is None:
            next_embeds = self.drafter.embed(tokens.repeat(streams, 1))
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        mask = prefix_and_image_mask(run.stream.mask, rep(image_vis))
        positions = rep(target.rope_positions(token_index - 1))
        return DrafterRows(next_embeds, positions, mask, rep(slots), rep(token_index + 1))

    def drafter_forward(self, feats: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [R, S, H] through the drafter at ``rows`` → (f̂ [R, S, H], logits [R, S, V] carrying
        the target's forced tokens)."""
        run = self.run
        out = self.drafter(feats, rows.embeds, rows.positions, rows.mask, run.dcache, rows.slots)
        run.draft_calls += 1
        return out, self.target.constrain_logits(self.drafter.logits(out), rows.predicts)

    def drafter_rows(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor | None,
        token_index: torch.Tensor,
        slots: torch.Tensor,
        image_vis: torch.Tensor,
        next_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter rows (features [R, S, H] + the next tokens [B, S], at image indices ``token_index``
        [B, S]) → (f̂ [R, S, H], logits [R, S, V] for indices ``token_index + 1``)."""
        return self.drafter_forward(
            feats, self.drafter_inputs(tokens, token_index, slots, image_vis, next_embeds)
        )

    # --- the loop ---------------------------------------------------------------------------------
    def generate(
        self, cond: Condition, generators: Sequence[torch.Generator | None], on_step: StepHook | None = None
    ) -> DecodeResult:
        """Image tokens for ``cond``; ``on_step(target_cache, committed, tokens)`` runs after each step.
        The step kernels run compiled when the target asks for it (``Target.compile_steps``)."""
        backend = self.target.compile_steps
        with compiled_step_kernels(backend is not None, backend or "inductor"):
            return self._generate(cond, generators, on_step)

    @torch.no_grad()
    def _generate(
        self, cond: Condition, generators: Sequence[torch.Generator | None], on_step: StepHook | None
    ) -> DecodeResult:
        target, sampling, schedule = self.target, self.sampling, self.schedule
        start_time = time.perf_counter()
        batch, n_img, prefix = len(cond), target.num_image_tokens, target.prefix_length
        stream = cfg_batch(target, cond, sampling)
        streams = len(stream) // batch
        device = target.token_embedding.weight.device
        extra = self.builder.max_nodes() + 1
        skipping = schedule.can_skip
        chain = extra if skipping else 0  # post-verification feeds [unverified tokens ⊕ tree]
        use_drafter = self.builder.needs_drafter
        recorder = self.recorder
        key = (batch, *((t.shape, t.dtype) for t in (stream.features, stream.mask)), device)
        if recorder is not None and self._recorded is not None and self._recorded.key == key:
            run, step = self._recorded.run, self._recorded.step  # replay the step recorded before
            run.restart(stream, generators)
        else:
            run, step = self._new_run(stream, batch, generators, chain), self._step
            if recorder is not None:
                if schedule.can_skip:  # draft and plan, read the plan's flags, then the rest per flags
                    flags = lambda d: d.plan.flag_values()  # noqa: E731
                    finish = lambda d, values: self._finish(d, d.plan.with_flags(values))  # noqa: E731
                    step = SplitStepGraph(self._draft, flags, finish, recorder, device)
                else:
                    step = StepGraph(step, recorder, device)
                self._recorded = _Recorded(key, run, step)
        self.run = run
        self.builder.reset(batch)
        schedule.reset(batch, device)

        # Prefill the target, sample x_0 like AR, and catch the drafter up on the prefix.
        stream = run.stream
        pre = target.prefill(stream, run.tcache)
        run.out[:, 0] = next_tokens(*split_cfg(pre.logits[:, -1], sampling), sampling, generators)
        if skipping:
            if run.fcache is None:  # a reused run keeps its own, zeroed by ``restart``
                run.fcache = pre.hidden.new_zeros(
                    len(stream), target.max_seq_len + extra + chain, pre.hidden.shape[-1]
                )
            run.fcache[:, :prefix] = pre.hidden
        if use_drafter:
            # Drafter rows 0 .. L-1: zero embeddings inside the prefix, then x_0 (as in training).
            feat = self.drafter.forward_prefix(
                pre.hidden, run.out[:, :1].repeat(streams, 1), stream.mask, run.dcache
            )
            run.draft_calls += 1
            feats = feat[:, -1]
            logits = target.constrain_logits(
                self.drafter.logits(feats), torch.ones_like(feats[:, 0], dtype=torch.long)
            )
            if run.root_feats is None:
                run.root_feats, run.root_logits = feats.contiguous(), logits.contiguous()
            else:  # a reused run: in place
                run.root_feats.copy_(feats)
                run.root_logits.copy_(logits)
        prefill_calls = run.draft_calls

        while bool((run.committed < n_img).any()):  # the loop's one read of the device
            run.calls.append(step())
            if on_step is not None:
                on_step(run.tcache, run.committed, run.out[:, :n_img])
        tokens = run.out[:, :n_img].clone()
        return DecodeResult(tokens, self._stats(prefill_calls), time.perf_counter() - start_time)

    def _new_run(
        self, stream: Condition, batch: int, generators: Sequence[torch.Generator | None], chain: int
    ) -> DecodeRun:
        """Fresh buffers and caches for a decode of ``batch`` prompts (``chain``: VVS's room for
        post-verified tokens before a tree)."""
        target, device = self.target, self.target.token_embedding.weight.device
        n_img, extra = target.num_image_tokens, self.builder.max_nodes() + 1
        long = {"dtype": torch.long, "device": device}
        return DecodeRun(
            stream=stream,
            batch=batch,
            streams=len(stream) // batch,
            generators=generators,
            tcache=target.new_cache(len(stream), extra_slots=extra + chain),
            dcache=self.drafter.new_cache(len(stream), target.max_seq_len + extra + chain)
            if self.builder.needs_drafter
            else None,
            out=torch.zeros(batch, n_img + extra + chain, **long),
            committed=torch.ones(batch, **long),
            rng=RowRandom.from_generators(generators, device),
            chain=chain,
            pending=torch.zeros(batch, **long),
            fcache=None,
            root_feats=None,
            root_logits=None,
            log=DeviceLog(n_img, len(LOG_FIELDS), batch, device=device),  # a step commits >= 1 token
        )

    @property
    def recorder(self) -> Recorder | None:
        """How to record the step once and replay it (``Target.step_recorder``: a CUDA graph, set by
        ``compile_decoding`` on a GPU), when this method's builder allows it: fixed shapes and no host
        state across steps (``DraftTreeBuilder.graph_safe``). None: every step runs eagerly."""
        return self.target.step_recorder if self.builder.graph_safe else None

    def _step(self) -> StepCalls:
        """One step for the whole batch: draft, verify, accept, commit. It reads and writes the run's
        tensors in place and appends its counts to ``run.log`` (a ``DeviceLog``), so a recorded step
        replays correctly; what it returns (drafter calls) is the same every step for a graph-safe method.
        A skipping schedule's plan is read from the device between its two parts (``_draft``, then
        ``_finish``), which are recorded separately (``SplitStepGraph``)."""
        drafted = self._draft()
        return self._finish(drafted, drafted.plan.read())

    def _draft(self) -> Drafted:
        """The step up to the schedule's plan, its flags still on the device."""
        run, n_img = self.run, self.target.num_image_tokens
        committed, device = run.committed, run.committed.device
        active = committed < n_img
        state = StepState(
            roots=run.out.gather(1, (committed - 1)[:, None]).squeeze(1),
            root_feats=run.root_feats,
            root_logits=run.root_logits,
            committed=committed,
            depth_limit=torch.where(active, n_img - 1 - committed, 0),
            generators=run.generators,
            rng=run.rng,
        )
        calls_before = run.draft_calls
        tree = self.builder.build(self, state)
        tree.valid = tree.valid & (active[:, None] | (torch.arange(tree.size, device=device) == 0)[None])
        plan = self.schedule.plan_on_device(tree, active, committed, run.pending)
        return Drafted(tree, plan, active, committed - 1, tree.max_depth(), run.draft_calls - calls_before)

    def _finish(self, drafted: Drafted, plan: StepPlan) -> StepCalls:
        """The rest of the step, for the ``plan`` with its flags read: verify, accept and commit the
        verified prompts, commit the skipping ones' paths, log."""
        run, schedule = self.run, self.schedule
        tree, active, roots_at = drafted.tree, drafted.active, drafted.roots_at
        committed, verify = run.committed, plan.verify
        verdict = None
        commit_calls = 0
        root_feats, root_logits = run.root_feats, run.root_logits
        if plan.any_verify:  # every prompt skipping: no target forward
            hidden, logits = schedule.verify(self, tree, plan)
            p_nodes, verdict = self._judge(tree, logits)
            self.builder.observe(tree, verdict, verify, p_nodes, roots_at)
            calls_before = run.draft_calls
            root_feats, root_logits = self._commit(
                tree, verdict, verify, hidden, plan.lead, root_feats, root_logits
            )
            commit_calls = run.draft_calls - calls_before
        skip_calls = drafted.calls
        skip_committed = torch.zeros_like(committed)
        if plan.any_skip:
            calls_before = run.draft_calls
            root_feats, root_logits, skip_committed = schedule.commit_skipped(
                self, tree, plan, root_feats, root_logits
            )
            skip_calls += run.draft_calls - calls_before
        if run.root_feats is not None:
            run.root_feats.copy_(root_feats)
            run.root_logits.copy_(root_logits)
        if plan.skipped is not None:
            run.pending.copy_(torch.where(plan.skipped, skip_committed, torch.where(verify, 0, run.pending)))
        self._log_step(plan, verdict, skip_committed, drafted.depth, roots_at)
        run.rng.advance(active)
        return StepCalls(drafted.calls + commit_calls, skip_calls)

    def _log_step(self, plan, verdict: BatchVerdict | None, skip_committed, depth, roots_at) -> None:
        """This step's per-prompt counts (``LOG_FIELDS``) appended to ``run.log``."""
        run, verify = self.run, plan.verify
        none = torch.zeros_like(run.committed)
        accepted = verdict.accepted if verdict is not None else none
        skipped = plan.skipped if plan.skipped is not None else torch.zeros_like(verify)
        run.log.append(
            torch.stack(
                [
                    verify.long(),
                    skipped.long(),
                    torch.where(verify, accepted + 1, skip_committed),
                    depth,
                    roots_at,
                    accepted,
                    verdict.relaxed if verdict is not None else none,
                ]
            )
        )

    def _stats(self, prefill_calls: int) -> list[DecodeStats]:
        """Per-prompt ``DecodeStats`` from the step log: one read of the device for the whole decode."""
        run, batch = self.run, self.run.batch
        stats = [DecodeStats(target_forwards=1, drafter_forwards=prefill_calls) for _ in range(batch)]
        table = run.log.tolist(len(run.calls))
        for calls, rows in zip(run.calls, table, strict=True):
            for b in range(batch):
                verified, skipped, count, depth, root, accepted, relaxed = (row[b] for row in rows)
                st = stats[b]
                if verified:
                    st.steps += 1
                    st.target_forwards += 1
                    st.drafter_forwards += calls.verify
                    st.committed_per_step.append(count)
                    st.depth_per_step.append(depth)
                    st.accept_map.append((root, accepted))
                    st.relaxed_acceptances += relaxed
                elif skipped:
                    st.skipped_steps += 1
                    st.committed_per_skip.append(count)
                    st.drafter_forwards += calls.skip
        return stats

    # --- verification ------------------------------------------------------------------------------
    @step_kernel
    def _judge(self, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, BatchVerdict]:
        """The target's logits at the tree nodes [R, T, V] → (p [B, T, V], every row's verdict). At T = 0
        rules that ask for it also see the softmax of the same filtered logits."""
        processed = processed_logits(*split_cfg(logits, self.sampling), self.sampling)
        p_nodes = distribution(processed, self.sampling)
        p_relax = processed.softmax(-1) if self.sampling.greedy and self.accept.needs_soft_p else None
        return p_nodes, self._accept(tree, p_nodes, p_relax)

    def _accept(self, tree: DraftTree, p_nodes: torch.Tensor, p_relax: torch.Tensor | None) -> BatchVerdict:
        """Every row's verdict at once, with this step's per-prompt uniforms."""
        batch, size = tree.tokens.shape
        if self.sampling.greedy:  # no draws: the argmax decides
            u_accept = p_nodes.new_zeros(batch, size, dtype=torch.float64)
            u_bonus = p_nodes.new_zeros(batch, dtype=torch.float64)
        else:
            u_accept, u_bonus = self.run.rng.uniforms((Purpose.ACCEPT, (size,)), (Purpose.BONUS, ()))
        return accept_batch(self.accept, tree, p_nodes, self.sampling.greedy, u_accept, u_bonus, p_relax)

    @step_kernel
    def _tree_inputs(self, tree: DraftTree):
        """The plain verification forward's rows (tokens, image indices, slots, visibility), every stream:
        the trees alone (their roots are the only unseen tokens)."""
        run, target = self.run, self.target
        base = run.committed - 1  # image slot of the root
        anc = ancestor_matrix(tree.parents, tree.depth_bound) & tree.valid[:, None, :]
        anc |= torch.eye(tree.size, dtype=torch.bool, device=anc.device)
        vis = self._visibility(base, base, anc, target.num_image_tokens - 1 + tree.size)
        # Padding nodes may lie past the image; clamp their (ignored) positions into the RoPE table.
        index = (base[:, None] + tree.depths).clamp_max(target.num_image_tokens - 1)
        slots = target.image_slot(base[:, None] + torch.arange(tree.size, device=base.device))
        rep = lambda t: t.repeat(run.streams, *([1] * (t.dim() - 1)))  # noqa: E731
        return rep(tree.tokens), rep(index), rep(slots), rep(vis)

    def _verify_tree(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain verification forward → (hidden [R, T, H], logits [R, T, V])."""
        tokens, index, slots, vis = self._tree_inputs(tree)
        result = self.target.forward_tokens(self.run.stream, tokens, index, self.run.tcache, slots, vis)
        return result.hidden, result.logits

    # --- commit ------------------------------------------------------------------------------------
    def _commit(self, tree, verdict: BatchVerdict, verify, hidden, lead, root_feats, root_logits):
        """Write accepted tokens, move their KV into place, and catch the drafter up on them, for the
        rows where ``verify`` is set, in fixed shapes: ``W = chain + 1 + D`` rows per prompt.

        With a ``lead`` (VVS post-verification) the rows of the unverified tokens before the root, at the
        start of ``hidden``, are caught up too: their KV is already in place, their drafter rows (computed
        from stale features when they were committed) are recomputed from the target's true features,
        and the feature cache gets their features. Returns the drafter's feature and logits for the next
        root (its last catch-up row), unchanged for the rows not verified."""
        run = self.run
        cache_rows, src, dst, counts, last, catch_up = self._commit_rows(tree, verdict, verify, hidden, lead)
        run.tcache.move(cache_rows, src, dst)
        run.committed += counts
        if catch_up is None:
            return None, None
        f_hat, logits = self.drafter_forward(*catch_up)
        return self.next_roots(f_hat, logits, last, verify, root_feats, root_logits)

    @step_kernel
    def _commit_rows(self, tree, verdict: BatchVerdict, verify, hidden, lead):
        """``_commit``'s tensor work: writes the tokens (``run.out``) and the VVS feature cache; returns
        the target KV moves (cache rows, source and destination slots), the tokens committed per prompt,
        the last caught-up row and the catch-up's drafter inputs (features, rows), None without a
        drafter."""
        run, target = self.run, self.target
        batch, streams, committed = run.batch, run.streams, run.committed
        device, n_img = committed.device, target.num_image_tokens
        lead = torch.zeros_like(committed) if lead is None else lead
        path, accepted = verdict.path, verdict.accepted
        depth = path.shape[1]
        width = run.chain + 1 + depth
        j = torch.arange(width, device=device)[None]  # [1, W]
        u, acc = lead[:, None], accepted[:, None]
        # Rows of ``hidden`` to commit: the lead, the root, then the accepted nodes; padded by repeating
        # the last (moving a slot onto itself and recomputing a drafter row are harmless).
        on_path = path.gather(1, (j - u - 1).clamp(0, max(depth - 1, 0))) if depth else torch.zeros_like(j)
        node = torch.where(j < u, j, u + torch.where(j == u, 0, on_path))
        rows = u + acc + 1  # caught-up rows [B, 1]
        node = torch.where(j < rows, node, node.gather(1, rows - 1))
        base = committed - 1 - lead  # image slot of the first row
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        # Target KV: row i sits at slot L+base+i; its committed place is L+base+i' (i' <= i).
        src = target.image_slot(base[:, None] + node)
        dst = torch.where(verify[:, None], torch.minimum(target.image_slot(base[:, None] + j), src), src)
        cache_rows = torch.arange(batch * streams, device=device)
        # Tokens: the accepted drafts then the bonus, at image indices committed ..
        k = torch.arange(depth + 1, device=device)[None]
        drafted = torch.cat([tree.tokens.gather(1, path.clamp_min(0)), torch.zeros_like(acc)], 1)
        new = torch.where(k == acc, verdict.bonus[:, None], drafted)
        at = committed[:, None] + k
        run.out.scatter_(1, at, torch.where(verify[:, None] & (k <= acc), new, run.out.gather(1, at)))
        counts = torch.where(verify, accepted + 1, 0)
        last = rows[:, 0] - 1
        if not self.builder.needs_drafter:
            return cache_rows, rep(src), rep(dst), counts, last, None
        # Drafter rows L+base .. : feature of the row's token, embedding of the token after it.
        feats = hidden.gather(1, rep(node)[..., None].expand(-1, -1, hidden.shape[-1]))
        slots = target.image_slot(base[:, None] + j)
        if run.fcache is not None:
            write = rep(verify[:, None] & (j < rows))[..., None]
            at_f = rep(slots)[..., None].expand(-1, -1, feats.shape[-1])
            run.fcache.scatter_(1, at_f, torch.where(write, feats, run.fcache.gather(1, at_f)))
        next_tokens_ = run.out.gather(1, base[:, None] + 1 + j)
        index = (base[:, None] + 1 + j).clamp_max(n_img)  # padding rows only
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        vis = self._visibility(base, base, causal.expand(batch, -1, -1), n_img - 1 + width)
        rows_in = self.drafter_inputs(next_tokens_, index, slots, vis)
        return cache_rows, rep(src), rep(dst), counts, last, (feats, rows_in)

    def next_roots(self, f_hat, logits, last, keep, root_feats, root_logits):
        """The next root's drafter feature and logits: caught-up row ``last[b]`` of ``f_hat`` / ``logits``
        [R, W, ·] where ``keep[b]``, the current ones elsewhere."""
        rep = lambda t: t.repeat(self.run.streams, *([1] * (t.dim() - 1)))  # noqa: E731
        at = rep(last.clamp_min(0))[:, None, None]
        keep = rep(keep)[:, None]
        pick = lambda t: t.gather(1, at.expand(-1, 1, t.shape[-1])).squeeze(1)  # noqa: E731
        return torch.where(keep, pick(f_hat), root_feats), torch.where(keep, pick(logits), root_logits)
