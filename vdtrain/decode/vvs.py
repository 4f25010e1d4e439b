"""VVS: partial verification skipping, the engine's third part — the *schedule* (pure policy).

After a step's trees are drafted the schedule plans, for every prompt at once, whether the step is
verified (``VerificationSchedule.plan_on_device``) and which unverified path a skipping prompt commits
(``unverified_paths``); the engine does every forward and every write. The default, ``always``, lives in
``vdtrain.decode.schedule``. ``UniformSchedule`` skips every ``every``-th step, ``SimilaritySchedule``
skips when the candidate paths agree (S̄ ≥ ``t_sim``). The plan reads the device once, for the three
decisions the loop takes on the host.

docs/decoding.md, "VVS", has the hard rules, our reading of S̄, the stale features, post-verification
and the release's knobs (``conf/decode/vvs_release.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vdtrain.decode.kernels import shared_arange
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.schedule import ScheduleConfig, StepPlan, VerificationSchedule
from vdtrain.decode.trees import DraftTree, ancestor_matrix


@dataclass
class LeafPaths:
    """Every row's root-to-leaf paths as tensors: ``nodes[b, i, ℓ]`` is the depth-``ℓ + 1`` node on the
    path ending at node ``i`` (meaningful where ``is_leaf[b, i]`` and ``ℓ < depth[b, i]``)."""

    is_leaf: torch.Tensor  # [B, T] bool: valid drafted nodes with no valid child
    nodes: torch.Tensor  # [B, T, D] long
    on_path: torch.Tensor  # [B, T, D] bool: the path ending at i reaches depth ℓ + 1
    count: torch.Tensor  # [B] leaves (paths)
    mean_floor: torch.Tensor  # [B] ⌊L̄⌋: mean path length (drafted tokens), floored; 0 without paths


def leaf_paths(tree: DraftTree) -> LeafPaths:
    """Root-to-leaf paths of every row's valid tree, ordered by leaf node index, the root excluded."""
    size, device = tree.size, tree.parents.device
    levels = max(1, min(tree.depth_bound or size - 1, size - 1))
    index = shared_arange(size, device)
    drafted = tree.valid & (index > 0)[None]
    parent_of_valid = torch.where(drafted, tree.parents, size)  # the root's -1 and padding → spare column
    has_child = torch.zeros(tree.parents.shape[0], size + 1, dtype=torch.bool, device=device)
    has_child.scatter_(1, parent_of_valid, True)
    is_leaf = drafted & ~has_child[:, :size]
    anc = ancestor_matrix(tree.parents) & drafted[:, None, :]  # [B, T, T]: drafted ancestors, self included
    depth = shared_arange(levels + 1, device)[1:]
    at_level = anc[:, :, None, :] & (tree.depths[:, None, None, :] == depth[None, None, :, None])  # [B,T,D,T]
    nodes = (at_level.long() * index).sum(-1)
    on_path = at_level.any(-1)
    count = is_leaf.long().sum(1)
    lengths = torch.where(is_leaf, tree.depths, 0).sum(1)
    mean_floor = torch.div(lengths, count.clamp_min(1), rounding_mode="floor")
    return LeafPaths(is_leaf, nodes, on_path, count, mean_floor)


def unverified_paths(tree: DraftTree, paths: LeafPaths, uniform: torch.Tensor):
    """The nodes a skipped step commits: per row, a root-to-leaf path drawn uniformly with ``uniform``
    [B] in [0, 1), truncated to γ = min(L_s, ⌊L̄⌋) (VVS Eq. 1). Returns (nodes [B, D], γ [B]); γ is 0
    for a row without drafts."""
    rank = paths.is_leaf.long().cumsum(1) - 1
    pick = (uniform * paths.count).floor().long().clamp_max(paths.count - 1)
    leaf = (paths.is_leaf & (rank == pick[:, None])).long().argmax(1)  # [B]
    depth = paths.nodes.shape[2]
    nodes = paths.nodes.gather(1, leaf[:, None, None].expand(-1, 1, depth)).squeeze(1)
    length = tree.depths.gather(1, leaf[:, None]).squeeze(1)
    gamma = torch.where(paths.count > 0, torch.minimum(length, paths.mean_floor), 0)
    return nodes, gamma


FORMULAS = ("level_mean", "release")
FEW_PATHS = ("skip", "verify")


def path_similarity(
    tree: DraftTree,
    paths: LeafPaths,
    unit: torch.Tensor,
    alpha: float,
    stride: int = 2,
    formula: str = "level_mean",
    few_paths: str = "skip",
) -> torch.Tensor:
    """S̄ [B] of every row's candidate paths against the L2-normalised codebook ``unit`` [V, d]. Pairwise
    sums come from Σ_{i≠j} e_i·e_j = |Σ_i e_i|² − Σ_i |e_i|².

    ``level_mean`` (ours, module doc): per level the mean over the pairs that reach it, weights over
    those levels. ``release`` (HyattDD/VVS): per pair Σ_ℓ w_ℓ cos_ℓ with w_ℓ ∝ α^ℓ normalised over the
    longest kept path and a missing position counting 0, averaged over all pairs. ``few_paths``: with
    fewer than two kept paths, ``skip`` (ours) falls back to all paths and scores a chain 1; ``verify``
    (the release) scores 0."""
    rank = paths.is_leaf.long().cumsum(1) - 1
    kept = paths.is_leaf & (rank % stride == 0)
    if few_paths == "skip":
        kept = torch.where((kept.long().sum(1) < 2)[:, None], paths.is_leaf, kept)
    member = kept[:, :, None] & paths.on_path  # [B, T, D]
    tokens = tree.tokens.gather(1, paths.nodes.flatten(1)).view_as(paths.nodes)
    vectors = unit[tokens] * member[..., None]  # [B, T, D, d]
    n = member.long().sum(1).double()  # [B, D]
    total = vectors.sum(1)
    pair_sum = (total * total).sum(-1).double() - (vectors * vectors).sum((1, -1)).double()
    decay = alpha ** torch.arange(n.shape[1], device=n.device, dtype=torch.float64)
    if formula == "release":
        weights = decay * (n >= 1)  # the levels of the longest kept path
        pairs = (n[:, 0] * (n[:, 0] - 1)).clamp_min(1)  # every kept path reaches level 0
        score = (weights * pair_sum).sum(1) / weights.sum(1).clamp_min(1e-300) / pairs
    else:
        weights = decay * (n >= 2)
        mean = pair_sum / (n * (n - 1)).clamp_min(1)
        score = (weights * mean).sum(1) / weights.sum(1).clamp_min(1e-300)
    return torch.where(n[:, 0] >= 2, score, 1.0 if few_paths == "skip" else 0.0)


@dataclass
class SkippingScheduleConfig(ScheduleConfig):
    """What every skipping schedule's section holds besides its own keys."""

    warmup: int = 0  # no skip while <= warmup image tokens are committed (release: 6)


@dataclass
class UniformScheduleConfig(SkippingScheduleConfig):
    """``UniformSchedule``: skip every ``every``-th step."""

    kind: str = "uniform"
    every: int = 3  # paper: 2, 3, 4
    phase: int | None = None  # skip step s (from 0) if s % every == phase; null: every-1 (release 1)


@dataclass
class SimilarityScheduleConfig(SkippingScheduleConfig):
    """``SimilaritySchedule``: skip when the candidate paths' similarity S̄ >= ``t_sim``. Where the
    authors' release differs: docs/decoding.md, "VVS"; preset vvs_release."""

    kind: str = "similarity"
    t_sim: float = 0.7  # paper: 0.65 - 0.8
    alpha: float = 0.8  # depth decay of the weights w_l ∝ alpha^l (not given by the paper)
    stride: int = 2  # keep every `stride`-th candidate path
    formula: str = "level_mean"  # level_mean (ours) | release (0.9^l over longest path, gaps 0)
    few_paths: str = "skip"  # < 2 candidate paths: skip (ours, S̄ = 1) | verify (release, S̄ = 0)


class SkippingSchedule(VerificationSchedule):
    """A schedule that skips; subclasses say which prompts *want* to, the hard rules decide.
    ``warmup``: no skip while at most that many image tokens are committed (the release: 6, its
    ``new_token <= 5``, which leaves out the first token; ours 0)."""

    can_skip = True

    def __init__(self, config: SkippingScheduleConfig) -> None:
        super().__init__(config)
        warmup = config.warmup
        if warmup < 0:
            raise ValueError(f"the schedule's warmup counts committed tokens: >= 0, got {warmup}")
        self.warmup = warmup

    def wants_skip(self, tree: DraftTree, paths: LeafPaths, active: torch.Tensor, allowed: torch.Tensor):
        """[B] bool: the prompts that would skip; only read where ``allowed``."""
        raise NotImplementedError

    def plan_on_device(self, tree, active, committed, pending) -> StepPlan:
        # Never two skips in a row (pending > 0: the last step was a skip); a tree without drafts (the
        # last image token) needs the target.
        paths = leaf_paths(tree)
        allowed = active & (pending == 0) & (paths.count > 0)
        if self.warmup:
            allowed = allowed & (committed > self.warmup)
        skipped = allowed & self.wants_skip(tree, paths, active, allowed)
        verified = active & ~skipped
        lead = torch.where(verified, pending, 0)
        flags = torch.stack([verified.any(), (lead > 0).any(), skipped.any()])
        return StepPlan(verified, skipped, lead, paths=paths, flags=flags)

    def unverified_paths(self, tree: DraftTree, plan: StepPlan, rng: RowRandom):
        return unverified_paths(tree, plan.paths, rng.uniform(Purpose.PATH, 1)[:, 0])


class UniformSchedule(SkippingSchedule):
    """Skip one step in every ``every`` of each prompt (VVS-U, i ∈ {2, 3, 4} in the paper): step ``s``
    (0-based, skipped steps counted) when ``s % every == phase``; ``phase`` None is ``every − 1`` (ours:
    after ``every − 1`` verified steps), the release's is 1."""

    def __init__(self, config: UniformScheduleConfig) -> None:
        super().__init__(config)
        every, phase = config.every, config.phase
        if every < 1:
            raise ValueError(f"the uniform schedule needs every >= 1, got every={every}")
        phase = every - 1 if phase is None else phase
        if not 0 <= phase < every:
            raise ValueError(f"the uniform schedule's phase must be in [0, every={every}), got {phase}")
        self.every, self.phase = every, phase
        self.steps: torch.Tensor | None = None

    def reset(self, batch: int, device: torch.device | str | None = None) -> None:
        steps = self.steps  # steps taken, skips counted; reset in place when it fits (recorded steps)
        if (
            steps is not None
            and len(steps) == batch
            and (device is None or steps.device == torch.device(device))
        ):
            steps.zero_()
        else:
            self.steps = torch.zeros(batch, dtype=torch.long, device=device)

    def wants_skip(self, tree, paths, active, allowed) -> torch.Tensor:
        self.steps += active.long()
        return (self.steps - 1) % self.every == self.phase


class SimilaritySchedule(SkippingSchedule):
    """Skip when the candidate paths' similarity S̄ reaches ``t_sim`` (VVS-D, Algorithm 1)."""

    def __init__(self, config: SimilarityScheduleConfig, codebook: torch.Tensor) -> None:
        """``codebook`` [V, d]: the image tokens' codebook rows (``ImageTokenizer.codebook``)."""
        super().__init__(config)
        t_sim, alpha, stride = config.t_sim, config.alpha, config.stride
        formula, few_paths = config.formula, config.few_paths
        if alpha <= 0 or stride < 1:
            raise ValueError(f"the similarity schedule needs alpha > 0, stride >= 1: got {alpha}, {stride}")
        if formula not in FORMULAS:
            raise ValueError(f"unknown similarity formula {formula!r}; use one of {FORMULAS}")
        if few_paths not in FEW_PATHS:
            raise ValueError(f"unknown few_paths rule {few_paths!r}; use one of {FEW_PATHS}")
        self.unit = F.normalize(codebook.float(), dim=-1)
        self.t_sim, self.alpha, self.stride = t_sim, alpha, stride
        self.formula, self.few_paths = formula, few_paths
        self.scores: list[torch.Tensor] = []

    def reset(self, batch: int, device: torch.device | str | None = None) -> None:
        # Per step run from Python: S̄ [B] where a skip was allowed, NaN elsewhere (diagnostics; a step
        # replayed as a CUDA graph adds nothing here).
        self.scores = []

    def score(self, tree: DraftTree, paths: LeafPaths | None = None) -> torch.Tensor:
        """S̄ [B] of every row's tree."""
        paths = leaf_paths(tree) if paths is None else paths
        return path_similarity(tree, paths, self.unit, self.alpha, self.stride, self.formula, self.few_paths)

    def wants_skip(self, tree, paths, active, allowed) -> torch.Tensor:
        s = self.score(tree, paths)
        self.scores.append(torch.where(allowed, s, torch.nan))
        return s >= self.t_sim
