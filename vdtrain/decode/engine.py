"""The speculative decoding loop: one step is draft → plan → verify → judge → commit → log.

Drafting (``builders``), acceptance (``acceptance``) and the verification schedule (``vvs``) are policy;
the engine owns every forward and every write: the target's verification forward (post-verified tokens
first, ``target_forward``), the drafter's forwards (through ``DraftContext``), and the commits of verified and
of unverified (VVS-skipped) tokens. It runs a batch of prompts, each at its own pace, with CFG as a
batch of two streams. Every tensor of a step has a shape fixed by the method, so a step can be
recorded once as a CUDA graph and replayed. docs/decoding.md, "The engine's bookkeeping", has the
slot and row layout; "VVS" the post-verification.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

from vdtrain.decode.acceptance import EXACT, BatchVerdict, Rule, accept_batch
from vdtrain.decode.budget import TreeBudget, tree_budget
from vdtrain.decode.builders.base import DraftTreeBuilder, StepOutcome, StepState
from vdtrain.decode.compiled import DecodeOptions
from vdtrain.decode.graphs import DeviceLog, Recorder, SplitStepGraph, StepGraph
from vdtrain.decode.kernels import compiled_step_kernels, shared_arange, shared_full, step_kernel
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.rows import (
    DrafterRows,
    chain_visibility,
    drafter_rows,
    per_stream,
    post_verified_rows,
    tree_rows,
)
from vdtrain.decode.sampling import (
    SamplingConfig,
    cfg_batch,
    distribution,
    guided_logits,
    next_tokens,
    probabilities,
    processed_logits,
    split_cfg,
)
from vdtrain.decode.schedule import ScheduleConfig, StepPlan, VerificationSchedule
from vdtrain.decode.trees import DraftTree
from vdtrain.drafters.base import Drafter
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target, TargetOutput

T = TypeVar("T")


@dataclass
class DecodeStats:
    """Counts for one prompt; the metrics (docs/decoding.md, "Metrics") are derived from them."""

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


StepHook = Callable[[KVCache, torch.Tensor, torch.Tensor], None]


LOG_FIELDS = ("verified", "skipped", "committed", "depth", "root", "accepted", "relaxed")


class StepCalls(NamedTuple):
    """A step's drafter forwards, host ints (a recorded step replays the same calls), as its prompts see
    them: which one a prompt's statistics count depends on whether the step verified it."""

    when_verified: int  # the tree and the catch-up on the accepted tokens
    when_skipped: int  # the tree and the catch-up with stale features (VVS)


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
    budget: TreeBudget  # the most nodes a tree of this call may have (``StepState.budget``)
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
                cache.kv.zero_()
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


def _plan_flags(drafted: Drafted) -> tuple[bool, bool, bool]:
    """The step's plan flags, read from the device (``SplitStepGraph`` reads them between the parts)."""
    return drafted.plan.flag_values()


class _Recorded(NamedTuple):
    """The last decode whose step was recorded: a decode of the same shapes replays it on its run."""

    key: tuple
    run: DecodeRun
    step: Callable[[], StepCalls]  # a StepGraph, or a SplitStepGraph (VVS)


class RootDraft(NamedTuple):
    """The drafter's view of the next root, per stream row: its feature and its children's logits."""

    feats: torch.Tensor | None  # [R, H] (None: no drafter)
    logits: torch.Tensor | None  # [R, V]


class SpeculativeEngine:
    """``builder`` drafts the trees, ``accept`` verifies them (default: exact), ``schedule`` decides which
    steps are verified (default: all; VVS skips some, ``vdtrain.decode.vvs``). ``max_rows``
    (``TreeConfig.max_rows``; None: the device's limit) sizes each call's trees (``generate``). The engine
    is the builders' ``DraftContext``."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        builder: DraftTreeBuilder,
        sampling: SamplingConfig,
        accept: Rule = EXACT,
        schedule: VerificationSchedule | None = None,
        options: DecodeOptions | None = None,
        max_rows: int | None = None,
    ) -> None:
        if drafter is not None:
            drafter.attach(target)  # refuses a drafter trained for another target
        elif builder.needs_drafter:
            raise ValueError(f"{type(builder).__name__} drafts with a drafter model: pass one")
        builder.check_vocabulary(target.vocab_size)
        if drafter is not None and builder.needs_drafter:
            builder.check_drafter(drafter)  # a block tree refuses a drafter that drafts no blocks
        if not isinstance(accept, Rule):
            raise TypeError(f"accept must be an acceptance Rule (vdtrain.decode.acceptance), got {accept!r}")
        self.target = target
        self.drafter = drafter
        self.builder = builder
        self.sampling = sampling
        self.accept = accept
        self.schedule = schedule if schedule is not None else VerificationSchedule(ScheduleConfig())
        self.options = options if options is not None else DecodeOptions()
        self.max_rows = max_rows
        # The target layers the drafter reads besides the last (an eagle3 drafter's), every forward.
        self.taps = drafter.taps if drafter is not None and builder.needs_drafter else ()
        if self.schedule.can_skip and not builder.needs_drafter:
            raise ValueError(
                f"{type(builder).__name__} drafts without a drafter: skipping verification (VVS) needs one"
            )
        self.run: DecodeRun | None = None
        self._recorded: _Recorded | None = None

    # --- the draft context (``DraftContext``: what a builder may use) -------------------------------
    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → the pipeline's processed logits [B, ..., V] (CFG combined)."""
        return processed_logits(*split_cfg(logits, self.sampling), self.sampling)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter ``logits`` [R, ..., V] → q [B, ..., V]: the drafter's distribution made by the one
        pipeline; at T=0 a softmax of the same filtered logits (so top-k ranking and cumulative scores
        are defined)."""
        if self.sampling.greedy:
            return self.draft_logits(logits).softmax(-1)
        return probabilities(*split_cfg(logits, self.sampling), self.sampling)

    def draft_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter ``logits`` [R, ..., V] → the drafter's confidence [B, ..., V] a dynamic tree ranks
        children and paths by (EAGLE-2's): the softmax of the CFG-combined, tempered logits over the
        whole vocabulary (temperature 1 at T = 0), before top-k and top-p. It is q itself where the
        sampling filters nothing; otherwise only its normaliser differs, and it needs no vocabulary-wide
        selection (the top-k filter's threshold) per drafter round. docs/decoding.md, "Drafting"."""
        return guided_logits(*split_cfg(logits, self.sampling), self.sampling).softmax(-1)

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
        ``token_index`` [B, S], for every CFG stream: drafter cache ``slots`` [B, S], ``image_vis``
        [B, S, K] the image slots each row sees, ``next_embeds`` [R, S, H] when the embeddings are at hand
        (else made from ``tokens``). A row sits at the RoPE position of its feature's slot,
        ``rope_positions(token_index - 1)``."""
        run = self.run
        if next_embeds is None:
            next_embeds = per_stream(self.drafter.embed(tokens), run.streams)
        positions = self.target.rope_positions(token_index - 1)
        return drafter_rows(
            next_embeds, positions, run.stream.mask, token_index, slots, image_vis, run.streams
        )

    def drafter_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """The drafter's embeddings [R, S, H] of the next ``tokens`` [B, S], for every CFG stream (the
        ``embeds`` of ``drafter_inputs``' rows)."""
        return per_stream(self.drafter.embed(tokens), self.run.streams)

    def drafter_forward(self, feats: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``feats`` [R, S, H] through the drafter at ``rows`` → (f̂ [R, S, H], logits [R, S, V]
        carrying the target's forced tokens)."""
        run = self.run
        out = self.drafter(feats, rows.embeds, rows.positions, rows.mask, run.dcache, rows.slots)
        run.draft_calls += 1
        return out, self.target.constrain_logits(self.drafter.logits(out), rows.predicts)

    def drafter_block(self, roots: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """A block drafter's ``rows.embeds.shape[1]`` query rows from the roots' features ``roots`` [R, F]:
        one ``drafter_forward`` (``Drafter.block_queries`` marks each row's offset in the block)."""
        return self.drafter_forward(self.drafter.block_queries(roots, rows.embeds.shape[1]), rows)

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
        if planned_batch is not None and planned_batch < 1:
            raise ValueError(f"planned_batch must be a positive number of prompts, got {planned_batch}")
        device, streams = self.target.token_embedding.weight.device, self.sampling.streams
        budget = tree_budget(self.max_rows, max(planned_batch or batch, batch), streams, device)
        nodes = self.builder.tree_size(budget)
        alone = self.builder.tree_size(tree_budget(self.max_rows, 1, streams, device))
        if planned_batch is None and nodes < alone:
            warnings.warn(
                f"generate() got no planned_batch, so its {batch} prompts' trees shrink to {nodes} nodes "
                f"(tree.max_rows; {alone} for one prompt): T = 1 samples and acceptance then depend on the "
                "batch's size. Pass planned_batch=<the run's prompts per batch> to give every batch the "
                "same trees",
                stacklevel=3,
            )
        return budget

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
                    step = SplitStepGraph(self._draft, _plan_flags, self._finish_with, recorder, device)
                else:
                    step = StepGraph(step, recorder, device)
                self._recorded = _Recorded(key, run, step)
        self.run = run
        self.builder.reset(batch)
        schedule.reset(batch, device)
        prefill_calls = self._prefill(generators, extra + chain)

        while int(run.committed.amin()) < n_img:  # the loop's one read of the device
            run.calls.append(step())
            if on_step is not None:
                on_step(run.tcache, run.committed, run.out[:, :n_img])
        tokens = run.out[:, :n_img].clone()
        return DecodeResult(tokens, self._stats(prefill_calls), time.perf_counter() - start_time)

    def _prefill(self, generators: Sequence[torch.Generator | None], spare: int) -> int:
        """The step before the loop: prefill the target, sample x_0 like AR, and catch the drafter up on
        the prefix (its first root's feature and logits; VVS: the prefix's features into the feature
        cache, ``spare`` slots past the image). Returns the drafter forwards it ran."""
        run, target, sampling = self.run, self.target, self.sampling
        stream, prefix = run.stream, target.prefix_length
        pre = target.prefill(stream, run.tcache, self.taps)
        run.out[:, 0] = next_tokens(*split_cfg(pre.logits[:, -1], sampling), sampling, generators)
        if self.builder.needs_drafter:
            features = self.drafter.input_features(pre.hidden, pre.taps)
            if self.schedule.can_skip:
                if run.fcache is None:  # a reused run keeps its own, zeroed by ``restart``
                    run.fcache = features.new_zeros(
                        len(stream), target.max_seq_len + spare, features.shape[-1]
                    )
                run.fcache[:, :prefix] = features
            # Drafter rows 0 .. L-1: zero embeddings inside the prefix, then x_0 (as in training).
            feat = self.drafter.forward_prefix(
                features, per_stream(run.out[:, :1], run.streams), stream.mask, run.dcache
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
        return run.draft_calls

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
            dcache=self.drafter.new_cache(len(stream), target.max_seq_len + extra + chain)
            if self.builder.needs_drafter
            else None,
            out=torch.zeros(batch, n_img + extra + chain, **long),
            committed=torch.ones(batch, **long),
            rng=RowRandom.from_generators(generators, device, horizon=target.num_image_tokens + 1),
            budget=budget,
            chain=chain,
            pending=torch.zeros(batch, **long),
            fcache=None,
            root_feats=None,
            root_logits=None,
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
            root_feats=run.root_feats,
            root_logits=run.root_logits,
            committed=committed,
            depth_limit=(n_img - 1 - committed).clamp_min(0),  # 0 once a prompt is done (committed = N)
            generators=run.generators,
            rng=run.rng,
            budget=run.budget,
            tokens=run.out,
        )
        tree, calls = self._counted(self.builder.build, self, state)
        tree.valid = torch.cat([tree.valid[:, :1], tree.valid[:, 1:] & active[:, None]], 1)  # roots stay
        plan = self.schedule.plan_on_device(tree, active, committed, run.pending)
        return Drafted(tree, plan, active, roots_at, tree.max_depth(), calls)

    def _finish(self, drafted: Drafted, plan: StepPlan) -> StepCalls:
        """verify → judge → commit → log, for the ``plan`` with its flags read: the verified prompts
        commit what they accept, the skipping ones their unverified paths."""
        run, tree = self.run, drafted.tree
        roots = RootDraft(run.root_feats, run.root_logits)
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
        self._keep(roots, plan, skipped)
        self._log(plan, verdict, skipped, drafted)
        run.rng.advance(drafted.active)
        return StepCalls(drafted.calls + verify_calls, drafted.calls + skip_calls)

    def _finish_with(self, drafted: Drafted, flags: tuple[bool, bool, bool]) -> StepCalls:
        """``_finish`` for the plan's flags read apart (a recorded step replays one graph per flags)."""
        return self._finish(drafted, drafted.plan.with_flags(flags))

    def _counted(self, fn: Callable[..., T], *args: object) -> tuple[T, int]:
        """``fn(*args)`` and the drafter forwards it ran."""
        before = self.run.draft_calls
        out = fn(*args)
        return out, self.run.draft_calls - before

    def target_forward(self, tree: DraftTree, lead: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's target forward → (the drafter's view of its features [R, S, H]
        (``Drafter.input_features``; the hidden states without a drafter), logits at the tree nodes
        [R, T, V]). ``lead`` [B]: unverified committed tokens fed before each tree in the same forward
        (VVS post-verification); None where every lead is 0, the plain forward of the trees alone."""
        run, target = self.run, self.target
        if lead is None:
            tokens, index, slots, vis = tree_rows(tree, run.committed, target, run.streams)
            result = target.forward_tokens(run.stream, tokens, index, run.tcache, slots, vis, self.taps)
            return self._features(result), result.logits
        tokens, index, slots, vis = post_verified_rows(
            tree, lead, run.out, run.committed, run.chain, target, run.streams
        )
        result = target.forward_tokens(run.stream, tokens, index, run.tcache, slots, vis, self.taps)
        rows = per_stream(lead[:, None] + shared_arange(tree.size, lead.device)[None, :], run.streams)
        logits = result.logits.gather(1, rows[..., None].expand(-1, -1, result.logits.shape[-1]))
        return self._features(result), logits

    def _features(self, result: TargetOutput) -> torch.Tensor:
        if self.drafter is None or not self.builder.needs_drafter:
            return result.hidden
        return self.drafter.input_features(result.hidden, result.taps)

    @step_kernel
    def judge(self, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, BatchVerdict]:
        """The target's ``logits`` at the ``tree`` nodes [R, T, V] → (p [B, T, V], every row's verdict).
        At T = 0 rules that ask for it also see the softmax of the same filtered logits."""
        processed = processed_logits(*split_cfg(logits, self.sampling), self.sampling)
        p_nodes = distribution(processed, self.sampling)
        p_relax = processed.softmax(-1) if self.sampling.greedy and self.accept.needs_soft_p else None
        return p_nodes, self._accept(tree, p_nodes, p_relax)

    def _accept(self, tree: DraftTree, p_nodes: torch.Tensor, p_relax: torch.Tensor | None) -> BatchVerdict:
        """Every row's verdict at once, with this step's per-prompt uniforms: ``p_nodes`` [B, T, V] the
        target's distribution at the nodes, ``p_relax`` [B, T, V] its T = 1 softmax for the rules that
        read soft mass at T = 0 (else None)."""
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
        on them, in fixed shapes: ``W = chain + 1 + D`` rows per prompt. ``hidden`` [R, S, F]: the
        verification forward's features (``target_forward``), S = lead rows + tree nodes.

        With a lead (VVS post-verification) the rows of the unverified tokens before the root, at the
        start of ``hidden``, are caught up too: their KV is already in place, their drafter rows (made
        from stale features) are recomputed from the target's true features, and the feature cache gets
        their features. Returns the next root's drafter view, unchanged for the prompts not verified."""
        run, verified = self.run, plan.verified
        cache_rows, src, dst, counts, last, catch_up = self._commit_rows(
            tree, verdict, verified, hidden, plan.lead
        )
        run.tcache.move(cache_rows, src, dst)
        run.committed += counts
        if catch_up is None:
            return RootDraft(None, None)
        f_hat, logits = self.drafter_forward(*catch_up)
        return self._next_roots(f_hat, logits, last, verified, roots)

    @step_kernel
    def _commit_rows(self, tree: DraftTree, verdict: BatchVerdict, verified, hidden, lead):
        """``commit``'s tensor work for ``verified`` [B] (bool), ``hidden`` [R, S, F] and ``lead`` [B] (None:
        no lead): writes the tokens (``run.out``) and the VVS feature cache; returns
        the target KV moves (cache rows, source and destination slots), the tokens committed per prompt,
        the last caught-up row and the catch-up's drafter inputs (features, rows), None without a
        drafter."""
        run, target = self.run, self.target
        batch, streams, committed = run.batch, run.streams, run.committed
        device, n_img = committed.device, target.num_image_tokens
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
        # Target KV: row i sits at slot L+base+i; its committed place is L+base+i' (i' <= i).
        src = target.image_slot(base[:, None] + node)
        col = base[:, None] + j  # row j's image slot
        slots = target.image_slot(col)
        dst = torch.where(verified[:, None], torch.minimum(slots, src), src)
        cache_rows = shared_arange(batch * streams, device)
        # Tokens: the accepted drafts then the bonus, at image indices committed ..
        k = shared_arange(depth + 1, device)[None]
        new = torch.nn.functional.pad(tree.tokens.gather(1, path.clamp_min(0)), (0, 1))
        new.scatter_(1, acc, verdict.bonus[:, None])  # the bonus after the accepted drafts
        counts = one_more[:, 0] * verified  # 0 where not verified
        at = committed[:, None] + k
        run.out.scatter_(1, at, torch.where(k < counts[:, None], new, run.out.gather(1, at)))
        src, dst = per_stream(src, streams), per_stream(dst, streams)
        if not self.builder.needs_drafter:
            return cache_rows, src, dst, counts, last, None
        # Drafter rows L+base .. : feature of the row's token, embedding of the token after it.
        node = per_stream(node, streams)
        feats = hidden.gather(1, node[..., None].expand(-1, -1, hidden.shape[-1]))
        if run.fcache is not None:
            write = per_stream(verified[:, None] & (j < rows), streams)[..., None]
            at_f = per_stream(slots, streams)[..., None].expand(-1, -1, feats.shape[-1])
            run.fcache.scatter_(1, at_f, torch.where(write, feats, run.fcache.gather(1, at_f)))
        after = col + 1  # image index of the token after row j's
        next_tokens_ = run.out.gather(1, after)
        index = after.clamp_max(n_img)  # padding rows only
        vis = chain_visibility(col, n_img)
        return (
            cache_rows,
            src,
            dst,
            counts,
            last,
            (feats, self.drafter_inputs(next_tokens_, index, slots, vis)),
        )

    def commit_unverified(
        self, tree: DraftTree, plan: StepPlan, roots: RootDraft
    ) -> tuple[RootDraft, torch.Tensor]:
        """A skipped step: the prompts in ``plan.skipped`` commit the schedule's path (γ nodes, depth 1
        first) without the target, in fixed shapes (D rows per prompt, D = the path bound).

        The drafter rows of the new tokens' predecessors get *stale* features: the most recent cached
        target features, as many as tokens committed (VVS §4.3; docs/decoding.md, "VVS"). The target KV
        is left alone: the next verified step post-verifies the tokens. Returns the next root's drafter
        view with the skipping prompts' rows replaced, and the tokens committed per prompt [B] (0 where
        not skipped)."""
        run, target = self.run, self.target
        committed, fcache, streams = run.committed, run.fcache, run.streams
        nodes, gamma = self.schedule.unverified_paths(tree, plan, run.rng)
        gamma = torch.where(plan.skipped, gamma, 0)
        width = nodes.shape[1]
        j = shared_arange(width, committed.device)[None]  # [1, D]
        at = committed[:, None] + j
        write = j < gamma[:, None]
        run.out.scatter_(1, at, torch.where(write, tree.tokens.gather(1, nodes), run.out.gather(1, at)))
        # Row L+m−1+j (j < γ) pairs the cached feature of slot L+m−1−γ+j (slot 0 at the least) with the
        # embedding of the token at slot L+m+j; rows past γ land in scratch slots, never read.
        stale = target.image_slot(committed[:, None] - 1 - gamma[:, None] + j).clamp(0, fcache.shape[1] - 1)
        feats = fcache.gather(1, per_stream(stale, streams)[..., None].expand(-1, -1, fcache.shape[-1]))
        base = committed - 1  # image slot of the root, the first row's token
        col = base[:, None] + j  # row j's image slot
        slots = target.image_slot(col)
        index = at.clamp_max(target.num_image_tokens)
        vis = chain_visibility(col, target.num_image_tokens)
        rows = self.drafter_inputs(run.out.gather(1, at), index, slots, vis)
        f_hat, logits = self.drafter_forward(feats, rows)
        committed += gamma
        return self._next_roots(f_hat, logits, gamma - 1, plan.skipped, roots), gamma

    def _next_roots(self, f_hat, logits, last, keep, roots: RootDraft) -> RootDraft:
        """The next root's drafter view: caught-up row ``last[b]`` of ``f_hat`` / ``logits`` [R, W, ·]
        where ``keep[b]``, the current one elsewhere."""
        streams = self.run.streams
        at = per_stream(last.clamp_min(0), streams)[:, None, None]
        keep = per_stream(keep, streams)[:, None]

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.gather(1, at.expand(-1, 1, t.shape[-1])).squeeze(1)

        return RootDraft(
            torch.where(keep, pick(f_hat), roots.feats), torch.where(keep, pick(logits), roots.logits)
        )

    def _keep(self, roots: RootDraft, plan: StepPlan, skipped: torch.Tensor) -> None:
        """The step's results into the run, in place: the next root's drafter view, and each prompt's
        unverified tokens (``skipped`` [B]: a skip's count; 0 once verified)."""
        run = self.run
        if run.root_feats is not None:
            run.root_feats.copy_(roots.feats)
            run.root_logits.copy_(roots.logits)
        if plan.skipped is not None:
            run.pending.copy_(torch.where(plan.skipped, skipped, torch.where(plan.verified, 0, run.pending)))

    def _log(
        self, plan: StepPlan, verdict: BatchVerdict | None, skipped: torch.Tensor, drafted: Drafted
    ) -> None:
        """This step's per-prompt counts (``LOG_FIELDS``) appended to ``run.log`` (``skipped`` [B]: the
        tokens each skipping prompt committed)."""
        run, verified = self.run, plan.verified
        none = shared_full(0, run.committed.device, torch.long).expand_as(run.committed)
        accepted = verdict.accepted if verdict is not None else none
        run.log.append(
            torch.stack(
                [
                    verified,  # bool: ``stack`` promotes it to long
                    plan.skipped if plan.skipped is not None else none,
                    torch.where(verified, accepted + 1, skipped),
                    drafted.depth,
                    drafted.roots_at,
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
                    st.drafter_forwards += calls.when_verified
                    st.committed_per_step.append(count)
                    st.depth_per_step.append(depth)
                    st.accept_map.append((root, accepted))
                    st.relaxed_acceptances += relaxed
                elif skipped:
                    st.skipped_steps += 1
                    st.committed_per_skip.append(count)
                    st.drafter_forwards += calls.when_skipped
        return stats
