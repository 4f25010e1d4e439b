"""The decode side of a drafter: one object owns the drafter model, its cache, its catch-up on what the
target verified, the next root's view, and the drafter forwards a builder drafts through.

``Drafting`` is the builders' ``DraftContext`` (``vdtrain.decode.builders.base``): the sampling pipeline's
drafter distributions and the drafter forwards (``drafter_inputs``, ``drafter_embeds``,
``drafter_forward``, ``drafter_block``). The engine calls it at fixed points of a step (the prefill, the
target's features, the end of a commit) and never asks whether a drafter is there: a drafter-free method
(SJD, SJD-PAC) gets ``NoDrafting``, the twin that does nothing there and refuses a drafter forward.
``drafting_for`` picks the one a builder needs. docs/decoding.md, "The engine's bookkeeping", has the
row layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from vdtrain.decode.builders.base import DraftTreeBuilder
from vdtrain.decode.kernels import shared_arange, step_kernel
from vdtrain.decode.rows import DrafterRows, chain_visibility, drafter_rows, per_stream
from vdtrain.decode.sampling import SamplingConfig, guided_logits, probabilities, processed_logits, split_cfg
from vdtrain.drafters.base import Drafter
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target, TargetOutput


class RootDraft(NamedTuple):
    """The drafter's view of the next root, per stream row: its feature and its children's logits."""

    feats: torch.Tensor | None  # [R, H] the drafter's feature (None: no drafter)
    logits: torch.Tensor | None  # [R, V]


@dataclass
class DraftRun:
    """The drafter's part of one ``generate`` call, changed in place by every step (a recorded step replays
    on these tensors): its cache, the VVS feature cache, the next root's view and the forwards run."""

    streams: int
    mask: torch.Tensor  # [R, L] the run's prefix mask (the CFG batch's, refilled in place on restart)
    cache: KVCache | None
    spare: int  # slots past the image: the trees' room and VVS's chain
    skipping: bool  # VVS: keep the target's features of every verified slot (``fcache``)
    fcache: torch.Tensor | None = None  # VVS: [R, L + N + spare, H] the drafter's target feature per slot
    root: RootDraft = field(default_factory=lambda: RootDraft(None, None))
    calls: int = 0  # drafter forwards so far

    def restart(self) -> None:
        """A new decode on these tensors: zeroed caches, no forwards yet."""
        for t in (self.cache.kv if self.cache is not None else None, self.fcache):
            if t is not None:
                t.zero_()
        self.calls = 0


class CommitRows(NamedTuple):
    """Where a commit put each prompt's ``W`` rows (``SpeculativeEngine._commit_rows``): what the drafter's
    catch-up reads of them."""

    node: torch.Tensor  # [B, W] the row of the verification forward each row commits
    col: torch.Tensor  # [B, W] its image slot
    slots: torch.Tensor  # [B, W] its cache slot
    j: torch.Tensor  # [1, W] its place in the prompt's rows
    rows: torch.Tensor  # [B, 1] rows a prompt commits (the rest repeat its last)
    verified: torch.Tensor  # [B] bool


class NoDrafting:
    """The draft context of a drafter-free method: the sampling pipeline, and nothing to catch up."""

    drafter: Drafter | None = None
    taps: tuple[int, ...] = ()  # the target layers the drafter reads besides the last, every forward

    def __init__(
        self, target: Target, sampling: SamplingConfig, draft_cfg_scale: float | None = None
    ) -> None:
        self.target, self.sampling = target, sampling
        # the pipeline q is made by: the target's, but for the guidance its streams are combined at
        if draft_cfg_scale is not None and draft_cfg_scale < 1.0:
            raise ValueError(
                f"tree.draft_cfg_scale must be >= 1 (1: the conditional stream alone), got {draft_cfg_scale}"
            )
        use = draft_cfg_scale is not None and sampling.uses_cfg  # one stream: nothing to combine
        self.draft_sampling = replace(sampling, cfg_scale=draft_cfg_scale) if use else sampling
        self.run: DraftRun | None = None

    # --- the drafter's distribution, made by the one pipeline -------------------------------------
    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → the pipeline's processed logits [B, ..., V] (CFG combined at the
        draft scale)."""
        return processed_logits(*split_cfg(logits, self.sampling), self.draft_sampling)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter ``logits`` [R, ..., V] → q [B, ..., V]: the drafter's distribution made by the one
        pipeline; at T=0 a softmax of the same filtered logits (so top-k ranking and cumulative scores
        are defined)."""
        if self.sampling.greedy:
            return self.draft_logits(logits).softmax(-1)
        return probabilities(*split_cfg(logits, self.sampling), self.draft_sampling)

    def draft_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter ``logits`` [R, ..., V] → the drafter's confidence [B, ..., V] a dynamic tree ranks
        children and paths by (EAGLE-2's): the softmax of the CFG-combined, tempered logits over the
        whole vocabulary (temperature 1 at T = 0), before top-k and top-p. It is q itself where the
        sampling filters nothing; otherwise only its normaliser differs, and it needs no vocabulary-wide
        selection (the top-k filter's threshold) per drafter round. docs/decoding.md, "Drafting"."""
        return guided_logits(*split_cfg(logits, self.sampling), self.draft_sampling).softmax(-1)

    # --- the engine's calls ------------------------------------------------------------------------
    def new_run(self, stream: Condition, streams: int, spare: int, skipping: bool) -> DraftRun:
        """The drafter's part of a new run over the CFG batch ``stream``, bound as ``self.run``."""
        cache = self.new_cache(len(stream), self.target.max_seq_len + spare)
        self.run = DraftRun(streams, stream.mask, cache, spare, skipping)
        return self.run

    def new_cache(self, rows: int, slots: int) -> KVCache | None:
        return None

    def features(self, result: TargetOutput) -> torch.Tensor:
        """What a target forward hands the drafter, per row (the hidden states where none reads them)."""
        return result.hidden

    def prefill(self, pre: TargetOutput, first: torch.Tensor) -> None:
        """Catch up on the prefix ``pre`` and image token 0 ``first`` [B, 1]: nothing to catch up."""

    def catch_up_rows(self, hidden: torch.Tensor, out: torch.Tensor, at: CommitRows):
        """The catch-up forward's inputs on a commit's rows: none without a drafter."""
        return None

    def catch_up(self, inputs, last: torch.Tensor, keep: torch.Tensor, roots: RootDraft) -> RootDraft:
        """The next root's view after the catch-up forward on ``inputs``: none without a drafter."""
        return roots

    def keep(self, roots: RootDraft) -> None:
        """The step's next-root view into the run, in place: none without a drafter."""

    def drafter_inputs(self, *args: object, **kwargs: object) -> DrafterRows:
        raise self._drafts_nothing()

    def drafter_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        raise self._drafts_nothing()

    def drafter_forward(self, feats: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._drafts_nothing()

    def drafter_block(self, roots: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._drafts_nothing()

    def catch_up_unverified(self, *args: object, **kwargs: object) -> RootDraft:
        raise self._drafts_nothing()

    def _drafts_nothing(self) -> TypeError:
        return TypeError("this method drafts without a drafter model: its builder runs no drafter forward")


class Drafting(NoDrafting):
    """A drafter model's decode side (see the module docstring)."""

    def __init__(
        self, target: Target, drafter: Drafter, sampling: SamplingConfig, draft_cfg_scale: float | None = None
    ) -> None:
        super().__init__(target, sampling, draft_cfg_scale)
        self.drafter = drafter
        self.taps = drafter.taps

    def new_cache(self, rows: int, slots: int) -> KVCache | None:
        return self.drafter.new_cache(rows, slots)

    def features(self, result: TargetOutput) -> torch.Tensor:
        return self.drafter.input_features(result.hidden, result.taps)

    def prefill(self, pre: TargetOutput, first: torch.Tensor) -> None:
        """Catch the drafter up on the prefix: its first root's feature and logits (VVS: the prefix's
        features into the feature cache, ``spare`` slots past the image)."""
        run, target = self.run, self.target
        features = self.features(pre)
        if run.skipping:
            if run.fcache is None:  # a reused run keeps its own, zeroed by ``restart``
                run.fcache = features.new_zeros(
                    features.shape[0], target.max_seq_len + run.spare, features.shape[-1]
                )
            run.fcache[:, : target.prefix_length] = features
        # Drafter rows 0 .. L-1: zero embeddings inside the prefix, then x_0 (as in training).
        feat = self.drafter.forward_prefix(features, per_stream(first, run.streams), run.mask, run.cache)
        run.calls += 1
        feats = feat[:, -1]
        logits = target.constrain_logits(
            self.drafter.logits(feats), torch.ones_like(feats[:, 0], dtype=torch.long)
        )
        if run.root.feats is None:
            run.root = RootDraft(feats.contiguous(), logits.contiguous())
        else:  # a reused run: in place
            self.keep(RootDraft(feats, logits))

    # --- the draft context's drafter forwards -----------------------------------------------------
    @step_kernel
    def drafter_inputs(
        self,
        tokens: torch.Tensor | None,
        token_index: torch.Tensor,
        slots: torch.Tensor,
        image_vis: torch.Tensor,
        next_embeds: torch.Tensor | None = None,
        *,
        offset: int = 0,
    ) -> DrafterRows:
        """The drafter's inputs for rows pairing features with the next ``tokens`` [B, S] at image indices
        ``token_index`` [B, S], for every CFG stream: drafter cache ``slots`` [B, S], ``image_vis``
        [B, S, K] the image slots each row sees, ``next_embeds`` [R, S, H] when the embeddings are at hand
        (else made from ``tokens``), ``offset`` the rows' depth past the root (0: committed rows). A row
        sits at the RoPE position of its feature's slot, ``rope_positions(token_index - 1)``."""
        run = self.run
        if next_embeds is None:
            next_embeds = per_stream(self.drafter.embed(tokens), run.streams)
        positions = self.target.rope_positions(token_index - 1)
        return drafter_rows(
            next_embeds, positions, run.mask, token_index, slots, image_vis, run.streams, offset=offset
        )

    def drafter_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """The drafter's embeddings [R, S, H] of the next ``tokens`` [B, S], for every CFG stream (the
        ``embeds`` of ``drafter_inputs``' rows)."""
        return per_stream(self.drafter.embed(tokens), self.run.streams)

    def drafter_forward(self, feats: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``feats`` [R, S, H] through the drafter at ``rows`` → (f̂ [R, S, H], logits [R, S, V]
        carrying the target's forced tokens)."""
        run, offset = self.run, rows.offset
        out = self.drafter(
            feats, rows.embeds, rows.positions, rows.mask, run.cache, rows.slots, offset=offset
        )
        run.calls += 1
        return out, self.target.constrain_logits(self.drafter.logits(out, offset), rows.predicts)

    def drafter_block(self, roots: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """A block drafter's ``S = rows.embeds.shape[1]`` query rows from the roots' features ``roots``
        [R, H]: one ``drafter_forward``, the rows at offsets 1 .. S past the root."""
        count = rows.embeds.shape[1]
        queries = self.drafter.block_queries(roots, count)
        return self.drafter_forward(queries, rows._replace(offset=shared_arange(count + 1, roots.device)[1:]))

    # --- the catch-up on committed tokens ---------------------------------------------------------
    def catch_up_rows(
        self, hidden: torch.Tensor, out: torch.Tensor, at: CommitRows
    ) -> tuple[torch.Tensor, DrafterRows]:
        """The catch-up forward's inputs on a commit's rows ``at`` (run inside the engine's commit kernel):
        row ``j`` pairs the feature of its token (``hidden`` [R, S, H], the verification forward's) with
        the embedding of the committed token after it (``out`` [B, N + spare]). VVS: the verified rows'
        features go to the feature cache."""
        run, n_img = self.run, self.target.num_image_tokens
        node = per_stream(at.node, run.streams)
        feats = hidden.gather(1, node[..., None].expand(-1, -1, hidden.shape[-1]))
        if run.fcache is not None:
            write = per_stream(at.verified[:, None] & (at.j < at.rows), run.streams)[..., None]
            at_f = per_stream(at.slots, run.streams)[..., None].expand(-1, -1, feats.shape[-1])
            run.fcache.scatter_(1, at_f, torch.where(write, feats, run.fcache.gather(1, at_f)))
        after = at.col + 1  # image index of the token after row j's
        next_tokens = out.gather(1, after)
        index = after.clamp_max(n_img)  # padding rows only
        vis = chain_visibility(at.col, n_img)
        return feats, self.drafter_inputs(next_tokens, index, at.slots, vis)

    def catch_up(
        self,
        inputs: tuple[torch.Tensor, DrafterRows],
        last: torch.Tensor,
        keep: torch.Tensor,
        roots: RootDraft,
    ) -> RootDraft:
        """One forward on the catch-up ``inputs``; the next root's view is its row ``last[b]`` where
        ``keep[b]``, ``roots`` elsewhere."""
        f_hat, logits = self.drafter_forward(*inputs)
        return self._next_roots(f_hat, logits, last, keep, roots)

    def catch_up_unverified(
        self,
        out: torch.Tensor,
        committed: torch.Tensor,
        gamma: torch.Tensor,
        j: torch.Tensor,
        at: torch.Tensor,
    ) -> tuple[torch.Tensor, DrafterRows]:
        """A skipped step's catch-up inputs (VVS §4.3; docs/decoding.md, "VVS"): the ``gamma`` [B] tokens
        committed at image indices ``at`` [B, D] (``committed[:, None] + j``) get *stale* features, the
        most recent cached target features. Row L+m−1+j (j < γ) pairs the cached feature of slot
        L+m−1−γ+j (slot 0 at the least) with the embedding of the token at slot L+m+j; rows past γ land
        in scratch slots, never read."""
        run, target, fcache = self.run, self.target, self.run.fcache
        stale = target.image_slot(committed[:, None] - 1 - gamma[:, None] + j).clamp(0, fcache.shape[1] - 1)
        feats = fcache.gather(1, per_stream(stale, run.streams)[..., None].expand(-1, -1, fcache.shape[-1]))
        col = (committed - 1)[:, None] + j  # row j's image slot (row 0: the root's)
        slots = target.image_slot(col)
        index = at.clamp_max(target.num_image_tokens)
        vis = chain_visibility(col, target.num_image_tokens)
        return feats, self.drafter_inputs(out.gather(1, at), index, slots, vis)

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

    def keep(self, roots: RootDraft) -> None:
        self.run.root.feats.copy_(roots.feats)
        self.run.root.logits.copy_(roots.logits)


def drafting_for(
    target: Target,
    drafter: Drafter | None,
    builder: DraftTreeBuilder,
    sampling: SamplingConfig,
    *,
    skips: bool = False,
    draft_cfg_scale: float | None = None,
) -> NoDrafting:
    """The draft context ``builder`` drafts through: a ``Drafting`` of ``drafter`` where it drafts with
    one (refusing a drafter of another target, or one the builder cannot draft with), else ``NoDrafting``
    (refused where the schedule ``skips`` verification: VVS catches a drafter up on unverified tokens)."""
    if drafter is not None:
        drafter.attach(target)  # refuses a drafter trained for another target
    if not builder.needs_drafter:
        if skips:
            raise ValueError(
                f"{type(builder).__name__} drafts without a drafter: skipping verification (VVS) needs one"
            )
        return NoDrafting(target, sampling, draft_cfg_scale)
    if drafter is None:
        raise ValueError(f"{type(builder).__name__} drafts with a drafter model: pass one")
    builder.check_drafter(drafter)  # a block tree refuses a drafter that drafts no blocks
    return Drafting(target, drafter, sampling, draft_cfg_scale)
