"""Top-k with ties resolved by index, the same on every device (``torch.topk`` leaves ties unspecified).

Draft trees are defined on orders (value, then token id); a tie resolved differently on another device or
batch would change a tree. An int64 key packing value and index is exact but costs several passes of
64-bit arithmetic over the whole vocabulary; this uses two float ``topk`` over the full width and small
sorts over ``k``.
"""

from __future__ import annotations

import torch


def topk_by_index(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``values`` along the last dim, as float32 → (values, indices), descending, equal
    values in ascending index order.

    The first ``topk`` finds the k-th largest value and every larger one (those are in any top k); larger
    values that tie among themselves are put in index order by two stable sorts over ``k``; the second
    ``topk``, over negated indices where a value equals the k-th, picks the lowest-index ties to fill the
    rest. Comparisons treat −0.0 as +0.0.
    """
    values = values.float()
    n = values.shape[-1]
    if n > 2**24:
        raise ValueError(f"{n} columns: indices above 2**24 are not exact as float32")
    top_values, top_index = values.topk(k, dim=-1)  # descending; ties in unspecified order
    kth = top_values[..., -1:]
    larger = (top_values > kth).sum(-1, keepdim=True)  # all in top; they come first
    by_index = top_index.sort(dim=-1).indices
    top_values, top_index = top_values.gather(-1, by_index), top_index.gather(-1, by_index)
    top_index = top_index.gather(-1, top_values.sort(dim=-1, descending=True, stable=True).indices)
    minus_index = -torch.arange(n, device=values.device, dtype=torch.float32)
    tied = torch.where(values == kth, minus_index, float("-inf")).topk(k, dim=-1).values  # lowest first
    position = torch.arange(k, device=values.device)
    tied_index = (-tied.gather(-1, (position - larger).clamp_min(0))).long()
    index = torch.where(position < larger, top_index, tied_index)
    return values.gather(-1, index), index
