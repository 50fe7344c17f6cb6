"""Drawing long series at the chart's resolution: per pixel column, the first, lowest, highest and last point (M4).

A line drawn from those points covers exactly the pixels the full series would (Jugel et al., "M4: a
visualization-oriented time series data aggregation", VLDB 2014): a one-step spike or the collapse stays
where it is, while a 200,000-step run is sent to the browser as a few thousand points per line. Series
shorter than the budget are drawn as they are. Pure numpy (the series are already in memory for the detector).
"""

from __future__ import annotations

import numpy as np

MAX_POINTS = 4000
"""Points per line at most: 4 per pixel column of a ~1,000-pixel-wide panel. Shorter series are not touched."""


def m4_indices(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Sorted indices of the points to draw (all of them when there are at most `max_points`).

    The points are cut into `max_points // 4` runs of consecutive points (pixel columns when the steps are evenly
    spaced); in each, the first, lowest, highest and last finite point are kept. A gap of missing values (NaN)
    at least a run long keeps one NaN, so the line still breaks there; shorter gaps are below a pixel and are
    bridged. `x` is only used for its length (points are in step order)."""
    y = np.asarray(y, dtype="float64")
    n = len(y)
    if n <= max_points or len(x) != n:
        return np.arange(n)
    buckets = max(1, max_points // 4)
    k = -(-n // buckets)  # points per run
    rows = -(-n // k)
    finite = np.isfinite(y)
    pad = rows * k - n
    f2 = np.r_[finite, np.zeros(pad, dtype=bool)].reshape(rows, k)
    lo2 = np.r_[np.where(finite, y, np.inf), np.full(pad, np.inf)].reshape(rows, k)
    hi2 = np.r_[np.where(finite, y, -np.inf), np.full(pad, -np.inf)].reshape(rows, k)
    base = np.arange(rows) * k
    has = f2.any(axis=1)
    first = base + f2.argmax(axis=1)
    last = base + (k - 1 - f2[:, ::-1].argmax(axis=1))
    low = base + lo2.argmin(axis=1)
    high = base + hi2.argmax(axis=1)
    keep = [first[has], last[has], low[has], high[has], _wide_gaps(finite, k)]
    return np.unique(np.concatenate(keep))


def _wide_gaps(finite: np.ndarray, width: int) -> np.ndarray:
    """The first index of every run of non-finite values at least `width` long."""
    bad = ~finite
    if not bad.any():
        return np.arange(0)
    edges = np.diff(np.r_[0, bad.astype("int8"), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts[(ends - starts) >= width]


def window(steps: np.ndarray, step_range: tuple[float, float] | None) -> np.ndarray:
    """Boolean mask of the steps inside `step_range` (inclusive); everything when None."""
    if step_range is None:
        return np.ones(len(steps), dtype=bool)
    lo, hi = step_range
    return (steps >= lo) & (steps <= hi)
