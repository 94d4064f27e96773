"""Statistics the tables, figures and claims share: the unbiased pass@k, the one interval rule, Holm, power.

The unit of replication is the seed (one RL run). With 3-5 seeds per arm, every interval in this package (table
cells, figure bands, forest plot, claims) comes from one function, :func:`interval`: the Student-t 95% interval of
a mean, applied to per-seed values or to same-seed paired differences. (A percentile bootstrap over 3 seeds never
leaves the range of the data and excludes 0 whenever all three share a sign; it is not used.)

Planned comparisons of one claim are decided with Holm's step-down correction (:func:`holm`) on the t-test
p-values; a comparison that is not significant is "not reproduced at this scale" only when the test had power
:data:`POWER_TARGET` to see the claim's smallest effect of interest (:func:`power`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from scipy import optimize
from scipy import stats as sps

LEVEL = 0.95
ALPHA = 1 - LEVEL
POWER_TARGET = 0.8


# ------------------------------------------------------------------------------------------------ pass@k
def _pass_exact(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) as the float nearest the exact fraction."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, the Codex paper).

    Args:
        n: (P,) samples drawn per problem; c: (P,) correct samples among them; k: samples per attempt.

    Returns:
        (P,) float; NaN where n < k. Each value is the float nearest the exact fraction (integer binomials,
        computed once per distinct (n, c) pair, of which there are few: n is the samples per problem).
    """
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r} is not valid; allowed: an integer >= 1")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("pass_at_k needs 0 <= c <= n for every problem")
    out = np.full(n.shape, np.nan)
    ok = n >= k
    if not ok.any():
        return out
    # one int64 key per (n, c) pair; the distinct keys found by counting (no sort: n is small, so are the keys),
    # or by np.unique when they span too much for a table
    width = int(c[ok].max()) + 1
    key = n[ok] * width + c[ok]
    if int(key.max()) < PASS_TABLE_MAX:
        present = np.bincount(key)
        keys = np.flatnonzero(present)
        table = np.empty(len(present))
        table[keys] = [_pass_exact(int(q // width), int(q % width), int(k)) for q in keys]
        out[ok] = table[key]
        return out
    keys, inverse = np.unique(key, return_inverse=True)
    values = np.array([_pass_exact(int(q // width), int(q % width), int(k)) for q in keys])
    out[ok] = values[inverse.reshape(-1)]
    return out


PASS_TABLE_MAX = 1 << 22
"""pass_at_k looks values up in a table indexed by the (n, c) key below this bound (4M floats at most)."""


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, the powers of two below n, and n itself."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + [n] if n > 1 else ks


# ------------------------------------------------------------------------------------------------ the interval
def t_quantile(level: float, df) -> np.ndarray | float:
    """t such that P(|T| <= t) = level for Student's t with ``df`` degrees of freedom (scipy)."""
    return sps.t.ppf(0.5 + level / 2, df)


def interval(values, level: float = LEVEL, axis: int = 0):
    """THE interval rule: mean and Student-t ``level`` interval of the mean over the finite entries.

    Args:
        values: (n,) per-seed values or same-seed paired differences; or (n, T) one row per seed (figure bands:
            one interval per column, over the seeds that have a value there).

    Returns:
        (mean, lo, hi, n): floats for 1-d input, (T,) arrays for 2-d. lo = hi = NaN where fewer than 2 values
        (no interval from one seed).
    """
    x = np.asarray(values, dtype=np.float64)
    x = np.moveaxis(x, axis, 0) if x.ndim > 1 else x
    ok = np.isfinite(x)
    n = ok.sum(0)
    x0 = np.where(ok, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = x0.sum(0) / n
        var = (np.where(ok, x - mean, 0.0) ** 2).sum(0) / (n - 1)
        half = t_quantile(level, np.maximum(n - 1, 1)) * np.sqrt(var / n)
    half = np.where(n >= 2, half, np.nan)
    lo, hi = mean - half, mean + half
    if x.ndim <= 1:
        return float(mean), float(lo), float(hi), int(n)
    return mean, lo, hi, n


def t_test(values, null: float = 0.0) -> float:
    """Two-sided p-value of the one-sample t-test of mean = ``null`` (finite entries); NaN below 2 values;
    0 or 1 for zero-variance samples (the mean is off the null, or on it)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return math.nan
    sd = float(x.std(ddof=1))
    if sd == 0:
        return 0.0 if x.mean() != null else 1.0
    t = (x.mean() - null) / (sd / math.sqrt(len(x)))
    return float(2 * sps.t.sf(abs(t), len(x) - 1))


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error over the given tests); NaN entries stay NaN and are
    not counted in the family."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = len(idx)
    order = idx[np.argsort(p[idx], kind="stable")]
    running = 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        out[j] = running
    return out


def power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided one-sample t-test at level ``alpha`` to detect a true mean ``effect`` when the
    differences have standard deviation ``sd`` over ``n`` seeds (noncentral t). NaN below 2 seeds or sd not > 0."""
    if n < 2 or not np.isfinite(sd) or sd <= 0 or not np.isfinite(effect):
        return math.nan
    df = n - 1
    crit = sps.t.ppf(1 - alpha / 2, df)
    nc = abs(effect) / (sd / math.sqrt(n))
    # P(T < -crit) written as P(T' > crit) with T' noncentral at -nc: scipy's nct.cdf is NaN in that far tail
    return float(sps.nct.sf(crit, df, nc) + sps.nct.sf(crit, df, -nc))


SD_CONFIDENCE = 0.8
"""Power is computed at the upper one-sided limit of the observed SD at this confidence (:func:`sd_upper`)."""


def sd_upper(sd: float, n: int, confidence: float = SD_CONFIDENCE) -> float:
    """The upper one-sided ``confidence`` limit of a normal SD observed as ``sd`` over ``n`` values (chi-square,
    n - 1 df): with 3-5 seeds the observed SD alone can be small by luck and would call a design powered that is
    not. NaN below 2 values."""
    if n < 2 or not np.isfinite(sd):
        return math.nan
    return float(sd * math.sqrt((n - 1) / sps.chi2.ppf(1 - confidence, n - 1)))


def paired_differences(a: dict, b: dict) -> tuple[np.ndarray, list]:
    """Differences a[key] - b[key] over the keys both have with finite values (keys: seeds, or seed tuples).

    Returns:
        (diffs (m,), sorted common keys).
    """
    keys = sorted(k for k in a.keys() & b.keys() if np.isfinite(a[k]) and np.isfinite(b[k]))
    return np.array([a[k] - b[k] for k in keys], dtype=np.float64), keys


# ------------------------------------------------------------------------------------------------ sample size
N_MAX = 100_000


def _check_design(sd: float, effect: float, alpha: float, contrasts: int) -> None:
    if not (isinstance(sd, (int, float)) and math.isfinite(sd) and sd > 0):
        raise ValueError(f"sd={sd!r} is not valid; allowed: a finite number > 0")
    if not (isinstance(effect, (int, float)) and math.isfinite(effect) and effect != 0):
        raise ValueError(f"effect={effect!r} is not valid; allowed: a finite number != 0")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} is not valid; allowed: 0 < alpha < 1")
    if isinstance(contrasts, bool) or not isinstance(contrasts, int) or contrasts < 1:
        raise ValueError(f"contrasts={contrasts!r} is not valid; allowed: an integer >= 1")


def power_paired(n: int, sd: float, effect: float, alpha: float = 0.05, contrasts: int = 1) -> float:
    """Power of the two-sided paired t-test over ``n`` pairs at level ``alpha / contrasts`` (noncentral t)."""
    _check_design(sd, effect, alpha, contrasts)
    if n < 2:
        raise ValueError(f"n={n!r} is not valid; allowed: an integer >= 2 (a paired t-test needs 2 pairs)")
    return power(effect, sd, n, alpha / contrasts)  # Bonferroni level: Holm's first step, a lower bound


def n_paired(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, contrasts: int = 1) -> int:
    """Smallest number of pairs whose paired t-test (level alpha / contrasts) has at least ``power``."""
    _check_design(sd, effect, alpha, contrasts)
    if not 0 < power < 1:
        raise ValueError(f"power={power!r} is not valid; allowed: 0 < power < 1")
    z = sps.norm.ppf(1 - alpha / contrasts / 2) + sps.norm.ppf(power)
    n = max(2, math.floor((z * sd / effect) ** 2))  # the normal approximation is a lower bound for the t-test
    while power_paired(n, sd, effect, alpha, contrasts) < power:
        n += 1
        if n > N_MAX:
            raise ValueError(f"more than {N_MAX} pairs needed for effect {effect} at sd {sd}")
    return n


def mde(n: int, sd: float, alpha: float = 0.05, power: float = 0.8, contrasts: int = 1) -> float:
    """Smallest |effect| the paired t-test over ``n`` pairs detects with ``power`` (the inverse of n_paired)."""
    _check_design(sd, 1.0, alpha, contrasts)
    hi = sd
    while power_paired(n, sd, hi, alpha, contrasts) < power:
        hi *= 2
    return float(optimize.brentq(lambda e: power_paired(n, sd, e, alpha, contrasts) - power, 1e-9 * sd, hi))
