"""Confidence intervals for the benchmark protocol (:mod:`ssd_jax.bench.protocol`), in pure Python.

* :func:`mean_ci`: the mean of a sample with its two-sided Student-t interval.
* :func:`ratio_ci`: the geometric mean of paired ratios (method / AR on the same prompt and
  repeat) with a t-interval computed on the log ratios and mapped back with ``exp``, so the
  interval is multiplicative and a ratio and its inverse get mirrored intervals.
* :func:`clustered`: one value per cluster (the mean over a prompt's repeats), because
  repeats of one prompt are not independent samples of the category: the interval is over
  prompts, with ``n`` = number of prompts.

The t quantile comes from a table for df <= 30 and the Cornish-Fisher expansion above it
(error < 1e-5), so the harness needs no scipy.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence

# two-sided 95% (the 0.975 quantile) of Student's t, df = 1..30
_T975 = (
    12.7062,
    4.3027,
    3.1824,
    2.7764,
    2.5706,
    2.4469,
    2.3646,
    2.3060,
    2.2622,
    2.2281,
    2.2010,
    2.1788,
    2.1604,
    2.1448,
    2.1314,
    2.1199,
    2.1098,
    2.1009,
    2.0930,
    2.0860,
    2.0796,
    2.0739,
    2.0687,
    2.0639,
    2.0595,
    2.0555,
    2.0518,
    2.0484,
    2.0452,
    2.0423,
)
_Z975 = 1.959963984540054


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (the 95% two-sided multiplier)."""
    if df < 1:
        raise ValueError(f"need df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def mean_ci(xs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean; low = high = nan for fewer than 2 values."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(xs) / n
    if n < 2:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = t975(n - 1) * sd / math.sqrt(n)
    return m, m - h, m + h


def ratio_ci(ratios: Sequence[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive ratios: a 95% t-interval on their logs, exponentiated."""
    if any(r <= 0 for r in ratios):
        raise ValueError("ratios must be positive")
    m, lo, hi = mean_ci([math.log(r) for r in ratios])
    return tuple(math.exp(x) if not math.isnan(x) else math.nan for x in (m, lo, hi))  # type: ignore[return-value]


def clustered(pairs: Iterable[tuple[Hashable, float]], log: bool = False) -> list[float]:
    """One value per cluster key: the mean of its values (of their logs, exponentiated, with ``log``)."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for k, v in pairs:
        groups[k].append(math.log(v) if log else v)
    means = [sum(vs) / len(vs) for vs in groups.values()]
    return [math.exp(m) for m in means] if log else means
