"""How sure a target is of its next image token: the regime its speculative decoding runs in.

Real visual AR models rarely give their top token more than 0.2 (token selection ambiguity, LANTERN++
§3.2); the shapes target gives it 0.999 at the median. Measured on the target's own samples, teacher
forced back through it, so the figures describe the prefixes decoding actually visits.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import combine_cfg
from vdtrain.targets.base import Target

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
AMBIGUOUS = 0.2  # a token whose top-1 probability is below this is "ambiguous" (LANTERN++'s threshold)


def _summary(logits: torch.Tensor, temperature: float) -> dict[str, object]:
    probs = (logits.float() / temperature).softmax(-1).flatten(0, -2)
    top1 = probs.max(-1).values
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    return {
        "top1_quantiles": dict(
            zip(
                map(str, QUANTILES),
                top1.quantile(torch.tensor(QUANTILES, device=top1.device)).tolist(),
                strict=True,
            )
        ),
        "top1_median": float(top1.median()),
        "share_top1_below_0.2": float((top1 < AMBIGUOUS).float().mean()),
        "mean_entropy_nats": float(entropy.mean()),
    }


@torch.no_grad()
def token_confidence(
    target: Target, captions: list[str], seed: int = 5000, batch_size: int = 8, temperature: float = 1.0
) -> dict[str, dict[str, object]]:
    """Top-1 probability quantiles, the share below 0.2 and the mean entropy of the next-token
    distribution, for the conditional stream and after CFG, at ``temperature`` under the target's
    default sampling (caption ``i`` is sampled with seed ``seed + i``)."""
    sampling = replace(target.sampling_defaults, temperature=temperature)
    samples = []
    for start in range(0, len(captions), batch_size):
        batch = captions[start : start + batch_size]
        gens = [torch.Generator().manual_seed(seed + start + i) for i in range(len(batch))]
        samples.append(generate_ar(target, target.encode_captions(batch), sampling, gens))
    result = confidence_on(target, captions, torch.cat(samples), temperature, batch_size)
    return {**result, "settings": {"captions": len(captions), "seed": seed, "sampling": vars(sampling)}}


@torch.no_grad()
def confidence_on(
    target: Target, captions: list[str], tokens: torch.Tensor, temperature: float = 1.0, batch_size: int = 8
) -> dict[str, dict[str, object]]:
    """``token_confidence`` on given images ``tokens`` [len(captions), N] (e.g. an evaluation's AR rows)."""
    sampling = replace(target.sampling_defaults, temperature=temperature)
    cond_rows, cfg_rows = [], []
    span = slice(target.prefix_length - 1, -1)  # the rows that predict image tokens 0..N-1
    for start in range(0, len(captions), batch_size):
        cond = target.encode_captions(captions[start : start + batch_size])
        batch = tokens[start : start + batch_size].to(target.token_embedding.weight.device)
        logits = target.forward_sequence(cond, batch).logits[:, span]
        cond_rows.append(logits)
        if sampling.uses_cfg:
            uncond = target.forward_sequence(target.null_condition(cond), batch).logits[:, span]
            logits = combine_cfg(logits, uncond, sampling.cfg_scale)
        cfg_rows.append(logits)
    return {
        "conditional": _summary(torch.cat(cond_rows), temperature),
        "after_cfg": _summary(torch.cat(cfg_rows), temperature),
    }
