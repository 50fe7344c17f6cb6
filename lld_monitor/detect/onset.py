"""Post-mortem by onset: for each signal, the step at which its *sustained* change began (not its first
alert), its direction and size in robust sigma, and its lead on the reference (the reward collapse, else
the reward's 20 % decline). Isolated spikes are listed apart and never make an onset. Numpy/pandas only.

THE RULE (per signal, on its finite points in step order):
 1. Noise scale: sigma = 1.4826 x MAD of the residuals from a centred rolling median of `spike_window`
    points (floored at `sigma_floor_rel` x the median |value|).
 2. Isolated spikes: a run of at most `spike_max_len` consecutive points more than `spike_sigma` sigma
    from that rolling median, with no other such point on the same side within `spike_isolation` points.
    Listed apart (step, value, size in sigma) and replaced by the rolling median. Longer runs, and
    excursions that recur (a heavier tail on one side, as the displacement shows in a spiral), are not
    isolated: they stay in the series and the smoothing below weighs them.
 3. Smoothing: centred rolling median of `smooth_window` points of the spike-free series.
 4. Change points: optimal partition of the smoothed series into straight-line segments of at least
    `min_segment` points, minimising the sum of squared residuals + `penalty` x sigma^2 x ln(n) per
    segment (exact dynamic programming over all partitions: PELT's objective without its pruning).
    Each change point is then placed exactly: between its neighbours' change points, the step that best
    fits either a continuous broken line (a slope change) or a level shift with one common slope
    (two free lines let the earlier one tilt into the start of the change and place it late).
 0. With a reference step, only the points at or before it are used: the question is what had moved
    by then (a signal that moves only after the reference has no onset).
 5. The sustained change: each segment's move = the end of its fitted line minus the end of the previous
    segment's (jump + drift). From the last segment, walk back to the first segment whose move is at
    least `min_move_sigma` sigma: its sign is the direction. Keep walking back
    while the segments move at least `min_move_sigma` sigma in that direction; the onset is the first step
    of the earliest such segment. If that is the first segment of the series (the signal has moved that
    way since the start), the onset is the first change point: where the move changed pace (e.g. a slow
    creep that turns into a surge); with no change point at all there is no onset. The size is the
    summed move in sigma and must reach `min_size_sigma`.
 6. Lead = reference step - onset step (positive: the signal moved before the reference).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .config import DetectorConfig
from .offline import _prepare, reward_collapse_step, reward_decline_step
from .signal_sources import SIGNAL_CANDIDATES, SIGNALS, resolve_columns
from .stats import MAD_TO_SIGMA

log = logging.getLogger(__name__)

ONSET_COLUMNS = ["signal", "column", "onset_step", "direction", "size_sigma", "lead_steps", "note"]
SPIKE_COLUMNS = ["signal", "column", "step", "value", "size_sigma"]


@dataclass(frozen=True)
class OnsetConfig:
    spike_window: int = 9
    """Centred rolling-median window (points) that spikes and the noise scale are measured against."""
    spike_sigma: float = 5.0
    """A point this many sigma from the rolling median is a spike candidate."""
    spike_max_len: int = 2
    """At most this many consecutive candidates form an isolated spike; longer runs are a change."""
    spike_isolation: int = 10
    """... and no other candidate on the same side within this many points (else the excursions recur)."""
    smooth_window: int = 5
    """Centred rolling-median window (points) of the smoothed series the change points are found on."""
    min_segment: int = 10
    """Shortest segment (points) between two change points."""
    penalty: float = 3.0
    """Cost of one more segment, in sigma^2 x ln(n) (BIC-like; larger = fewer change points)."""
    min_move_sigma: float = 1.5
    """A segment takes part in the sustained change when it moves at least this many sigma that way."""
    min_size_sigma: float = 3.0
    """A sustained change smaller than this many sigma in total is not reported."""
    sigma_floor_rel: float = 1e-3
    """The noise sigma is at least this fraction of the series' median |value| (a flat series has MAD 0)."""
    max_points: int = 20_000
    """A longer series (a 200,000-step run) is partitioned on every k-th point of its smoothed series, k =
    ceil(n / max_points), and the change points are then placed on every point (the exact search is quadratic
    where nothing changes: ~12 s at 16,600 points, it would take many minutes at 150,000)."""


@dataclass(frozen=True)
class Spike:
    step: int
    value: float
    size_sigma: float


@dataclass(frozen=True)
class Onset:
    step: int | None  # None: no sustained change (or a trend since the start)
    direction: str | None  # "up" | "down"
    size_sigma: float | None
    sigma: float
    change_points: tuple[int, ...]  # steps where a segment starts (all of them, not only the onset)
    spikes: tuple[Spike, ...]
    note: str


def _rolling_median(y: np.ndarray, window: int) -> np.ndarray:
    return pd.Series(y).rolling(int(window), center=True, min_periods=1).median().to_numpy()


def _segment_costs(cum: list[np.ndarray], j: int, starts: np.ndarray) -> np.ndarray:
    """SSE of the least-squares line through points [i, j) for every i in `starts`, from the prefix sums
    `cum` of (x, y, x*x, x*y, y*y)."""
    sx, sy, sxx, sxy, syy = (cs[j] - cs[starts] for cs in cum)
    n = (j - starts).astype(float)
    vx = sxx - sx * sx / n
    vy = syy - sy * sy / n
    cxy = sxy - sx * sy / n
    with np.errstate(divide="ignore", invalid="ignore"):
        sse = vy - np.where(vx > 0, cxy * cxy / vx, 0.0)
    return np.maximum(sse, 0.0)


def _partition(x: np.ndarray, y: np.ndarray, min_seg: int, pen: float) -> list[int]:
    """Start indices of the optimal segments (always begins with 0).

    Exact optimal partitioning with PELT's pruning (Killick et al. 2012): a line fit's SSE never grows when a
    segment is split, so a start whose cost to `j` already exceeds the optimum at `j` can never start the last
    segment of a later optimum (with the minimum segment length, from `j + min_seg` on) and is dropped. Same
    segments as trying every start (what this did before), O(n) instead of O(n^2) on series with change
    points. It cannot prune inside a long stretch without a change (every split there lowers the SSE), so a
    16,000-point series with an 11,500-point flat start still takes about a second."""
    n = y.size
    cum = [np.r_[0.0, np.cumsum(v)] for v in (x, y, x * x, x * y, y * y)]
    best = np.full(n + 1, np.inf)
    best[0] = -pen
    prev = np.zeros(n + 1, dtype=int)
    dropped_at = np.full(n + 1, np.iinfo(np.int64).max)  # j at which a start was found dominated
    # slack for rounding in the prefix-sum costs: a start is dropped only when clearly worse
    slack = 1e-9 * (1.0 + float(np.sum((y - y.mean()) ** 2)) + abs(pen))
    cands = np.zeros(0, dtype=int)
    for j in range(min_seg, n + 1):
        cands = np.r_[cands, j - min_seg]
        cands = cands[np.isfinite(best[cands]) & (dropped_at[cands] > j - min_seg)]
        if cands.size == 0:
            continue
        cost = best[cands] + _segment_costs(cum, j, cands)
        k = int(np.argmin(cost))  # candidates stay in increasing order: ties resolve as before
        best[j], prev[j] = cost[k] + pen, cands[k]
        worse = cands[cost > best[j] + slack]
        dropped_at[worse] = np.minimum(dropped_at[worse], j)
    if not np.isfinite(best[n]):
        return [0]
    cuts, j = [], n
    while j > 0:
        cuts.append(int(prev[j]))
        j = prev[j]
    return sorted(cuts)


def find_onset(steps, values, reference_step: int | None = None, cfg: OnsetConfig | None = None) -> Onset:
    """The onset of the sustained change of one series (the rule in the module docstring)."""
    c = cfg or OnsetConfig()
    s = np.asarray(steps, dtype=float)
    v = np.asarray(values, dtype=float)
    ok = np.isfinite(s) & np.isfinite(v)
    if reference_step is not None:
        ok &= s <= reference_step
    s, v = s[ok], v[ok]
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    if v.size < 2 * c.min_segment:
        return Onset(None, None, None, math.nan, (), (), f"only {v.size} finite points")
    med = _rolling_median(v, c.spike_window)
    resid = v - med
    floor = c.sigma_floor_rel * float(np.median(np.abs(v)))
    sigma = max(MAD_TO_SIGMA * float(np.median(np.abs(resid - np.median(resid)))), floor, 1e-12)
    spikes, clean = _isolated_spikes(s, v, med, resid, sigma, c)
    z = _rolling_median(clean, c.smooth_window)
    x = s - s[0]
    pen = c.penalty * sigma * sigma * math.log(v.size)
    k = -(-v.size // int(c.max_points))
    if k > 1:  # coarse search, fine placement (OnsetConfig.max_points)
        coarse = np.arange(0, v.size, k)
        pen_k = c.penalty * sigma * sigma * math.log(coarse.size)
        cuts = [int(coarse[i]) for i in _partition(x[coarse], z[coarse], int(c.min_segment), pen_k)]
    else:
        cuts = _partition(x, z, int(c.min_segment), pen)
    starts = _refine(x, z, cuts, int(c.min_segment))
    bounds = starts + [v.size]
    ends: list[float] = []  # fitted value at each segment's last point
    begins: list[float] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        xs, ys = x[a:b], z[a:b]
        slope, icpt = np.polyfit(xs, ys, 1) if np.ptp(xs) > 0 else (0.0, float(np.mean(ys)))
        begins.append(float(slope * xs[0] + icpt))
        ends.append(float(slope * xs[-1] + icpt))
    moves = [ends[0] - begins[0]] + [ends[m] - ends[m - 1] for m in range(1, len(ends))]
    cps = tuple(int(s[a]) for a in starts[1:])

    def walk(anchor: int):
        m = anchor
        while m >= 0 and abs(moves[m]) < c.min_move_sigma * sigma:
            m -= 1
        if m < 0:
            return None
        d = 1.0 if moves[m] > 0 else -1.0
        first, total = m, 0.0
        while m >= 0 and moves[m] * d >= c.min_move_sigma * sigma:
            total += moves[m]
            first = m
            m -= 1
        return first, d, total

    before = "" if reference_step is None else " before the reference"
    w = walk(len(starts) - 1)
    if w is None:
        return Onset(None, None, None, sigma, cps, tuple(spikes), f"no sustained change{before}")
    first, d, total = w
    direction = "up" if d > 0 else "down"
    if abs(total) < c.min_size_sigma * sigma:
        return Onset(None, None, None, sigma, cps, tuple(spikes),
                     f"last sustained change{before} {abs(total) / sigma:.1f} sigma (< {c.min_size_sigma:g})")
    if first == 0 and len(starts) == 1:
        return Onset(None, direction, float(abs(total) / sigma), sigma, cps, tuple(spikes),
                     f"trending {direction} since the start (no change point)")
    if first == 0:
        return Onset(int(s[starts[1]]), direction, float(abs(total) / sigma), sigma, cps, tuple(spikes),
                     f"{direction} since the start, changed pace here")
    return Onset(int(s[starts[first]]), direction, float(abs(total) / sigma), sigma, cps, tuple(spikes),
                 f"sustained {direction} move")


def _refine(x: np.ndarray, y: np.ndarray, starts: list[int], min_seg: int) -> list[int]:
    """Each change point moved to the index that best fits a continuous broken line or a level shift with a
    common slope, searched between its neighbours (keeping `min_seg // 2` points on each side).

    For every candidate at once: the SSE of the 3-column least squares [1, x, extra] is the SSE of the line
    [1, x] minus (e'r)^2 / |e - Pe|^2, where r is the line's residual and Pe the projection of the extra column
    on the line's span (suffix sums over the window). Same minimum as one `lstsq` per candidate and shape."""
    out = list(starts)
    bounds = out + [y.size]
    for k in range(1, len(out)):
        lo, hi = bounds[k - 1], bounds[k + 1]
        taus = np.arange(lo + min_seg // 2, hi - min_seg // 2)
        if taus.size:
            arg = _best_break(x[lo:hi], y[lo:hi], taus - lo)
            if arg is not None:
                out[k] = int(lo + arg)
        bounds[k] = out[k]
    return out


def _best_break(xs: np.ndarray, ys: np.ndarray, taus: np.ndarray) -> int | None:
    """The index in `taus` (positions in xs) whose broken line or level shift fits (xs, ys) best; None when no
    candidate gives a full-rank fit."""
    m = xs.size
    t = xs - xs[0]
    q1 = np.full(m, 1.0 / np.sqrt(m))
    t_c = t - t.mean()
    norm = float(np.sqrt(np.dot(t_c, t_c)))
    if norm == 0:
        return None
    q2 = t_c / norm
    r = ys - q1 * np.dot(q1, ys) - q2 * np.dot(q2, ys)  # residual of the line [1, x]

    def suffix(v: np.ndarray) -> np.ndarray:
        return np.cumsum(v[::-1])[::-1]

    xt = xs[taus]
    sums = {name: suffix(v)[taus] for name, v in (("1", np.ones(m)), ("x", xs), ("xx", xs * xs), ("r", r),
                                                   ("xr", xs * r), ("q2", q2), ("xq2", xs * q2))}
    best_sse, best_i = np.inf, None
    for shape in ("hinge", "step"):
        if shape == "hinge":  # e = max(0, x - x_tau)
            ee = sums["xx"] - 2 * xt * sums["x"] + xt * xt * sums["1"]
            er = sums["xr"] - xt * sums["r"]
            e1 = (sums["x"] - xt * sums["1"]) * q1[0]
            e2 = sums["xq2"] - xt * sums["q2"]
        else:  # e = [x >= x_tau]
            ee = sums["1"]
            er = sums["r"]
            e1 = sums["1"] * q1[0]
            e2 = sums["q2"]
        resid_norm = ee - e1 * e1 - e2 * e2
        ok = resid_norm > 1e-12 * np.maximum(ee, 1e-300)  # the extra column is not in the line's span
        with np.errstate(divide="ignore", invalid="ignore"):
            gain = np.where(ok, er * er / resid_norm, -np.inf)
        if ok.any():
            i = int(np.argmax(gain))  # the smallest SSE = the largest reduction; first on ties, as before
            sse = float(np.dot(r, r) - gain[i])
            if sse < best_sse:
                best_sse, best_i = sse, i
    return None if best_i is None else int(taus[best_i])


def _isolated_spikes(s: np.ndarray, v: np.ndarray, med: np.ndarray, resid: np.ndarray, sigma: float,
                     c: OnsetConfig) -> tuple[list[Spike], np.ndarray]:
    """(isolated spikes, the series with them replaced by the rolling median): rule 2 of the docstring."""
    side = np.where(resid > c.spike_sigma * sigma, 1, np.where(resid < -c.spike_sigma * sigma, -1, 0))
    spikes: list[Spike] = []
    clean = v.copy()
    i, n = 0, v.size
    while i < n:
        if side[i] == 0:
            i += 1
            continue
        j = i
        while j < n and side[j] == side[i]:
            j += 1
        lo, hi = max(0, i - c.spike_isolation), min(n, j + c.spike_isolation)
        alone = not np.any(side[lo:i] == side[i]) and not np.any(side[j:hi] == side[i])
        if j - i <= c.spike_max_len and alone:
            for k in range(i, j):
                spikes.append(Spike(int(s[k]), float(v[k]), float(resid[k] / sigma)))
                clean[k] = med[k]
        i = j
    return spikes, clean


def post_mortem_reference(signals_df: pd.DataFrame, cfg: DetectorConfig | None = None,
                          collapse_step: int | None = None) -> tuple[int | None, str]:
    """(step, kind) a post-mortem measures leads against: the reward collapse (the written definition),
    else the reward's 20 % decline, else (None, "none"). `collapse_step`: the collapse the caller's detector
    (same config, same rows) already found, which is `reward_collapse_step`'s answer; None computes it."""
    cs = collapse_step if collapse_step is not None else reward_collapse_step(signals_df, cfg)
    if cs is not None:
        return cs, "reward collapse"
    ds = reward_decline_step(signals_df, cfg)
    if ds is not None:
        return ds, "reward 20 % decline"
    return None, "none"


def onset_table(signals_df: pd.DataFrame, reference_step: int | None,
                cfg: OnsetConfig | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(onsets, spikes) for every detector signal the run has (the column the detector would read).

    onsets: ONSET_COLUMNS, one row per signal, sorted by onset step (signals without an onset last);
    lead_steps = reference_step - onset_step. spikes: SPIKE_COLUMNS, the isolated spikes, by step."""
    df = _prepare(signals_df)
    cols = resolve_columns(c for c in df.columns if pd.to_numeric(df[c], errors="coerce").notna().any())
    rows, spike_rows = [], []
    records = df.to_dict("records")
    for sig in SIGNALS:
        label = cols.get(sig)
        if label is None:
            continue
        cand = next(cd for cd in SIGNAL_CANDIDATES[sig] if cd.label == label)
        vals = np.array([cand.get(r) for r in records], dtype=float)
        o = find_onset(df["step"].to_numpy(dtype=float), vals, reference_step, cfg)
        lead = None if (o.step is None or reference_step is None) else int(reference_step - o.step)
        rows.append({"signal": sig, "column": label, "onset_step": o.step, "direction": o.direction,
                     "size_sigma": None if o.size_sigma is None else round(o.size_sigma, 1),
                     "lead_steps": lead, "note": o.note})
        spike_rows += [{"signal": sig, "column": label, "step": sp.step, "value": sp.value,
                        "size_sigma": round(sp.size_sigma, 1)} for sp in o.spikes]
    onsets = pd.DataFrame(rows, columns=ONSET_COLUMNS)
    if len(onsets):
        onsets = onsets.assign(_k=onsets["onset_step"].fillna(np.inf)).sort_values(
            ["_k", "signal"], kind="stable").drop(columns="_k").reset_index(drop=True)
        onsets["onset_step"] = onsets["onset_step"].astype("Int64")
        onsets["lead_steps"] = onsets["lead_steps"].astype("Int64")
    spikes = pd.DataFrame(spike_rows, columns=SPIKE_COLUMNS).sort_values(["step", "signal"], kind="stable")
    return onsets, spikes.reset_index(drop=True)
