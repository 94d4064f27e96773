"""Statistics the tables, figures and claims share: unbiased pass@k, seeded bootstrap CIs, paired differences.

Every random draw comes from an explicit ``torch.Generator`` seeded by the caller (default 0), so the same inputs
always give the same intervals. The bootstrap is the plain percentile bootstrap over seeds (runs), the unit of
replication of an RL experiment; with 3-5 seeds it is optimistic (too narrow), which the claims rule offsets by
requiring a minimum number of pairs (analysis/claims.yaml ``min_pairs``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

N_BOOT = 10_000
"""Resamples for a scalar CI."""
LEVEL = 0.95


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, the Codex paper).

    Args:
        n: (P,) samples drawn per problem; c: (P,) correct samples among them; k: samples per attempt.

    Returns:
        (P,) float; NaN where n < k. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) through a table of cumulative
        log terms, so it is vectorised and exact to float rounding for any n.
    """
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    if k < 1:
        raise ValueError(f"k={k!r} is not valid; allowed: an integer >= 1")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("pass_at_k needs 0 <= c <= n for every problem")
    out = np.full(n.shape, np.nan)
    ok = n >= k
    if not ok.any():
        return out
    top = int(n[ok].max())
    i = np.arange(k + 1, top + 1, dtype=np.float64)
    # table[m] = sum_{i=k+1}^{m} log(1 - k / i) for m >= k (0 for m <= k)
    table = np.zeros(top + 1)
    table[k + 1 :] = np.cumsum(np.log1p(-k / i))
    fail = n - c  # incorrect samples
    all_fail = np.exp(table[n[ok]] - table[np.maximum(fail[ok], k)])  # P(all k drawn samples are incorrect)
    out[ok] = np.where(fail[ok] < k, 1.0, 1.0 - all_fail)
    return out


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, the powers of two below n, and n itself."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + [n] if n > 1 else ks


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


@functools.lru_cache(maxsize=64)
def resample_weights(n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """(n_boot, n) weights of a bootstrap over n units: row b = counts of each unit in resample b, divided by n.

    Cached (read-only): every statistic over n seeds with the same seed reuses the same resamples.
    """
    idx = torch.randint(0, n, (n_boot, n), generator=_generator(seed))
    counts = torch.zeros(n_boot, n, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(n_boot, n, dtype=torch.float64)
    )
    w = (counts / n).numpy()
    w.flags.writeable = False
    return w


def _finite(values) -> tuple[np.ndarray, int, float]:
    """The finite values, their count and mean (NaN when none)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = len(x)
    return x, n, (float(x.mean()) if n else float("nan"))


def bootstrap_ci(
    values, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float, int]:
    """Mean and percentile-bootstrap CI of the mean over the finite entries of ``values``.

    Args:
        values: (n,) numbers (NaN entries are dropped).

    Returns:
        (mean, lo, hi, n); lo = hi = NaN when fewer than 2 values (no interval from one seed).
    """
    x, n, mean = _finite(values)
    if n < 2:  # no interval from fewer than 2 values
        return mean, float("nan"), float("nan"), n
    means = resample_weights(n, n_boot, seed) @ x
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return mean, float(lo), float(hi), n


def bootstrap_band(curves, *, n_boot: int = 400, level: float = LEVEL, seed: int = 0):
    """Mean curve and pointwise percentile-bootstrap band over seeds.

    Args:
        curves: (S, T) one curve per seed on a shared grid; NaN where a run has no value (e.g. it is shorter).

    Returns:
        (mean, lo, hi), each (T,). The same resamples serve every column; with S < 2, lo = hi = mean.
    """
    X = np.asarray(curves, dtype=np.float64)
    present = np.isfinite(X)
    X0 = np.where(present, X, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = X0.sum(0) / present.sum(0)
        S = X.shape[0]
        if S < 2:
            return mean, mean.copy(), mean.copy()
        W = resample_weights(S, n_boot, seed)
        boot = (W @ X0) / (W @ present)  # (n_boot, T): each resample's mean over the seeds present at t
    alpha = (1 - level) / 2
    lo, hi = np.full_like(mean, np.nan), np.full_like(mean, np.nan)
    full = np.isfinite(boot).all(0)  # columns every resample covers (plain quantile: fast)
    lo[full], hi[full] = np.quantile(boot[:, full], [alpha, 1 - alpha], axis=0)
    part = ~full & np.isfinite(boot).any(0)  # columns where some resamples drew only absent seeds
    if part.any():
        lo[part], hi[part] = np.nanquantile(boot[:, part], [alpha, 1 - alpha], axis=0)
    return mean, lo, hi


def _t_abs_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3 / 26.7.4, exact)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        term, total = math.cos(theta), 0.0
        for j in range(1, (df - 1) // 2 + 1):  # cos + (2/3) cos^3 + (2*4)/(3*5) cos^5 + ...
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        return (2 / math.pi) * (theta + s * total) if df > 1 else 2 * theta / math.pi
    term, total = 1.0, 0.0
    for j in range(1, df // 2 + 1):  # 1 + (1/2) cos^2 + (1*3)/(2*4) cos^4 + ...
        total += term
        term *= c2 * (2 * j - 1) / (2 * j)
    return s * total


def t_quantile(level: float, df: int) -> float:
    """t such that P(|T| <= t) = level, T ~ Student(df); bisection on the exact CDF."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_abs_cdf(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def t_interval(values, level: float = LEVEL) -> tuple[float, float, float, int]:
    """Mean and Student-t CI of the mean (finite entries); lo = hi = NaN below 2 values.

    At 3-5 seeds this is the honest interval: a percentile bootstrap never leaves the range of the data, so with
    3 seeds it excludes 0 whenever all three values share a sign (1 chance in 4 when there is no effect).
    """
    x, n, mean = _finite(values)
    if n < 2:  # no interval from fewer than 2 values
        return mean, float("nan"), float("nan"), n
    half = t_quantile(level, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half, n


def paired_differences(a: dict, b: dict) -> tuple[np.ndarray, list]:
    """Differences a[key] - b[key] over the keys both have with finite values (keys: seeds, or seed tuples).

    Returns:
        (diffs (m,), sorted common keys).
    """
    keys = sorted(k for k in a.keys() & b.keys() if np.isfinite(a[k]) and np.isfinite(b[k]))
    return np.array([a[k] - b[k] for k in keys], dtype=np.float64), keys
