"""The speculative decoding loop: one step is draft → plan → verify → judge → commit → log.

Drafting (``builders``), acceptance (``acceptance``) and the verification schedule (``vvs``) are policy;
the engine owns the target's forwards and every write: the verification forward (post-verified tokens
first, ``target_forward``) and the commits of verified and of unverified (VVS-skipped) tokens. The
drafter's side is one object, ``vdtrain.decode.drafting`` (a null twin without a drafter). Prompts of
a batch decode each at its own pace, CFG as two streams, every step's shapes fixed by the method so that
a step records once as a CUDA graph. docs/decoding.md, "The engine's bookkeeping", has the layouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

from vdtrain.decode.acceptance import EXACT, BatchVerdict, Rule, accept_batch
from vdtrain.decode.budget import TreeBudget, call_budget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepOutcome, StepState
from vdtrain.decode.compiled import DecodeOptions
from vdtrain.decode.drafting import CommitRows, RootDraft, drafting_for
from vdtrain.decode.graphs import DeviceLog, Recorder, SplitStepGraph, StepGraph
from vdtrain.decode.kernels import (
    compiled_step_kernels,
    plain_kernels,
    shared_arange,
    shared_full,
    step_kernel,
)
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.rows import per_stream, post_verified_rows, tree_rows
from vdtrain.decode.run import LOG_FIELDS, DecodeResult, DecodeRun, StepCalls
from vdtrain.decode.sampling import (
    SamplingConfig,
    cfg_batch,
    distribution,
    next_tokens,
    processed_logits,
    split_cfg,
)
from vdtrain.decode.schedule import ScheduleConfig, StepPlan, VerificationSchedule
from vdtrain.decode.trees import DraftTree
from vdtrain.drafters.base import Drafter
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target

T = TypeVar("T")
StepHook = Callable[[KVCache, torch.Tensor, torch.Tensor], None]


class Drafted(NamedTuple):
    """A step's first part (``SpeculativeEngine._draft``): the tree and the plan, flags unread."""

    tree: DraftTree
    plan: StepPlan
    active: torch.Tensor  # [B] prompts still decoding at the step's start
    roots_at: torch.Tensor  # [B] image index of each root
    depth: torch.Tensor  # [B] depth of the drafted tree
    calls: int  # drafter forwards the tree took

    def flags(self) -> tuple[bool, bool, bool]:
        """The plan's flags, read from the device (``SplitStepGraph`` reads them between the parts)."""
        return self.plan.flag_values()


class _Recorded(NamedTuple):
    """The last decode whose step was recorded: a decode of the same shapes replays it on its run."""

    key: tuple
    run: DecodeRun
    step: Callable[[], StepCalls]  # a StepGraph, or a SplitStepGraph (VVS)


class SpeculativeEngine:
    """``builder`` drafts the trees, ``accept`` verifies them (default: exact), ``schedule`` picks the
    verified steps (default: all; VVS skips some). ``max_rows`` (None: the device's limit) sizes each
    call's trees; ``drafting`` (``drafting_for``) is the builders' ``DraftContext``, making q at
    ``draft_cfg_scale`` (None: the target's)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        builder: DraftTreeBuilder,
        sampling: SamplingConfig,
        *,
        accept: Rule = EXACT,
        schedule: VerificationSchedule | None = None,
        options: DecodeOptions | None = None,
        max_rows: int | None = None,
        draft_cfg_scale: float | None = None,
    ) -> None:
        if not isinstance(accept, Rule):
            raise TypeError(f"accept must be an acceptance Rule (vdtrain.decode.acceptance), got {accept!r}")
        self.schedule = schedule if schedule is not None else VerificationSchedule(ScheduleConfig())
        builder = builder.for_vocabulary(target.vocab_size)
        # the builders' DraftContext, or its null twin where the builder drafts without a drafter
        self.drafting = drafting_for(
            target, drafter, builder, sampling, skips=self.schedule.can_skip, draft_cfg_scale=draft_cfg_scale
        )
        self.target = target
        self.builder = builder
        self.sampling = sampling
        self.accept = accept
        self.options = options if options is not None else DecodeOptions()
        self.max_rows = max_rows
        self.run: DecodeRun | None = None
        self._recorded: _Recorded | None = None

    # --- the loop ---------------------------------------------------------------------------------
    def generate(
        self,
        cond: Condition,
        generators: Sequence[torch.Generator | None],
        on_step: StepHook | None = None,
        planned_batch: int | None = None,
    ) -> DecodeResult:
        """Image tokens for ``cond``; ``on_step(target_cache, committed, tokens)`` runs after each step.
        ``planned_batch``: the prompts per batch of the whole run, which sizes the trees (``tree_budget``)
        so that a prompt's sample does not depend on the batch it lands in (a last, short batch, a shard);
        a batch larger than planned sizes them itself. None: this batch's size, with a warning where that
        shrinks the trees below one prompt's (T = 1 samples and the statistics then depend on the
        batch's size). The step kernels run compiled when the options ask for it."""
        budget = self.budget_for(len(cond), planned_batch)
        backend = self.options.compile_steps
        with compiled_step_kernels(backend is not None, backend or "inductor"):
            return self._generate(cond, generators, on_step, budget)

    def budget_for(self, batch: int, planned_batch: int | None) -> TreeBudget:
        """The node budget of a ``generate`` call of ``batch`` prompts (see ``generate``)."""
        device, streams = self.target.token_embedding.weight.device, self.sampling.streams
        size, rows = self.builder.tree_size, self.max_rows
        return call_budget(size, rows, batch=batch, planned=planned_batch, streams=streams, device=device)

    @torch.no_grad()
    def _generate(
        self,
        cond: Condition,
        generators: Sequence[torch.Generator | None],
        on_step: StepHook | None,
        budget: TreeBudget,
    ) -> DecodeResult:
        target, sampling, schedule = self.target, self.sampling, self.schedule
        start_time = time.perf_counter()
        batch, n_img = len(cond), target.num_image_tokens
        stream = cfg_batch(target, cond, sampling)
        device = target.token_embedding.weight.device
        extra = self.builder.max_nodes(budget) + 1
        skipping = schedule.can_skip
        chain = extra if skipping else 0  # post-verification feeds [unverified tokens ⊕ tree]
        recorder = self.recorder
        # A recorded step is the budget's: its trees' sizes are in its ops, whatever the buffers' sizes.
        key = (batch, budget, extra, *((t.shape, t.dtype) for t in (stream.features, stream.mask)), device)
        if recorder is not None and self._recorded is not None and self._recorded.key == key:
            run, step = self._recorded.run, self._recorded.step  # replay the step recorded before
            run.restart(stream, generators)
        else:
            run, step = self._new_run(stream, batch, generators, chain, budget), self._step
            if recorder is not None:
                if schedule.can_skip:  # draft and plan, read the plan's flags, then the rest per flags
                    step = SplitStepGraph(self._draft, Drafted.flags, self._finish_with, recorder, device)
                else:
                    step = StepGraph(step, recorder, device)
                self._recorded = _Recorded(key, run, step)
        self.run, self.drafting.run = run, run.draft
        self.builder.reset(batch)
        schedule.reset(batch, device)
        self._prefill(generators)
        prefill_calls = run.draft.calls

        while int(run.committed.amin()) < n_img:  # the loop's one read of the device
            run.calls.append(step())
            if on_step is not None:
                on_step(run.tcache, run.committed, run.out[:, :n_img])
        tokens = run.out[:, :n_img].clone()
        return DecodeResult(tokens, run.stats(prefill_calls), time.perf_counter() - start_time)

    def _prefill(self, generators: Sequence[torch.Generator | None]) -> None:
        """Before the loop: prefill the target, sample x_0 like AR, catch the drafter up on the prefix."""
        run, sampling = self.run, self.sampling
        pre = self.target.prefill(run.stream, run.tcache, self.drafting.taps)
        run.out[:, 0] = next_tokens(*split_cfg(pre.logits[:, -1], sampling), sampling, generators)
        self.drafting.prefill(pre, run.out[:, :1])

    def _new_run(
        self,
        stream: Condition,
        batch: int,
        generators: Sequence[torch.Generator | None],
        chain: int,
        budget: TreeBudget,
    ) -> DecodeRun:
        """Fresh buffers and caches for a decode of ``batch`` prompts (``chain``: VVS's room for
        post-verified tokens before a tree) with trees of ``budget``."""
        target, device = self.target, self.target.token_embedding.weight.device
        n_img, extra = target.num_image_tokens, self.builder.max_nodes(budget) + 1
        long = {"dtype": torch.long, "device": device}
        return DecodeRun(
            stream=stream,
            batch=batch,
            streams=len(stream) // batch,
            generators=generators,
            tcache=target.new_cache(len(stream), extra_slots=extra + chain),
            draft=self.drafting.new_run(stream, len(stream) // batch, extra + chain, self.schedule.can_skip),
            out=torch.zeros(batch, n_img + extra + chain, **long),
            committed=torch.ones(batch, **long),
            rng=RowRandom.from_generators(generators, device, horizon=target.num_image_tokens + 1),
            budget=budget,
            chain=chain,
            pending=torch.zeros(batch, **long),
            log=DeviceLog(n_img, len(LOG_FIELDS), batch, device=device),  # a step commits >= 1 token
        )

    @property
    def recorder(self) -> Recorder | None:
        """How to record the step once and replay it (``DecodeOptions.step_recorder``: a CUDA graph on a
        GPU), when this method's builder allows it: fixed shapes and no host state across steps
        (``DraftTreeBuilder.graph_safe``). None: every step runs eagerly."""
        return self.options.step_recorder if self.builder.graph_safe else None

    # --- one step: draft → plan → verify → judge → commit → log --------------------------------------
    def _step(self) -> StepCalls:
        """One step for the whole batch, on the run's tensors in place (a recorded step replays it); it
        returns the drafter calls, the same every step for a graph-safe method. A skipping schedule's
        plan is read from the device between the two parts, recorded apart (``SplitStepGraph``)."""
        drafted = self._draft()
        return self._finish(drafted, drafted.plan.read())

    def _draft(self) -> Drafted:
        """draft → plan: every prompt's tree, and the schedule's plan with its flags still on the device."""
        run, n_img = self.run, self.target.num_image_tokens
        committed = run.committed
        active, roots_at = committed < n_img, committed - 1  # roots_at: the image index of each root
        state = StepState(
            roots=run.out.gather(1, roots_at[:, None]).squeeze(1),
            root_feats=run.draft.root.feats,
            root_logits=run.draft.root.logits,
            committed=committed,
            depth_limit=(n_img - 1 - committed).clamp_min(0),  # 0 once a prompt is done (committed = N)
            generators=run.generators,
            rng=run.rng,
            budget=run.budget,
            tokens=run.out,
        )
        tree, calls = self._counted(self.builder.build, self.drafting, state)
        tree.valid = torch.cat([tree.valid[:, :1], tree.valid[:, 1:] & active[:, None]], 1)  # roots stay
        plan = self.schedule.plan_on_device(tree, active, committed, run.pending)
        return Drafted(tree, plan, active, roots_at, tree.max_depth(), calls)

    def _finish(self, drafted: Drafted, plan: StepPlan) -> StepCalls:
        """verify → judge → commit → log, for the ``plan`` with its flags read: the verified prompts
        commit what they accept, the skipping ones their unverified paths."""
        run, tree = self.run, drafted.tree
        roots = run.draft.root
        verdict, verify_calls, skip_calls = None, 0, 0
        if plan.any_verify:  # every prompt skipping: no target forward
            hidden, logits = self.target_forward(tree, plan.lead if plan.any_lead else None)
            p_nodes, verdict = self.judge(tree, logits)
            greedy = self.sampling.greedy
            self.builder.observe(StepOutcome(tree, verdict, plan, p_nodes, drafted.roots_at, run.rng, greedy))
            roots, verify_calls = self._counted(self.commit, tree, verdict, plan, hidden, roots)
        skipped = shared_full(0, run.committed.device, torch.long).expand_as(run.committed)
        if plan.any_skip:
            (roots, skipped), skip_calls = self._counted(self.commit_unverified, tree, plan, roots)
        self.drafting.keep(roots)
        run.record_step(plan, verdict, skipped, drafted.depth, drafted.roots_at)
        run.rng.advance(drafted.active)
        return StepCalls(drafted.calls + verify_calls, drafted.calls + skip_calls)

    def _finish_with(self, drafted: Drafted, flags: tuple[bool, bool, bool]) -> StepCalls:
        """``_finish`` for the plan's flags read apart (a recorded step replays one graph per flags)."""
        return self._finish(drafted, drafted.plan.with_flags(flags))

    def _counted(self, fn: Callable[..., T], *args: object) -> tuple[T, int]:
        """``fn(*args)`` and the drafter forwards it ran."""
        before = self.run.draft.calls
        out = fn(*args)
        return out, self.run.draft.calls - before

    def target_forward(self, tree: DraftTree, lead: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's target forward → (the drafter's view of its features [R, S, H]
        (``Drafter.input_features``; the hidden states without a drafter), logits at the tree nodes
        [R, T, V]). ``lead`` [B]: unverified committed tokens fed before each tree in the same forward
        (VVS post-verification); None where every lead is 0, the plain forward of the trees alone."""
        run, target = self.run, self.target
        if lead is None:
            tokens, index, slots, vis = tree_rows(tree, run.committed, target, run.streams)
        else:
            tokens, index, slots, vis = post_verified_rows(
                tree, lead, run.out, run.committed, run.chain, target, run.streams
            )
        result = target.forward_tokens(run.stream, tokens, index, run.tcache, slots, vis, self.drafting.taps)
        if lead is None:
            return self.drafting.features(result), result.logits
        rows = per_stream(lead[:, None] + shared_arange(tree.size, lead.device)[None, :], run.streams)
        logits = result.logits.gather(1, rows[..., None].expand(-1, -1, result.logits.shape[-1]))
        return self.drafting.features(result), logits

    @step_kernel
    def judge(self, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, BatchVerdict]:
        """The target's ``logits`` at the ``tree`` nodes [R, T, V] → (p [B, T, V], every row's verdict).
        At T = 0 rules that ask for it also see the softmax of the same filtered logits."""
        processed = processed_logits(*split_cfg(logits, self.sampling), self.sampling)
        p_nodes = distribution(processed, self.sampling)
        p_relax = processed.softmax(-1) if self.sampling.greedy and self.accept.needs_soft_p else None
        return p_nodes, self._accept(tree, p_nodes, p_relax)

    def _accept(self, tree: DraftTree, p_nodes: torch.Tensor, p_relax: torch.Tensor | None) -> BatchVerdict:
        """Every row's verdict from ``p_nodes`` [B, T, V] (``p_relax``: the T = 1 softmax, or None) with the
        step's uniforms: the one place acceptance is decided, where the power tests swap in wrong rules."""
        batch, size = tree.tokens.shape
        if self.sampling.greedy:  # no draws: the argmax decides
            u_accept = p_nodes.new_zeros(batch, size, dtype=torch.float64)
            u_bonus = p_nodes.new_zeros(batch, dtype=torch.float64)
        else:
            u_accept, u_bonus = self.run.rng.uniforms((Purpose.ACCEPT, (size,)), (Purpose.BONUS, ()))
        return accept_batch(self.accept, tree, p_nodes, self.sampling.greedy, u_accept, u_bonus, p_relax)

    def commit(
        self, tree: DraftTree, verdict: BatchVerdict, plan: StepPlan, hidden: torch.Tensor, roots: RootDraft
    ) -> RootDraft:
        """Write the verified prompts' accepted tokens, move their KV into place, and catch the drafter up
        on them, in fixed shapes: ``W = chain + 1 + D`` rows per prompt. ``hidden`` [R, S, H]: the
        verification forward's features (``target_forward``), S = lead rows + tree nodes.

        With a lead (VVS post-verification) the rows of the unverified tokens before the root, at the
        start of ``hidden``, are caught up too: their KV is already in place, their drafter rows (made
        from stale features) are recomputed from the target's true features, and the feature cache gets
        their features. Returns the next root's drafter view, unchanged for the prompts not verified."""
        run, verified = self.run, plan.verified
        moves, counts, last, catch_up = self._commit_rows(tree, verdict, verified, hidden, plan.lead)
        if moves is not None:
            run.tcache.move(*moves)
        run.committed += counts
        return self.drafting.catch_up(catch_up, last, verified, roots)

    @step_kernel
    def _commit_rows(self, tree: DraftTree, verdict: BatchVerdict, verified, hidden, lead):
        """``commit``'s tensor work for ``verified`` [B] (bool), ``hidden`` [R, S, H] and ``lead`` [B] (None:
        no lead): writes the tokens (``run.out``); returns the target KV moves (cache rows, source and
        destination slots; None: none to make), the tokens committed per prompt, the last caught-up row
        and the drafter's catch-up inputs (``Drafting.catch_up_rows``, which also fills the VVS feature
        cache)."""
        run, target = self.run, self.target
        batch, streams, committed = run.batch, run.streams, run.committed
        device = committed.device
        path, accepted = verdict.path, verdict.accepted
        depth = path.shape[1]
        width = run.chain + 1 + depth
        j = shared_arange(width, device)[None]  # [1, W]
        acc = accepted[:, None]
        one_more = acc + 1  # tokens a verified prompt commits: its accepted drafts and the bonus
        # Rows of ``hidden`` to commit: the lead, the root, then the accepted nodes; padded by repeating
        # the last (moving a slot onto itself and recomputing a drafter row are harmless).
        if lead is None:  # no lead: the root (node 0), then the path; its last caught-up row is ``acc``
            node = torch.nn.functional.pad(path, (1, 0))  # [B, 1 + D]: width is 1 + D here
            rows = one_more  # caught-up rows [B, 1]
            node = torch.where(j < rows, node, node.gather(1, acc))
            base, last = committed - 1, accepted  # image slot of the first row; the last caught-up row
        else:
            u = lead[:, None]
            on_path = (
                path.gather(1, (j - u - 1).clamp(0, max(depth - 1, 0))) if depth else torch.zeros_like(j)
            )
            node = torch.where(j < u, j, u + torch.where(j == u, 0, on_path))
            rows = u + one_more  # caught-up rows [B, 1]
            node = torch.where(j < rows, node, node.gather(1, rows - 1))
            base = committed - 1 - lead  # image slot of the first row
            last = rows[:, 0] - 1
        # Target KV: row i sits at slot L+base+i; its committed place is L+base+i' (i' <= i). A chain
        # without a lead commits the first rows where they sit (i' = i): no move (the plain twin moves
        # each row onto itself).
        col = base[:, None] + j  # row j's image slot
        slots = target.image_slot(col)
        moves = None
        if lead is not None or not tree.chain or plain_kernels():
            src = target.image_slot(base[:, None] + node)
            dst = torch.where(verified[:, None], torch.minimum(slots, src), src)
            cache_rows = shared_arange(batch * streams, device)
            moves = cache_rows, per_stream(src, streams), per_stream(dst, streams)
        # Tokens: the accepted drafts then the bonus, at image indices committed ..
        k = shared_arange(depth + 1, device)[None]
        new = torch.nn.functional.pad(tree.tokens.gather(1, path.clamp_min(0)), (0, 1))
        new.scatter_(1, acc, verdict.bonus[:, None])  # the bonus after the accepted drafts
        counts = one_more[:, 0] * verified  # 0 where not verified
        at = committed[:, None] + k
        run.out.scatter_(1, at, torch.where(k < counts[:, None], new, run.out.gather(1, at)))
        at = CommitRows(node, col, slots, j, rows, verified)
        return moves, counts, last, self.drafting.catch_up_rows(hidden, run.out, at)

    def commit_unverified(
        self, tree: DraftTree, plan: StepPlan, roots: RootDraft
    ) -> tuple[RootDraft, torch.Tensor]:
        """A skipped step: the prompts in ``plan.skipped`` commit the schedule's path (γ nodes, depth 1
        first) without the target, in fixed shapes (D rows per prompt, D = the path bound).

        The drafter catches up on them with *stale* features (``Drafting.catch_up_unverified``). The
        target KV is left alone: the next verified step post-verifies the tokens. Returns the next root's
        drafter view with the skipping prompts' rows replaced, and the tokens committed per prompt [B] (0
        where not skipped)."""
        run, committed = self.run, self.run.committed
        nodes, gamma = self.schedule.unverified_paths(tree, plan, run.rng)
        gamma = torch.where(plan.skipped, gamma, 0)
        width = nodes.shape[1]
        j = shared_arange(width, committed.device)[None]  # [1, D]
        at = committed[:, None] + j
        write = j < gamma[:, None]
        run.out.scatter_(1, at, torch.where(write, tree.tokens.gather(1, nodes), run.out.gather(1, at)))
        inputs = self.drafting.catch_up_unverified(run.out, committed, gamma, j, at)
        roots = self.drafting.catch_up(inputs, gamma - 1, plan.skipped, roots)
        committed += gamma
        return roots, gamma
