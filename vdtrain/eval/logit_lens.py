"""The logit lens: how much of the target's next-token decision each layer's residual stream already holds.

``hidden_states[k]`` (the stream after ``k`` decoder layers) is put through the target's final norm and
head, and its argmax compared with the target's own. An EAGLE-3 drafter's taps are chosen by it
(``Target.default_feature_layers``, docs/training.md, "EAGLE-3 drafters"): a drafter that reads a layer
far below the top must redo the layers above it with its one layer.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vdtrain.decode.ar import generate_ar
from vdtrain.targets.base import Target, split_taps


@torch.no_grad()
def logit_lens(target: Target, captions: list[str], seed: int = 5000, batch_size: int = 8) -> list[float]:
    """Top-1 agreement with the target's argmax of ``head(norm(hidden_states[k]))`` for ``k = 0 .. n``
    (the last is the final state itself, 1.0), over the rows that predict image tokens, conditional
    stream, on the target's own samples at its default sampling (caption ``i`` drawn with seed
    ``seed + i``): the prefixes decoding visits."""
    n = target.num_layers
    norm = target.transformer.norm
    span = slice(target.prefix_length - 1, -1)  # the rows that predict image tokens 0 .. N-1
    hits, rows = torch.zeros(n + 1), 0
    for start in range(0, len(captions), batch_size):
        cond = target.encode_captions(captions[start : start + batch_size])
        gens = [torch.Generator().manual_seed(seed + start + i) for i in range(len(cond))]
        tokens = generate_ar(target, cond, replace(target.sampling_defaults), gens)
        states = target.sequence_features(cond, tokens, tuple(range(n + 1)))
        hidden, tapped = split_taps(states, target.hidden_size, n + 1)
        top = target.head(hidden[:, span]).argmax(-1)
        layers = tapped[:, span].unflatten(-1, (n + 1, target.hidden_size))
        for k in range(n + 1):
            state = layers[..., k, :] if k == n else norm(layers[..., k, :])
            hits[k] += (target.head(state).argmax(-1) == top).sum().item()
        rows += top.numel()
    return (hits / rows).tolist()
