"""Robust statistics used by the detector (numpy only): Theil-Sen trend with a robust z-score,
median/MAD baselines, trailing medians."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD x this = sigma for Gaussian noise


@lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    i, j = np.triu_indices(n, 1)
    return i, j


def fast_median(x) -> float:
    """Median of a short sequence (pure Python sort: much cheaper than np.median below ~200 values;
    the same value as np.median)."""
    v = sorted(x.tolist() if isinstance(x, np.ndarray) else x)
    n = len(v)
    if n == 0:
        raise ValueError("median of an empty sequence")
    m = n // 2
    return float(v[m]) if n % 2 else float((v[m - 1] + v[m]) / 2.0)


def robust_sigma(x, floor: float = 0.0) -> float:
    """1.4826 x MAD of x, at least `floor`."""
    vals = x.tolist() if isinstance(x, np.ndarray) else list(x)
    if not vals:
        return float(floor)
    med = fast_median(vals)
    return float(max(MAD_TO_SIGMA * fast_median([abs(v - med) for v in vals]), floor))


@dataclass(frozen=True)
class Trend:
    slope: float  # units of y per step
    intercept: float
    sigma: float  # robust sigma of the residuals
    z: float  # slope / its standard error (OLS formula with residual sigma, AR(1)-corrected)
    n: int
    rho: float = 0.0  # lag-1 autocorrelation of the residuals used in the correction


def theil_sen(x: np.ndarray, y: np.ndarray, sigma_floor: float = 0.0, autocorr: bool = True) -> Trend:
    """Theil-Sen line through (x, y) (median of pairwise slopes; robust to ~29% outliers) and a
    z-score for its slope: slope * sqrt(sum((x - mean x)^2)) / sigma_resid, where sigma_resid is the
    robust sigma of the residuals (floored at `sigma_floor`). With `autocorr`, z is shrunk by
    sqrt((1 - rho) / (1 + rho)), rho = lag-1 autocorrelation of the residuals (the effective-sample-size
    correction for AR(1) noise: without it, slowly wandering curves look like significant trends)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = int(x.size)
    if n < 3:
        raise ValueError("theil_sen needs at least 3 points")
    i, j = _pairs(n)
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        raise ValueError("theil_sen needs at least two distinct x values")
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    intercept = fast_median(y - slope * x)
    resid = y - (slope * x + intercept)
    sigma = robust_sigma(resid, floor=sigma_floor)
    sxx = float(np.sum((x - x.mean()) ** 2))
    if sigma > 0:
        z = slope * np.sqrt(sxx) / sigma
    else:
        z = 0.0 if slope == 0 else float(np.copysign(1e9, slope))
    rho = 0.0
    if autocorr and n >= 8:
        rho = lag1_autocorr(resid)
        z *= np.sqrt((1.0 - rho) / (1.0 + rho))
    return Trend(slope=slope, intercept=intercept, sigma=sigma, z=float(z), n=n, rho=rho)


def lag1_autocorr(r: np.ndarray, max_rho: float = 0.9) -> float:
    """Lag-1 autocorrelation of residuals, bias-corrected and clipped to [0, max_rho] (training curves
    are positively autocorrelated; a negative estimate on a short window is treated as none)."""
    r = np.asarray(r, dtype=float) - float(np.mean(r))
    den = float(np.dot(r, r))
    if den <= 0:
        return 0.0
    rho = float(np.dot(r[:-1], r[1:]) / den)
    rho += (1.0 + 3.0 * rho) / r.size  # Kendall's small-sample bias correction (the raw estimate is low)
    return float(min(max(rho, 0.0), max_rho))


def trailing_median(y, window: int) -> float:
    """Median of the last `window` values of y."""
    return fast_median(list(y)[-window:])
