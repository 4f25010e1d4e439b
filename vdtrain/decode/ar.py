"""Plain autoregressive generation: the baseline every speculative method is measured against.

A static KV cache; with CFG the conditional and null streams run as one batch of two. Every step has the
same shapes (the mask spans the whole image), as in gpt-fast, so a compiled forward is captured once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vdtrain.decode.sampling import SamplingConfig, cfg_batch, next_tokens, split_cfg
from vdtrain.targets.base import Condition, Target


@torch.no_grad()
def generate_ar(
    target: Target,
    cond: Condition,
    sampling: SamplingConfig,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Image tokens [B, N] for the captions in ``cond``, one target forward per token."""
    stream = cfg_batch(target, cond, sampling)
    batch, n_tokens, prefix = len(cond), target.num_image_tokens, target.prefix_length
    cache = target.new_cache(len(stream))
    logits = target.prefill(stream, cache).logits[:, -1]
    out = torch.empty(batch, n_tokens, dtype=torch.long, device=logits.device)
    for i in range(n_tokens):
        token = next_tokens(*split_cfg(logits, sampling), sampling, generators)
        out[:, i] = token
        if i == n_tokens - 1:
            break
        feed = token.repeat(len(stream) // batch)[:, None]
        index = torch.tensor([i], device=logits.device)
        logits = target.forward_tokens(
            stream,
            feed,
            index,
            cache,
            slots=index + prefix,
            image_visibility=target.causal_visibility(i, 1, logits.device, width=n_tokens),
        ).logits[:, -1]
    return out
