"""Reading intermediate layers out of a decoder: what an EAGLE-3 drafter fuses (``Target.forward_*``'s
``taps``)."""

from __future__ import annotations

import torch


def with_taps(
    hidden: torch.Tensor, tapped: list[torch.Tensor], taps: tuple[int, ...], num_layers: int
) -> torch.Tensor:
    """``hidden`` alone, or ``[hidden; h_{taps[0]}; h_{taps[1]}; ...]`` along the last dim, where ``h_k`` is
    Hugging Face's ``hidden_states[k]``: the layers' input for ``k = 0``, the residual stream after ``k``
    decoder layers, and for ``k = num_layers`` the final-norm ``hidden`` itself. One tensor, so recorded
    and compiled steps keep a single output. ``tapped`` holds the states in layer order; a repeated index
    appears once there."""
    if not taps:
        return hidden
    if any(not 0 <= k <= num_layers for k in taps):
        raise ValueError(
            f"tap layers {list(taps)} outside 0 .. {num_layers} (the target has {num_layers} layers)"
        )
    by_layer = dict(zip(sorted(set(taps)), tapped, strict=True))
    if num_layers in by_layer:
        by_layer[num_layers] = hidden
    return torch.cat([hidden, *(by_layer[k] for k in taps)], dim=-1)
