"""Latent-neighbour table: build time, peak memory and cached reload, on a LlamaGen-sized codebook.

    OMP_NUM_THREADS=1 python benchmarks/neighbours.py                 # 16384 × 8, K = 1000 (VQ-16 size)
    python benchmarks/neighbours.py --vocab 65536 --dim 8 --chunk-rows 256

Builds the table for a random L2-normalised codebook into a fresh cache folder (so the first call always
builds), printing wall time and the peak resident-memory increase (``ru_maxrss`` delta: torch's CPU
allocations are invisible to ``tracemalloc``), then calls again and prints the time of the cached load.
The build holds ``chunk_rows × V`` fp32 distances at a time (default: a 32 MiB budget, 512 rows for
V = 16384) besides the [V, K] result; no V × V matrix is formed.
"""

from __future__ import annotations

import argparse
import logging
import resource
import tempfile
import time

import torch
import torch.nn.functional as F

from vdtrain.decode import neighbours as nb


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--chunk-rows", type=int, default=None, help="default: a 32 MiB distance budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    g = torch.Generator().manual_seed(args.seed)
    book = F.normalize(torch.randn(args.vocab, args.dim, generator=g), dim=-1)
    k = nb.clamp_k(args.k, args.vocab)
    chunk = args.chunk_rows or max(1, nb.CHUNK_BYTES // (4 * args.vocab))
    result_mib = args.vocab * k * 8 / 2**20
    threads = torch.get_num_threads()
    print(f"codebook {args.vocab} x {args.dim}, K = {k}, chunk {chunk} rows, torch threads {threads}")
    print(
        f"result [V, K] int64: {result_mib:.1f} MiB (+ an int32 copy of {result_mib / 2:.1f} MiB to write "
        f"the cache); distances per chunk: {chunk * args.vocab * 4 / 2**20:.1f} MiB"
    )

    with tempfile.TemporaryDirectory() as cache:
        before = max_rss_mib()
        start = time.perf_counter()
        table = nb.latent_neighbours(book, k, cache_dir=cache, chunk_rows=args.chunk_rows)
        build_s = time.perf_counter() - start
        peak = max_rss_mib() - before
        print(
            f"build + cache write: {build_s:.2f} s, peak RSS increase {peak:.1f} MiB "
            f"({peak - result_mib:.1f} MiB beyond the result)"
        )
        start = time.perf_counter()
        again = nb.latent_neighbours(book, k, cache_dir=cache)
        print(f"cached load: {time.perf_counter() - start:.3f} s, identical: {torch.equal(table, again)}")


if __name__ == "__main__":
    main()
