"""Latent-neighbour tables for LANTERN / LANTERN++ (docs/decoding.md, "Relaxed acceptance").

For every image token ``v``: its ``K`` nearest tokens in the VQ tokenizer's latent space, nearest first,
``v`` itself excluded. "Latent space" means the code vectors *as the quantiser compares them*
(``target.tokenizer.codebook()``): LlamaGen's VQ-16 L2-normalises its codebook, so ranking the raw
embedding weights (as one public implementation does) gives different, wrong neighbours.

The table is built in row chunks (``cdist`` + ``topk`` over ``chunk_rows`` × V distances at a time), so
memory stays bounded by the chunk and the [V, K] result: a V × V matrix is never formed. It is cached on
disk under a hash of the codebook's bytes and K; a later call loads it instead of recomputing.

Cache folder: the ``cache_dir`` argument, else ``$VDTRAIN_CACHE/neighbours``, else
``~/.cache/vdtrain/neighbours``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_K = 1000
CHUNK_BYTES = 32 * 2**20  # distances held per chunk: chunk_rows × V float32 ≤ 32 MiB


def default_cache_dir() -> Path:
    root = os.environ.get("VDTRAIN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "vdtrain") / "neighbours"


def codebook_hash(codebook: torch.Tensor) -> str:
    """Content hash of the code vectors (fp32 bytes and shape)."""
    data = codebook.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(str(tuple(data.shape)).encode())
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:20]


def clamp_k(k: int, vocab: int) -> int:
    if k < 1:
        raise ValueError(f"the neighbour count k must be >= 1, got {k}")
    return min(k, MAX_K, vocab - 1)


def build_neighbours(codebook: torch.Tensor, k: int, chunk_rows: int | None = None) -> torch.Tensor:
    """[V, k] token ids, nearest first, self excluded; no caching.

    Distances are computed pairwise (no ``|a|² + |b|² − 2ab`` matrix-product shortcut, whose cancellation
    reorders near-ties), so the result does not depend on ``chunk_rows``. Among equal distances the lower
    token id comes first.
    """
    book = codebook.detach().float()
    vocab = book.shape[0]
    k = clamp_k(k, vocab)
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (4 * vocab))
    out = torch.empty(vocab, k, dtype=torch.long, device=book.device)
    for start in range(0, vocab, chunk_rows):
        rows = book[start : start + chunk_rows]
        dist = torch.cdist(rows, book, compute_mode="donot_use_mm_for_euclid_dist")  # [c, V]
        own = torch.arange(start, start + len(rows), device=book.device)
        dist[torch.arange(len(rows), device=book.device), own] = float("inf")  # exclude v itself
        top = dist.topk(k, dim=1, largest=False, sorted=False)
        # Deterministic order: by distance, then by token id (sort ids first, then a stable sort by value).
        ids, order = top.indices.sort(dim=1)
        values = top.values.gather(1, order)
        out[start : start + len(rows)] = ids.gather(1, values.sort(dim=1, stable=True).indices)
        del dist, top
    return out


def latent_neighbours(
    codebook: torch.Tensor,
    k: int,
    cache_dir: str | os.PathLike[str] | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The [V, min(k, 1000, V − 1)] neighbour table of ``codebook`` (LongTensor on the CPU), from the
    disk cache when present, else built and written there."""
    vocab = codebook.shape[0]
    k = clamp_k(k, vocab)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{codebook_hash(codebook)}_k{k}.pt"
    if path.exists():
        table = torch.load(path, map_location="cpu", weights_only=True)
        if table.shape == (vocab, k):
            log.info("latent neighbours: loaded %s", path)
            return table.long()
        log.warning("latent neighbours: %s has shape %s, not %s; rebuilding", path, table.shape, (vocab, k))
    start = time.perf_counter()
    table = build_neighbours(codebook, k, chunk_rows).cpu()
    log.info("latent neighbours: built [%d, %d] in %.1f s", vocab, k, time.perf_counter() - start)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(table.to(torch.int32), tmp)  # ids < 2^31; half the bytes of int64
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole table or none
    log.info("latent neighbours: cached at %s", path)
    return table
