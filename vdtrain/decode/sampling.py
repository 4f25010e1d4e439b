"""The one sampling pipeline, shared by AR, every speculative method and the drafter.

``l = l_uncond + s·(l_cond − l_uncond)`` → ``/ temperature`` → top-k → top-p → softmax = p.
Temperature 0 is greedy: p is the one-hot of the argmax of the same masked logits, so verification code
can treat greedy and sampled decoding alike. With CFG every model runs a batch of two streams, the
conditional rows then the null rows (``cfg_batch``, ``split_cfg``). docs/decoding.md, "The sampling
pipeline".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vdtrain.sampling_config import SamplingConfig

if TYPE_CHECKING:
    from vdtrain.targets.base import Condition, Target


def cfg_batch(target: Target, cond: Condition, sampling: SamplingConfig) -> Condition:
    """Rows ``[cond; null]`` when CFG is on, else ``cond`` alone (``sampling.streams`` rows per prompt)."""
    return cond.cat(target.null_condition(cond)) if sampling.uses_cfg else cond


def split_cfg(logits: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of a CFG batch → (conditional rows, null rows or None)."""
    if not sampling.uses_cfg:
        return logits, None
    cond, uncond = logits.chunk(2)
    return cond, uncond


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    if uncond is None:
        return cond
    return uncond + scale * (cond - uncond)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set everything outside the top-k, then outside the top-p nucleus, to -inf.

    The nucleus keeps the smallest set of most likely tokens whose mass reaches ``top_p``
    (the token that crosses the threshold is kept).
    """
    if 0 < top_k < logits.shape[-1]:
        # The k-th largest value in one selection kernel (the top-k values' minimum took two).
        kth = logits.kthvalue(logits.shape[-1] - top_k + 1, dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor | None, config: SamplingConfig) -> torch.Tensor:
    """CFG and temperature applied, in fp32 (at T=0 untempered): the logits before top-k and top-p."""
    logits = combine_cfg(cond.float(), None if uncond is None else uncond.float(), config.cfg_scale)
    if not config.greedy and config.temperature != 1.0:  # dividing by 1 is exact: skip the kernel
        logits = logits / config.temperature
    return logits


def processed_logits(cond: torch.Tensor, uncond: torch.Tensor | None, config: SamplingConfig) -> torch.Tensor:
    """CFG, temperature and filtering applied, in fp32; at T=0 the filtered, untempered logits."""
    return filter_logits(guided_logits(cond, uncond, config), config.top_k, config.top_p)


def probabilities(cond: torch.Tensor, uncond: torch.Tensor | None, config: SamplingConfig) -> torch.Tensor:
    """The target (or drafter) distribution p over image tokens; one-hot of the argmax at T=0."""
    return distribution(processed_logits(cond, uncond, config), config)


def distribution(processed: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``processed_logits`` → p: their softmax, or at T=0 the one-hot of their argmax."""
    if config.greedy:
        return torch.zeros_like(processed).scatter_(-1, processed.argmax(-1, keepdim=True), 1.0)
    return processed.softmax(-1)


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], row ``b`` drawn with ``generators[b]``.

    Per-row generators make a sample depend on its own seed only, not on what it was batched with.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{probs.shape[0]} rows but {len(generators)} generators")
    return torch.cat(
        [torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators, strict=True)]
    )


def next_tokens(
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    config: SamplingConfig,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Tokens [B] from logits [B, V]: argmax at T=0, else a draw from p."""
    if config.greedy:
        return processed_logits(cond, uncond, config).argmax(-1)
    return sample_rows(probabilities(cond, uncond, config), generators)
