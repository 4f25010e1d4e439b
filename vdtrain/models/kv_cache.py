"""A preallocated key/value cache addressed by explicit slots.

Slots (where a token's keys live) are kept separate from positions (which RoPE angle it gets), because
draft-tree nodes are written to scratch slots while taking the grid position of their image index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch


class KVCache:
    """Keys and values of every layer, shaped ``[layers, batch, kv_heads, max_len, head_dim]``: views
    ``k`` and ``v`` of one tensor ``kv`` [2, layers, ...], so a move is one gather and one write."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kv = torch.zeros((2, n_layer, batch, n_kv_head, max_len, head_dim), dtype=dtype, device=device)
        self.k, self.v = self.kv

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def layer(self, index: int) -> LayerCache:
        """Layer ``index``'s keys and values, as views: what a decoder layer reads and writes. Layers get
        no index of their own, so one compiled layer serves them all (``vdtrain.decode.compiled``)."""
        return LayerCache(self.k[index], self.v[index])

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys/values of ``rows`` [R] from slots ``src`` to ``dst`` ([R, S]).

        Used to commit an accepted draft path into contiguous slots; sources are read before any
        destination is written, so overlapping ranges are safe.
        """
        r = rows[:, None]
        self.kv[:, :, r, :, dst] = self.kv[:, :, r, :, src]  # the right side is read (a copy) first


class LayerCache:
    """One layer's keys and values ``[batch, kv_heads, max_len, head_dim]``, views into a ``KVCache``."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ([B, H, S, D]) at ``slots`` ([S] or [B, S]); return the first ``kv_len`` slots."""
        if slots.dim() == 1:
            self.k[:, :, slots] = k
            self.v[:, :, slots] = v
        else:  # per-row slots: one scatter per cache (an index_put would need the rows' arange too)
            at = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.k.scatter_(2, at, k)
            self.v.scatter_(2, at, v)
        return self.k[:, :, :kv_len], self.v[:, :, :kv_len]


class AttendingCache(ABC):
    """A layer cache that also computes the attention over what it holds: a decoder layer hands it
    ``write``'s keys and values and then calls ``attend`` instead of ``scaled_dot_product_attention``.
    Training-time test uses one (``vdtrain.drafters.unroll_cache.UnrollCache``) to attend to keys that
    differ per query row, which no single dense mask expresses in O(k) work."""

    @abstractmethod
    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, S, D] for queries ``q`` and this step's ``k, v`` (heads expanded)."""


class LayerInputs(NamedTuple):
    """What a decoder layer reads besides its rows ``x``: made once per forward, the cache set per layer
    (``at_layer``), so every family's layers share one signature, ``forward(x, at)``."""

    rope: Any  # the family's rotary tables at the rows' positions
    mask: torch.Tensor | None  # the attention mask (or bias) over the keys; None: causal
    cache: LayerCache | AttendingCache | None = None  # the layer's cache; None: the rows see themselves
    slots: torch.Tensor | None = None  # [S] or [B, S] the cache slots of the rows

    def at_layer(self, cache: Any, index: int) -> LayerInputs:
        """These inputs with layer ``index``'s part of a model's ``cache`` (anything with ``layer(i)``:
        a ``KVCache``, an ``AttendingCache``; None: no cache)."""
        return self._replace(cache=None if cache is None else cache.layer(index))
