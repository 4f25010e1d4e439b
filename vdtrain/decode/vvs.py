"""VVS: partial verification skipping (ALGORITHMS.md §8), the engine's third part — the *schedule*.

After a tree ``C_t`` is drafted the schedule says, for every prompt at once, whether the step is
verified (``VerificationSchedule.plan``). ``always`` (the default) verifies every step, which is the
plain engine, bit for bit and op for op. The skipping schedules are lossy:

- ``UniformSchedule(every)``: the ``every``-th step of a prompt is skipped (after ``every − 1`` verified
  steps, VVS §4.4); ``every = 1`` asks to skip every step;
- ``SimilaritySchedule``: skip when S̄ ≥ ``t_sim`` (VVS Eq. 2, Algorithm 1, ``path_similarity``).

The hard rules hold for every skipping schedule (``SkippingSchedule.plan``): never two skips in a row
(VVS §4.1) and never a skip of a tree with no drafted token (the last image token needs the target). A
skipped step commits ``unverified_paths`` (one root-to-leaf path drawn uniformly, truncated to
γ = min(L_s, ⌊L̄⌋), VVS Eq. 1) without a target forward; the next verified step post-verifies those
tokens in the same target forward as its tree. The schedule owns both hooks: ``verify`` (the step's
target forward, with the post-verified tokens first) and ``commit_skipped``; the engine's loop calls them.

Everything here is batched tensor work with shapes fixed by the tree (no read of the device); the plan
reads the device once, for the three decisions the loop must take on the host: does any prompt verify
(else no target forward runs), does any verified prompt have unverified tokens to feed first, does any
prompt skip.

Our reading of the similarity score S̄ (the paper gives the formula, not every detail):

- the candidates are the root-to-leaf paths of the drafted (pruned) tree, ordered by their leaf's node
  index (the tree's storage order: parents before children, siblings by drafter rank); a path is its
  drafted tokens, the root excluded;
- "down-sampled with stride 2" keeps every ``stride``-th path (paths 0, 2, 4, …: a quarter of the pairs,
  the paper's "around 25% time cost"); if that leaves fewer than two paths, all paths are kept;
- S^(ℓ) (ℓ = 0 is the first drafted token) = the mean cosine similarity, over all unordered pairs of
  kept paths that reach depth ℓ + 1, of the tokens' latent code vectors (``target.tokenizer.codebook()``,
  the vectors the quantiser compares: L2-normalised for LlamaGen); paths sharing a prefix compare equal
  tokens there (similarity 1);
- S̄ = Σ_ℓ w_ℓ S^(ℓ), w_ℓ = α^ℓ / Σ_k α^k over the levels ℓ = 0 … L − 1 that at least two kept paths reach;
- fewer than two paths (a chain): S̄ = 1 — there is no alternative path the target could pick.

Where the authors' release (HyattDD/VVS) differs, knobs give its behaviour with our defaults kept:
``formula="release"``, ``few_paths="verify"``, ``warmup``, the uniform ``phase`` (and α, the tree depth);
docs/decoding.md (VVS) has the table, ``conf/decode/vvs_release.yaml`` the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.trees import DraftTree, ancestor_matrix

if TYPE_CHECKING:
    from vdtrain.decode.engine import SpeculativeEngine


@dataclass
class StepPlan:
    """One step's verification plan for the batch. ``skipped`` and ``lead`` are None for a schedule
    that never skips (no tensor work at all); the three flags are host booleans, read in one go from
    ``flags`` (``read``; the engine reads them between the two recorded parts of a step)."""

    verify: torch.Tensor  # [B] bool: prompts verified this step
    skipped: torch.Tensor | None  # [B] bool: prompts committing a drafted path without the target
    lead: torch.Tensor | None  # [B]: unverified tokens fed before each verified tree (0 elsewhere)
    any_verify: bool = True  # a target forward is needed
    any_lead: bool = False  # some verified prompt post-verifies tokens (the forward feeds a chain)
    any_skip: bool = False  # some prompt commits an unverified path
    paths: LeafPaths | None = None  # the trees' leaf paths (skipping schedules), for the path pick
    flags: torch.Tensor | None = None  # [3] bool on the device: the three flags, until ``read``

    def flag_values(self) -> tuple[bool, bool, bool]:
        """(any_verify, any_lead, any_skip), read from the device if still there (the one read)."""
        if self.flags is None:
            return self.any_verify, self.any_lead, self.any_skip
        return tuple(self.flags.tolist())

    def with_flags(self, values: tuple[bool, bool, bool]) -> StepPlan:
        """The plan with these flag values on the host."""
        any_verify, any_lead, any_skip = values
        return replace(self, any_verify=any_verify, any_lead=any_lead, any_skip=any_skip, flags=None)

    def read(self) -> StepPlan:
        """The plan with its flags on the host."""
        return self if self.flags is None else self.with_flags(self.flag_values())


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
    index = torch.arange(size, device=device)
    drafted = tree.valid & (index > 0)[None]
    parent_of_valid = torch.where(drafted, tree.parents, size)  # the root's -1 and padding → spare column
    has_child = torch.zeros(tree.parents.shape[0], size + 1, dtype=torch.bool, device=device)
    has_child.scatter_(1, parent_of_valid, True)
    is_leaf = drafted & ~has_child[:, :size]
    anc = ancestor_matrix(tree.parents) & drafted[:, None, :]  # [B, T, T]: drafted ancestors, self included
    depth = torch.arange(1, levels + 1, device=device)
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


class VerificationSchedule:
    """``always``: every step is verified (the plain engine; its plan costs no tensor op)."""

    can_skip: ClassVar[bool] = False

    def reset(self, batch: int, device: torch.device | str | None = None) -> None:
        """A new ``generate`` call with ``batch`` prompts begins."""

    def plan(
        self, tree: DraftTree, active: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor
    ) -> StepPlan:
        """Which of the ``active`` prompts verify this step; ``committed`` [B] tokens so far, of which
        the last ``pending`` [B] are unverified (a skip's path)."""
        return self.plan_on_device(tree, active, committed, pending).read()

    def plan_on_device(
        self, tree: DraftTree, active: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor
    ) -> StepPlan:
        """``plan`` before its flags are read: tensor work only (a recorded step ends here, and the
        engine reads the flags before the rest of the step, recorded once per flag combination)."""
        return StepPlan(verify=active, skipped=None, lead=None)

    def unverified_paths(
        self, tree: DraftTree, plan: StepPlan, rng: RowRandom
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(nodes [B, D], γ [B]) of the path each prompt would commit without verification."""
        raise NotImplementedError(f"{type(self).__name__} never skips a step")

    def verify(self, engine: SpeculativeEngine, tree: DraftTree, plan: StepPlan):
        """The step's target forward: hidden [R, S, H] and the logits at the tree nodes [R, T, V] (the
        trees alone)."""
        return engine._verify_tree(tree)

    def commit_skipped(
        self, engine: SpeculativeEngine, tree: DraftTree, plan: StepPlan, root_feats, root_logits
    ):
        """Commit the skipping prompts' unverified paths (only schedules that skip have any)."""
        raise NotImplementedError(f"{type(self).__name__} never skips a step")


class SkippingSchedule(VerificationSchedule):
    """A schedule that skips; subclasses say which prompts *want* to, the hard rules decide.
    ``warmup``: no skip while at most that many image tokens are committed (the release: 6, its
    ``new_token <= 5``, which leaves out the first token; ours 0)."""

    can_skip = True

    def __init__(self, warmup: int = 0) -> None:
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
        verify = active & ~skipped
        lead = torch.where(verify, pending, 0)
        flags = torch.stack([verify.any(), (lead > 0).any(), skipped.any()])
        return StepPlan(verify, skipped, lead, paths=paths, flags=flags)

    def unverified_paths(self, tree: DraftTree, plan: StepPlan, rng: RowRandom):
        return unverified_paths(tree, plan.paths, rng.uniform(Purpose.PATH, 1)[:, 0])

    def verify(self, engine: SpeculativeEngine, tree: DraftTree, plan: StepPlan):
        """Post-verification: ``plan.lead[b]`` unverified committed tokens before prompt ``b``'s root are
        fed first, in the same target forward: row ``b`` is [those tokens ⊕ its tree ⊕ padding];
        ``hidden`` covers all ``S`` rows, ``p`` the tree nodes. Without a lead, the plain forward."""
        if not plan.any_lead:
            return engine._verify_tree(tree)
        run, target, lead = engine.run, engine.target, plan.lead
        streams, size = run.streams, tree.size
        committed, device = run.committed, run.committed.device
        chain = run.chain
        width_rows = chain + size
        base = committed - 1 - lead  # image index of the first token the target has not seen
        anc = ancestor_matrix(tree.parents) & tree.valid[:, None, :]
        anc |= torch.eye(size, dtype=torch.bool, device=device)
        # Row b: chain (causal) at 0 .. u-1, tree (sees the whole chain, its ancestors, itself) at
        # u .. u+T-1, padding (sees itself; its slots lie past the tree, never read) after.
        j = torch.arange(width_rows, device=device)
        u = lead[:, None]
        in_chain, in_tree = j[None] < u, (j[None] >= u) & (j[None] < u + size)
        node = (j[None] - u).clamp(0, size - 1)  # [B, S]: tree node of row j
        tree_block = anc.gather(1, node[:, :, None].expand(-1, -1, size))  # [B, S, T]: row j's ancestors
        tree_vis = tree_block.gather(2, node[:, None, :].expand(-1, width_rows, -1))  # columns alike
        col_in_tree, col_in_chain = in_tree[:, None, :], in_chain[:, None, :]
        vis = in_chain[:, :, None] & col_in_chain & (j[None, None, :] <= j[None, :, None])
        vis |= in_tree[:, :, None] & (col_in_chain | (col_in_tree & tree_vis))
        vis |= ~(in_chain | in_tree)[:, :, None] & (j[None, None, :] == j[None, :, None])
        chain_tokens = run.out.gather(1, (base[:, None] + j[None]).clamp_max(run.out.shape[1] - 1))
        tokens = torch.where(in_chain, chain_tokens, torch.where(in_tree, tree.tokens.gather(1, node), 0))
        index = torch.where(in_tree, base[:, None] + u + tree.depths.gather(1, node), base[:, None] + j[None])
        index = index.clamp_max(target.num_image_tokens - 1)
        slots = target.image_slot(base[:, None] + j[None])
        vis = engine._visibility(base, base, vis, target.num_image_tokens - 1 + width_rows)
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        result = target.forward_tokens(run.stream, rep(tokens), rep(index), run.tcache, rep(slots), rep(vis))
        rows = rep(lead[:, None] + torch.arange(size, device=device)[None, :])
        logits = result.logits.gather(1, rows[..., None].expand(-1, -1, result.logits.shape[-1]))
        return result.hidden, logits

    def commit_skipped(
        self, engine: SpeculativeEngine, tree: DraftTree, plan: StepPlan, root_feats, root_logits
    ):
        """A skipped step: the prompts in ``plan.skipped`` commit the schedule's path (γ nodes, depth 1
        first) without the target, in fixed shapes (D rows per prompt, D = the path bound).

        The drafter rows of the new tokens' predecessors (the old root and the picked drafts but the
        last) get *stale* features: the most recent cached target features, as many as tokens committed
        (VVS §4.3). With γ tokens committed after ``m``, row ``L+m−1+j`` (j < γ) pairs the cached feature
        of slot ``L+m−1−γ+j`` with the embedding of the token at slot ``L+m+j``; slots before 0 (a skip
        right after the prefill, γ > L) read slot 0. The target KV is left alone: the next verified step
        post-verifies the tokens. Rows of the other prompts, and rows past γ, land in drafter scratch
        slots past the committed ones (never read). Returns the root feature/logits with the skipped
        prompts' rows replaced, and the tokens committed per prompt [B] (0 where not skipped)."""
        run, target = engine.run, engine.target
        committed, fcache, streams = run.committed, run.fcache, run.streams
        device = committed.device
        nodes, gamma = self.unverified_paths(tree, plan, run.rng)
        gamma = torch.where(plan.skipped, gamma, 0)
        width = nodes.shape[1]
        j = torch.arange(width, device=device)[None]  # [1, D]
        at = committed[:, None] + j
        write = j < gamma[:, None]
        run.out.scatter_(1, at, torch.where(write, tree.tokens.gather(1, nodes), run.out.gather(1, at)))
        rep = lambda t: t.repeat(streams, *([1] * (t.dim() - 1)))  # noqa: E731
        stale = target.image_slot(committed[:, None] - 1 - gamma[:, None] + j).clamp(0, fcache.shape[1] - 1)
        feats = fcache.gather(1, rep(stale)[..., None].expand(-1, -1, fcache.shape[-1]))
        base = committed - 1  # image slot of the root, the first row's token
        slots = target.image_slot(base[:, None] + j)
        index = at.clamp_max(target.num_image_tokens)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        vis = engine._visibility(
            base, base, causal.expand(run.batch, -1, -1), target.num_image_tokens - 1 + width
        )
        f_hat, logits = engine.drafter_rows(feats, run.out.gather(1, at), index, slots, vis)
        committed += gamma
        roots = engine.next_roots(f_hat, logits, gamma - 1, plan.skipped, root_feats, root_logits)
        return (*roots, gamma)


class UniformSchedule(SkippingSchedule):
    """Skip one step in every ``every`` of each prompt (VVS-U, i ∈ {2, 3, 4} in the paper): step ``s``
    (0-based, skipped steps counted) when ``s % every == phase``; ``phase`` None is ``every − 1`` (ours:
    after ``every − 1`` verified steps), the release's is 1."""

    def __init__(self, every: int, phase: int | None = None, warmup: int = 0) -> None:
        super().__init__(warmup)
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

    def __init__(
        self,
        codebook: torch.Tensor,
        t_sim: float,
        alpha: float,
        stride: int = 2,
        formula: str = "level_mean",
        few_paths: str = "skip",
        warmup: int = 0,
    ) -> None:
        super().__init__(warmup)
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
