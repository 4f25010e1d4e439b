"""Chi-square tests of sampled images against the exact distribution, with power where a whole-image test
has little: one test over whole images, one per position and one per pair of adjacent positions, read
together under a Bonferroni bound. A drafting error that moves mass between images of similar
probability, or inside the whole-image test's pooled bin, still shifts some position's or pair's law."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from scipy.stats import chisquare

Image = tuple[int, ...]


def _pvalue(samples: Sequence[Image], exact: dict[Image, float], key: Callable[[Image], tuple]) -> float:
    """Chi-square of ``key(x)``'s law, with outcomes expected fewer than 5 times pooled into one bin."""
    law: Counter = Counter()
    for x, p in exact.items():
        law[key(x)] += p
    seen = Counter(key(x) for x in samples)
    total = len(samples)
    big = [k for k in law if law[k] * total >= 5]
    observed = [seen[k] for k in big]
    expected = [law[k] * total for k in big]
    rest = total - sum(observed), total - sum(expected)
    if rest[1] >= 1e-9 * total:
        observed.append(rest[0])
        expected.append(rest[1])
    if len(observed) < 2:
        return 1.0  # one outcome: nothing to test
    scale = total / sum(expected)  # the exact law sums to 1 up to rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def marginal_pvalues(samples: Sequence[Image], exact: dict[Image, float]) -> dict[str, float]:
    """Each test's p-value: ``image``, ``position k`` and ``pair k`` (positions k and k + 1)."""
    n = len(next(iter(exact)))
    tests = {"image": _pvalue(samples, exact, lambda x: x)}
    for k in range(n):
        tests[f"position {k}"] = _pvalue(samples, exact, lambda x, k=k: (x[k],))
    for k in range(n - 1):
        tests[f"pair {k}"] = _pvalue(samples, exact, lambda x, k=k: (x[k], x[k + 1]))
    return tests


def bonferroni_pvalue(samples: Sequence[Image], exact: dict[Image, float]) -> float:
    """The family's p-value: the smallest test's times the number of tests (at most 1). Compared with a
    significance level it controls the chance that any test rejects a correct sampler."""
    tests = marginal_pvalues(samples, exact)
    return min(1.0, len(tests) * min(tests.values()))
