"""The ``k`` largest values of each row, ties to the lower index: how a dynamic tree picks a node's children.

Two twins, chosen by ``kernels.plain_kernels()`` and tested equal (``tests/test_dynamic_builder.py``): plain,
one stable descending sort of the row cut at ``k``; fast, one max reduction at ``k`` = 1, else
(``_chunked``) no selection over the whole row
(a slow radix select on a GPU; docs/decoding.md, "Vocabulary-wide selections"): the row is cut into about
√N chunks and only the ``k`` chunks whose maxima come first by (maximum, chunk index) are sorted.

Why those chunks suffice: let e be among the first ``k`` by (value desc, index asc), in chunk X. Each chunk
Y ranked before X holds an element that precedes e (its maximum's first occurrence: a larger value, or an
equal one at a lower index since Y lies before X), so fewer than ``k`` chunks precede X."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vdtrain.decode.kernels import plain_kernels, shared_arange


def top_k_low_index_first(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``values`` [..., N] along the last dim, equal values in ascending index order →
    (values, indices), [..., k] each (``-0.0`` ties ``+0.0``; no NaN)."""
    if plain_kernels():
        return _sorted(values, k)
    if k == 1:  # a reduction: max returns the first maximal index
        top = values.max(-1, keepdim=True)
        return top.values, top.indices
    return _chunked(values, k)


def _sorted(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = values.sort(dim=-1, descending=True, stable=True)  # stable: equal values keep index order
    return top.values[..., :k], top.indices[..., :k]


def _chunked(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Saves eagle2 the plain twin's six vocabulary-wide sorts a step for 31 ordinary kernels: 471 weighted
    ops beyond the target's layers instead of 565 (LlamaGen-XL shape, B = 1, ``step_kernels --phases``)."""
    n = values.shape[-1]
    chunk = max(1, math.isqrt(n))
    chunks = -(-n // chunk)
    if chunks <= k:  # a short row: every chunk would be sorted anyway
        return _sorted(values, k)
    # Padding sorts last: it is −inf, and at a higher index than any −inf of the row.
    padded = F.pad(values, (0, chunks * chunk - n), value=float("-inf")) if n % chunk else values
    maxima = padded.unflatten(-1, (chunks, chunk)).amax(-1)  # [..., chunks]
    held = maxima.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    # The held chunks' columns in ascending order, gathered from the chunked arange (one kernel).
    every = shared_arange(chunks * chunk, values.device).view(chunks, chunk)
    columns = every.expand(*held.shape[:-1], -1, -1).gather(-2, held[..., None].expand(*held.shape, chunk))
    columns = columns.flatten(-2)
    top = padded.gather(-1, columns).sort(dim=-1, descending=True, stable=True)
    return top.values[..., :k], columns.gather(-1, top.indices[..., :k])
