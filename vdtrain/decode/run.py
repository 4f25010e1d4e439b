"""What one ``generate`` call of the speculative engine changes, and what it reports: the run's tensors
(``DecodeRun``), its per-step log and the per-prompt statistics made from it (docs/decoding.md,
"Metrics")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.budget import TreeBudget
from vdtrain.decode.drafting import DraftRun
from vdtrain.decode.graphs import DeviceLog
from vdtrain.decode.kernels import shared_full
from vdtrain.decode.rng import RowRandom
from vdtrain.decode.schedule import StepPlan
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition


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


# A step's per-prompt counts, one row of the run's log each.
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
    draft: DraftRun  # the drafter's cache, catch-up and next-root view (``vdtrain.decode.drafting``)
    out: torch.Tensor  # [B, N + spare] committed tokens
    committed: torch.Tensor  # [B]
    rng: RowRandom
    budget: TreeBudget  # the most nodes a tree of this call may have (``StepState.budget``)
    chain: int  # room for post-verified tokens before a tree (VVS), else 0
    pending: torch.Tensor  # [B] VVS: committed tokens before the root the target has not seen
    log: DeviceLog  # per step: [len(LOG_FIELDS), B] counts
    calls: list[StepCalls] = field(default_factory=list)  # per step

    def restart(self, stream: Condition, generators: Sequence[torch.Generator | None]) -> None:
        """A new decode of the same shapes on these tensors, reset in place (a recorded step replays on
        them); the prefill then fills the caches and the root's drafter feature and logits."""
        self.stream.features.copy_(stream.features)
        self.stream.mask.copy_(stream.mask)
        self.generators = generators
        self.tcache.kv.zero_()
        self.draft.restart()
        self.out.zero_()
        self.pending.zero_()
        self.log.clear()
        self.committed.fill_(1)
        self.rng.reseed(RowRandom.seeds_of(generators, self.out.device))
        self.calls = []

    def record_step(
        self,
        plan: StepPlan,
        verdict: BatchVerdict | None,
        skipped: torch.Tensor,
        depth: torch.Tensor,
        roots_at: torch.Tensor,
    ) -> None:
        """A step's end, in place: each prompt's unverified tokens (``skipped`` [B]: a skip's count; 0 once
        verified), and its counts (``LOG_FIELDS``; ``depth`` and ``roots_at`` [B] of its tree, no
        ``verdict`` where no prompt was verified) appended to ``log``."""
        verified = plan.verified
        if plan.skipped is not None:
            self.pending.copy_(torch.where(plan.skipped, skipped, torch.where(verified, 0, self.pending)))
        none = shared_full(0, self.committed.device, torch.long).expand_as(self.committed)
        accepted = verdict.accepted if verdict is not None else none
        self.log.append(
            torch.stack(
                [
                    verified,  # bool: ``stack`` promotes it to long
                    plan.skipped if plan.skipped is not None else none,
                    torch.where(verified, accepted + 1, skipped),
                    depth,
                    roots_at,
                    accepted,
                    verdict.relaxed if verdict is not None else none,
                ]
            )
        )

    def verified_steps(self) -> list[bool]:
        """Per step so far: whether any prompt was verified (a VVS step may skip the target)."""
        return self.log.rows[: len(self.calls), LOG_FIELDS.index("verified")].any(1).tolist()

    def stats(self, prefill_calls: int) -> list[DecodeStats]:
        """Per-prompt ``DecodeStats`` from the step log: one read of the device for the whole decode."""
        stats = [DecodeStats(target_forwards=1, drafter_forwards=prefill_calls) for _ in range(self.batch)]
        table = self.log.tolist(len(self.calls))
        for calls, rows in zip(self.calls, table, strict=True):
            for b in range(self.batch):
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
