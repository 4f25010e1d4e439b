"""The ``k`` largest values of each row, ties to the lower index: how a dynamic tree picks a node's children.

Two twins, chosen by ``kernels.plain_kernels()`` and tested equal (``tests/test_dynamic_builder.py``):

- plain: one stable descending sort of the whole row, cut at ``k``;
- fast (``_chunked``): no selection over the whole row. The row is cut into about √N contiguous chunks;
  the ``k`` largest values lie in the ``k`` chunks whose maxima come first by (maximum, chunk index), so
  only those ``k`` chunks are sorted. A vocabulary-wide selection is a slow kernel on a GPU (radix select,
  one block per row: about 73 µs for float32 over 16 384 columns on an H200, 145 µs for the int64 key
  ``topk`` that ranked children before; ``conf/benchmarks/kernel_weights.yaml``). What it saves, measured
  at the LlamaGen-XL shape (``benchmarks.step_kernels --phases``, eagle2, B = 1): the plain twin's six
  vocabulary-wide sorts a step, for 31 more ordinary kernels (a chunk maximum, two small sorts, two
  gathers each): eagle2's step beyond the target's layers weighs 471 ordinary kernels instead of 565
  (docs/decoding.md, "Vocabulary-wide selections").

Why the chunks suffice: let e be among the first ``k`` by (value desc, index asc), in chunk X. Each chunk
Y ranked before X by (maximum desc, chunk asc) holds an element y that precedes e (its maximum, first
occurrence: a larger value, or an equal one at a lower index since Y lies before X). So fewer than ``k``
chunks precede X.
"""

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
    return _chunked(values, k)


def _sorted(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = values.sort(dim=-1, descending=True, stable=True)  # stable: equal values keep index order
    return top.values[..., :k], top.indices[..., :k]


def _chunked(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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
