"""Confidence intervals and a test for means: the percentile bootstrap over one level
(problems, or seeds), paired, and crossed (seeds x problems), and the paired sign-flip test.

Pure numpy, no I/O; :mod:`dapo.eval.metrics` (``dapo eval``) and :mod:`dapo.ablate.table`
(``dapo ablate``) build on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Bounds one chunk of resampling work to about 4M indices (32 MB as int64, the same again for
# the gathered values), so 10k resamples of 1000 problems never materialise 80 MB at once.
RESAMPLE_CHUNK_ELEMENTS = 1 << 22
# Sign-flip statistics are compared with a little slack so that the flip equal to the observed
# one (or its mirror) counts as "at least as extreme" despite a different summation order. The
# slack is relative to the mean |difference|: rounding in a sum grows with the values' size, so
# a fixed one is swamped for lengths in the thousands (eps * n * mean|d| at worst).
_PERMUTATION_RTOL = 1e-9


@dataclass(frozen=True)
class Interval:
    """A point estimate with a confidence interval."""

    mean: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _as_values(values: Sequence[float], name: str = "values") -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (OverflowError, TypeError, ValueError) as exc:
        # An int beyond a float's range, a string, a ragged list: a ValueError that names the
        # values, as for every other bad input, not numpy's error from deep inside.
        raise ValueError(f"{name} must be numbers: {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty: nothing to estimate")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains NaN or infinity")
    return array


def check_resampling(resamples: int, level: float | None = None) -> None:
    """A ValueError unless ``resamples >= 1`` and ``0 < level < 1``."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if level is not None and not 0.0 < level < 1.0:
        raise ValueError(f"level must lie strictly between 0 and 1, got {level}")


def _bootstrap(array: np.ndarray, resamples: int, seed: int, level: float) -> Interval:
    n = array.size
    rng = np.random.default_rng(seed)
    rows = max(1, RESAMPLE_CHUNK_ELEMENTS // n)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        stop = min(start + rows, resamples)
        index = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = array[index].mean(axis=1)
    low, high = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return Interval(mean=float(array.mean()), low=float(low), high=float(high))


def bootstrap_ci(
    values: Sequence[float],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
    name: str = "values",
) -> Interval:
    """Percentile-bootstrap interval for the mean of per-problem ``values``.

    Problems are resampled with replacement ``resamples`` times; ``low`` and ``high`` are the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled means, and ``mean``
    is the plain mean. The draws come from ``numpy.random.default_rng(seed)``, so the same
    inputs and seed give the same interval; with the same seed, metrics of the same problems
    are resampled with the same draws and their intervals are mutually consistent. ``name``
    is what an error message calls the values.
    """
    check_resampling(resamples, level)
    return _bootstrap(_as_values(values, name), resamples, seed, level)


def fraction_ci(
    values: Sequence[float],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
    name: str = "values",
) -> Interval:
    """:func:`bootstrap_ci` for per-problem fractions in [0, 1] (accuracy, pass@k, a share).

    Where every problem has the same value (none solved, all solved, or one problem), no
    resample of the problems can move the mean, and the percentile bootstrap's interval has
    zero width: certainty that 30 problems do not give. There the interval is Wilson's score
    interval for that mean over ``len(values)`` problems, each counted as one trial, the
    widest spread [0, 1] values of that mean can have: none of 30 solved reads
    0.000 [0.000, 0.114] at 95%.
    """
    check_resampling(resamples, level)
    array = _as_values(values, name)
    if array.min() < 0.0 or array.max() > 1.0:
        raise ValueError(f"{name} must be fractions in [0, 1], got {array.min()}..{array.max()}")
    if array.min() != array.max():
        return _bootstrap(array, resamples, seed, level)
    p, n = float(array[0]), array.size
    z2 = NormalDist().inv_cdf((1.0 + level) / 2.0) ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = (z2 * p * (1 - p) / n + z2 * z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    # At p = 0 or 1 the bound on that side is the value itself (not a rounding of it).
    low = 0.0 if p == 0.0 else max(0.0, centre - half)
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return Interval(mean=p, low=low, high=high)


def _paired_differences(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    return _as_values(b, "b") - _as_values(a, "a")


def paired_bootstrap_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Bootstrap interval for ``mean(b - a)`` where ``a[i]`` and ``b[i]`` are the same problem.

    Resampling whole problems keeps each pair together, so the shared per-problem difficulty
    cancels and the interval is much tighter than one from two independent intervals.
    """
    check_resampling(resamples, level)
    return _bootstrap(_paired_differences(a, b), resamples, seed, level)


def paired_fraction_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """:func:`paired_bootstrap_ci` for per-problem fractions in [0, 1].

    Where every problem's difference ``b - a`` is the same ``d`` (one problem, or two
    evaluations that agree on each), no resample can move the mean and the percentile
    bootstrap's interval has zero width, as :func:`fraction_ci`'s would. There ``q``, the
    Wilson upper bound on the share of problems whose difference is not ``d`` (none of ``n``
    seen), bounds the mean: such a difference lies in [-1, 1], so the interval is
    ``[d - q (1 + d), d + q (1 - d)]``. Two evaluations solving none of 30 problems read
    0.000 [-0.114, 0.114] at 95%, as wide as each side's own interval.
    """
    check_resampling(resamples, level)
    differences = _paired_differences(a, b)
    for side, name in ((a, "a"), (b, "b")):
        if min(side) < 0.0 or max(side) > 1.0:
            raise ValueError(f"{name} must be fractions in [0, 1], got {min(side)}..{max(side)}")
    # Differences equal but for their last bits (0.2 - 0.1 and 0.7 - 0.6) are the same.
    if np.ptp(differences) > 1e-12:
        return _bootstrap(differences, resamples, seed, level)
    d = float(differences.mean())
    q = fraction_ci(np.zeros(differences.size), level=level).high  # none of n differ
    return Interval(mean=d, low=max(-1.0, d - q * (1 + d)), high=min(1.0, d + q * (1 - d)))


def crossed_bootstrap_ci(
    values: Sequence[Sequence[float]],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Percentile-bootstrap interval for the mean of ``values[s][p]``: runs (seeds) ``s`` crossed
    with the same held-out problems ``p``.

    Each resample draws the seeds with replacement and, independently, the problems with
    replacement, and averages the chosen cells: both the run-to-run noise and the choice of
    problems widen the interval. For a paired comparison, pass the differences ``b - a`` cell
    by cell (same seed, same problem). One seed reduces it to a bootstrap over problems, one
    problem to a bootstrap over seeds.
    """
    check_resampling(resamples, level)
    matrix = np.asarray(values, dtype=np.float64)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(f"values must be a non-empty seeds x problems table, got {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ValueError("values contains NaN or infinity")
    seeds, problems = matrix.shape
    rng = np.random.default_rng(seed)
    rows = max(1, RESAMPLE_CHUNK_ELEMENTS // (seeds + problems))
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        n = min(start + rows, resamples) - start
        # How often each seed and each problem is drawn: a mean over the drawn cells is
        # (seed counts) @ values @ (problem counts) / (seeds * problems).
        w_seed = rng.multinomial(seeds, np.full(seeds, 1.0 / seeds), size=n)
        w_problem = rng.multinomial(problems, np.full(problems, 1.0 / problems), size=n)
        means[start : start + n] = ((w_seed @ matrix) * w_problem).sum(axis=1)
    means /= seeds * problems
    low, high = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return Interval(mean=float(matrix.mean()), low=float(low), high=float(high))


def paired_permutation_pvalue(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> float:
    """Two-sided paired sign-flip test of "a and b score the same on average".

    Under the null hypothesis each per-problem difference ``d = b - a`` is as likely to have
    either sign, so random sign flips ``s`` give its null distribution. The p-value is
    ``(1 + #{|mean(s * d)| >= |mean(d)|}) / (1 + resamples)``, which is never 0 and is valid for
    a finite number of random flips. It is exactly 1.0 when every difference is 0. When the
    2^n sign patterns are no more than ``resamples`` (n <= 13 at the default: seeds, not
    problems) every pattern is counted once and the p-value is exact: 2/2^n when all n
    differences share a sign (0.25 for 3 seeds, 0.0078 for 8).
    """
    check_resampling(resamples)
    d = _paired_differences(a, b)
    if not np.any(d):
        return 1.0
    n = d.size
    # The observed statistic is the all-plus pattern, summed as the flipped ones are.
    observed = abs(float(np.ones(n) @ d)) / n
    observed -= _PERMUTATION_RTOL * float(np.abs(d).sum()) / n
    rows, extreme = max(1, RESAMPLE_CHUNK_ELEMENTS // n), 0
    if 2**n <= resamples:  # few pairs (seeds): every sign pattern, the exact p-value
        for start in range(0, 2**n, rows):  # a block of patterns at a time, as below
            bits = (np.arange(start, min(start + rows, 2**n))[:, None] >> np.arange(n)) & 1
            signs = bits.astype(np.float64) * 2.0 - 1.0
            extreme += int(np.count_nonzero(np.abs(signs @ d) / n >= observed))
        return extreme / 2**n
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, rows):
        stop = min(start + rows, resamples)
        signs = rng.integers(0, 2, size=(stop - start, n)).astype(np.float64) * 2.0 - 1.0
        extreme += int(np.count_nonzero(np.abs(signs @ d) / n >= observed))
    return (1 + extreme) / (1 + resamples)


def holm_adjusted(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the order given.

    A table tests several rows at once; by chance alone one of m true-null rows falls under
    0.05 with probability up to 1 - 0.95^m. Holm's step-down correction bounds that
    family-wise error: sort the m p-values, multiply the i-th smallest by (m - i + 1), take
    the running maximum (so the order is kept) and cap at 1. Rejecting where the adjusted
    value is under alpha is Holm's procedure at level alpha, never weaker than Bonferroni.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
