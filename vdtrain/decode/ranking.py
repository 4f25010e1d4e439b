"""Top-k with ties resolved by index, the same on every device (``torch.topk`` leaves ties unspecified).

Draft trees and GSD's rank windows are defined on orders (value, then token id); a tie resolved
differently on another device or batch would change a tree or a verdict. An integer key that packs
value and index is exact but costs several passes of 64-bit arithmetic over the whole vocabulary and
cannot hold a float64 with an index; this uses two float ``topk`` over the full width and small sorts.
"""

from __future__ import annotations

import torch


def topk_by_index(
    values: torch.Tensor, k: int, *, low_index_first: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``values`` along the last dim → (values, indices), descending; equal values in
    ascending index order (``low_index_first``) or descending.

    The first ``topk`` finds the k-th largest value and every larger one (those are all in any top k);
    larger values that tie among themselves are put in index order by two stable sorts over ``k``; the
    second ``topk``, over signed indices where a value equals the k-th, picks the ties that fill the
    rest. Float32 comparisons treat −0.0 as +0.0; bf16/fp16 values are compared as float32.
    """
    if values.dtype != torch.float64:
        values = values.float()
    n = values.shape[-1]
    if values.dtype == torch.float32 and n > 2**24:
        raise ValueError(f"{n} columns: indices above 2**24 are not exact as float32")
    top_values, top_index = values.topk(k, dim=-1)  # descending; ties in unspecified order
    kth = top_values[..., -1:]
    larger = (top_values > kth).sum(-1, keepdim=True)  # all in top; they come first
    by_index = top_index.sort(dim=-1, descending=not low_index_first).indices
    top_values, top_index = top_values.gather(-1, by_index), top_index.gather(-1, by_index)
    top_index = top_index.gather(-1, top_values.sort(dim=-1, descending=True, stable=True).indices)
    index = torch.arange(n, device=values.device, dtype=values.dtype)
    signed = -index if low_index_first else index  # the largest signed index is the first tie to take
    tied = torch.where(values == kth, signed, float("-inf")).topk(k, dim=-1).values
    position = torch.arange(k, device=values.device)
    tied = tied.gather(-1, (position - larger).clamp_min(0))
    tied_index = (-tied if low_index_first else tied).long()
    index = torch.where(position < larger, top_index, tied_index)
    return values.gather(-1, index), index
