"""Speed-ups that survive a shared machine: interleaved repeats of one fixed decode, paired ratios.

One wall-clock sample per method is not a measurement where other processes come and go: a single slow
AR decode (96 s where the same prompts took 3.5 s a minute later) read as a 6x speedup on a CPU. So each
method decodes the same fixed batch ``repeats`` times, after an untimed warm-up, round by round with AR
and every other method in turn (an evaluation's own warm decode of that batch serves as round 1); round
``r``'s ratio is AR's time over the method's in that round (a slow spell lands on neighbours alike), and
the row reports the median ratio with its interquartile spread. A ratio whose spread is wider than its
distance from 1 cannot say which is faster: the table marks it (``Spread.clear``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spread:
    """A speedup's median over paired rounds and its interquartile range."""

    median: float
    low: float  # 25th percentile of the rounds' ratios
    high: float  # 75th percentile
    rounds: int

    @property
    def clear(self) -> bool:
        """The spread is no wider than the median's distance from 1: it tells faster from slower."""
        return self.high - self.low <= abs(self.median - 1.0)


def paired_speedup(ar: Sequence[float], method: Sequence[float]) -> Spread:
    """AR's time over the method's, round by round: the median and quartiles of those ratios."""
    if len(ar) != len(method) or not ar:
        raise ValueError(f"paired timings need as many rounds of each, got {len(ar)} and {len(method)}")
    ratios = np.asarray(ar, dtype=float) / np.asarray(method, dtype=float)
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return Spread(float(median), float(low), float(high), len(ratios))


def interleaved(
    decodes: Mapping[str, Callable[[], float]],
    repeats: int,
    first_round: Mapping[str, float] | None = None,
) -> dict[str, list[float]]:
    """Each decode's seconds over ``repeats`` rounds; every decode runs once untimed first (caches,
    allocator, a GPU's recorded steps), then each round runs them all in turn. A decode returns the
    seconds it measured itself (device-synchronised). ``first_round``: each decode's seconds from a round
    the caller already ran warm, one after another (an evaluation's own decode of the same batch); it is
    round 1 and stands in for the warm-up, so a table pays for ``repeats - 1`` rounds, not ``repeats + 1``."""
    if repeats < 1:
        raise ValueError(f"speed.repeats must be at least 1, got {repeats}")
    seconds: dict[str, list[float]] = {name: [] for name in decodes}
    if first_round is None:
        for decode in decodes.values():
            decode()
    else:
        for name in decodes:
            seconds[name].append(first_round[name])
    for _ in range(repeats - len(next(iter(seconds.values()), []))):
        for name, decode in decodes.items():
            seconds[name].append(decode())
    return seconds
