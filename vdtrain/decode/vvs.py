"""VVS: partial verification skipping (ALGORITHMS.md §8), the engine's third part — the *schedule*.

After a tree ``C_t`` is drafted the schedule says whether the step is verified. ``always`` (the default)
verifies every step, which is the plain engine, bit for bit. The skipping schedules are lossy:

- ``UniformSchedule(every)``: the ``every``-th step of a prompt is skipped (after ``every − 1`` verified
  steps, VVS §4.4); ``every = 1`` asks to skip every step;
- ``SimilaritySchedule``: skip when S̄ ≥ ``t_sim`` (VVS Eq. 2, Algorithm 1, ``path_similarity``).

The engine, not the schedule, enforces the hard rules: never two skips in a row (VVS §4.1) and never a
skip of a tree with no drafted token (the last image token needs the target). A skipped step commits
``unverified_path`` (one root-to-leaf path drawn uniformly, truncated to γ = min(L_s, ⌊L̄⌋), VVS Eq. 1)
without a target forward; the next verified step post-verifies those tokens in the same target forward
as its tree (``SpeculativeEngine._verify``).

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from vdtrain.decode.trees import DraftTree


def leaf_paths(tree: DraftTree, row: int) -> list[list[int]]:
    """Root-to-leaf paths of row ``row``'s valid tree as node lists (depth 1 first, root excluded),
    ordered by leaf node index. A tree with no valid draft has no path."""
    parents, valid = tree.parents[row].tolist(), tree.valid[row].tolist()
    has_child = [False] * len(parents)
    for i in range(1, len(parents)):
        if valid[i]:
            has_child[parents[i]] = True
    paths = []
    for leaf in range(1, len(parents)):
        if valid[leaf] and not has_child[leaf]:
            path, node = [], leaf
            while node > 0:
                path.append(node)
                node = parents[node]
            paths.append(path[::-1])
    return paths


def truncation_length(paths: Sequence[Sequence[int]], chosen: int) -> int:
    """γ = min(L_s, ⌊L̄⌋) (VVS Eq. 1): L_s = drafted tokens on the chosen path, L̄ = mean over all paths."""
    mean_floor = sum(len(p) for p in paths) // len(paths)  # integer floor: no 2.9999 surprises
    return min(len(paths[chosen]), mean_floor)


def unverified_path(tree: DraftTree, row: int, generator: torch.Generator | None) -> list[int]:
    """The nodes a skipped step commits: a path drawn uniformly among the root-to-leaf paths with the
    prompt's generator, truncated to γ. Empty when the tree has no draft (the engine then verifies)."""
    paths = leaf_paths(tree, row)
    if not paths:
        return []
    device = generator.device if generator is not None else "cpu"
    chosen = int(torch.randint(len(paths), (), generator=generator, device=device))
    return paths[chosen][: truncation_length(paths, chosen)]


def path_similarity(
    paths: Sequence[Sequence[int]], codebook: torch.Tensor, alpha: float, stride: int = 2
) -> float:
    """S̄ of candidate token paths (token ids, depth 1 first) against ``codebook`` [V, d] (module doc)."""
    kept = list(paths)[::stride]
    if len(kept) < 2:
        kept = list(paths)
    if len(kept) < 2:
        return 1.0
    unit = F.normalize(codebook.float(), dim=-1)
    total = weights = 0.0
    for level in range(max(len(p) for p in kept)):
        tokens = [p[level] for p in kept if len(p) > level]
        n = len(tokens)
        if n < 2:
            break  # deeper levels are reached by fewer paths still
        e = unit[torch.tensor(tokens, device=unit.device)]
        gram = e @ e.T
        mean = float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1)))
        total += alpha**level * mean
        weights += alpha**level
    return total / weights


class VerificationSchedule:
    """``always``: every step is verified (the plain engine)."""

    can_skip: ClassVar[bool] = False

    def reset(self, batch: int) -> None:
        """A new ``generate`` call with ``batch`` prompts begins."""

    def wants_skip(self, tree: DraftTree, row: int, step: int) -> bool:
        """Whether prompt ``row`` would skip its ``step``-th step (1-based, skipped steps counted). The
        engine asks only when a skip is allowed (the previous step was verified, the tree has drafts)."""
        return False


class UniformSchedule(VerificationSchedule):
    """Skip every ``every``-th step of each prompt (VVS-U, i ∈ {2, 3, 4} in the paper)."""

    can_skip = True

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"the uniform schedule needs every >= 1, got every={every}")
        self.every = every

    def wants_skip(self, tree: DraftTree, row: int, step: int) -> bool:
        return step % self.every == 0


class SimilaritySchedule(VerificationSchedule):
    """Skip when the candidate paths' similarity S̄ reaches ``t_sim`` (VVS-D, Algorithm 1)."""

    can_skip = True

    def __init__(self, codebook: torch.Tensor, t_sim: float, alpha: float, stride: int = 2) -> None:
        if alpha <= 0 or stride < 1:
            raise ValueError(f"the similarity schedule needs alpha > 0, stride >= 1: got {alpha}, {stride}")
        self.codebook, self.t_sim, self.alpha, self.stride = codebook, t_sim, alpha, stride
        self.scores: list[list[float]] = []

    def reset(self, batch: int) -> None:
        self.scores = [[] for _ in range(batch)]  # S̄ of every scored tree, per prompt (diagnostics)

    def score(self, tree: DraftTree, row: int) -> float:
        tokens = tree.tokens[row].tolist()
        paths = [[tokens[i] for i in p] for p in leaf_paths(tree, row)]
        return path_similarity(paths, self.codebook, self.alpha, self.stride)

    def wants_skip(self, tree: DraftTree, row: int, step: int) -> bool:
        s = self.score(tree, row)
        if row < len(self.scores):
            self.scores[row].append(s)
        return s >= self.t_sim
