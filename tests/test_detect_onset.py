"""The post-mortem's onset finder (lld_monitor.detect.onset) on synthetic series with known change points."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lld_monitor.detect.onset import ONSET_COLUMNS, SPIKE_COLUMNS, find_onset, onset_table, post_mortem_reference
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral

SEEDS = range(6)


def _noise(n: int, seed: int, sd: float = 0.02) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, sd, n)


@pytest.mark.parametrize("seed", SEEDS)
def test_slope_change_flat_then_decline(seed):
    t = np.arange(200)
    y = -0.5 - 0.01 * np.clip(t - 100, 0, None) + _noise(t.size, seed)
    o = find_onset(t, y)
    assert o.step is not None and abs(o.step - 100) <= 5, o
    assert o.direction == "down" and o.size_sigma > 10


@pytest.mark.parametrize("seed", SEEDS)
def test_level_shift_up(seed):
    t = np.arange(160)
    y = 1.0 + 0.2 * (t >= 80) + _noise(t.size, seed)
    o = find_onset(t, y)
    assert o.step is not None and abs(o.step - 80) <= 5, o
    assert o.direction == "up" and 7 < o.size_sigma < 13  # 0.2 / 0.02 = 10 sigma


@pytest.mark.parametrize("seed", SEEDS)
def test_rise_flat_decline_onset_is_the_decline(seed):
    t = np.arange(240)
    y = np.minimum(t, 40) * 0.01 - 0.008 * np.clip(t - 120, 0, None) + _noise(t.size, seed)
    o = find_onset(t, y)
    assert o.step is not None and abs(o.step - 120) <= 5, o
    assert o.direction == "down"


@pytest.mark.parametrize("seed", SEEDS)
def test_isolated_spikes_are_listed_apart_not_an_onset(seed):
    t = np.arange(150)
    y = 1.0 + _noise(t.size, seed)
    y[30] += 1.0
    y[90] -= 0.8
    o = find_onset(t, y)
    assert o.step is None and o.direction is None
    assert [sp.step for sp in o.spikes] == [30, 90]
    assert o.spikes[0].size_sigma > 5 and o.spikes[1].size_sigma < -5


def test_spikes_do_not_move_a_real_onset_and_gaps_are_steps():
    t = np.arange(0, 400, 2)  # every other step logged
    y = 0.3 + 0.004 * np.clip(t - 220, 0, None) + _noise(t.size, 7)
    y[20] += 0.5  # step 40
    o = find_onset(t, y)
    assert abs(o.step - 220) <= 5 and o.direction == "up"
    assert [sp.step for sp in o.spikes] == [40]


def test_reference_truncates_and_lead_is_positive():
    t = np.arange(200)
    y = 0.01 * np.clip(t - 150, 0, None) + _noise(t.size, 1)
    assert find_onset(t, y, reference_step=120).step is None
    assert abs(find_onset(t, y, reference_step=190).step - 150) <= 5


def test_trend_since_the_start_and_short_or_empty_series():
    t = np.arange(120)
    o = find_onset(t, 0.01 * t + _noise(t.size, 2))
    assert o.step is None and o.direction == "up" and "since the start" in o.note
    assert find_onset(t[:10], t[:10] * 1.0).step is None
    assert find_onset([], []).step is None
    nan = np.full(120, np.nan)
    assert find_onset(t, nan).step is None


def test_onset_table_on_a_spiral_orders_by_onset_and_reference_is_the_collapse():
    df = spiral(SpiralSpec(seed=3))
    ref, kind = post_mortem_reference(df)
    assert kind == "reward collapse" and 180 <= ref <= 210
    on, spikes = onset_table(df, ref)
    assert list(on.columns) == ONSET_COLUMNS and list(spikes.columns) == SPIKE_COLUMNS
    by = on.set_index("signal")
    # the displacement drops at 80 (phase II), entropy / grad norm surge after 150 (phase III)
    assert abs(by.loc["displacement", "onset_step"] - 80) <= 5 and by.loc["displacement", "direction"] == "down"
    assert by.loc["entropy", "direction"] == "up" and 150 <= by.loc["entropy", "onset_step"] <= 165
    assert by.loc["displacement", "lead_steps"] == ref - by.loc["displacement", "onset_step"]
    steps = on["onset_step"].dropna().tolist()
    assert steps == sorted(steps)


def test_reference_falls_back_to_the_20pct_decline_then_none():
    t = np.arange(120)
    dip = pd.DataFrame({"step": t, "reward_mean": np.where(t < 70, 0.6, 0.42)})
    ref, kind = post_mortem_reference(dip)
    assert kind == "reward 20 % decline" and 70 <= ref <= 80
    assert post_mortem_reference(healthy(steps=120)) == (None, "none")


def test_post_mortem_data_function_carries_onsets_on_the_sample_vanilla_run():
    from pathlib import Path

    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import queries

    r = open_store_reader(Path(__file__).resolve().parents[1] / "sample_runs")
    try:
        runs = r.runs()
        rid = runs[runs["mode"] == "vanilla"].run_id.iloc[0]
        collapse = reward_collapse_step(r.signals(rid))
        pm = queries.post_mortem(r, rid, k=1)
    finally:
        r.close()
    assert collapse is not None, "the sample vanilla run is the one that collapses"
    assert (pm.reference_step, pm.reference_kind) == (collapse, "reward collapse")
    assert list(pm.onsets.columns) == ONSET_COLUMNS and list(pm.spikes.columns) == SPIKE_COLUMNS
    found = pm.onsets.dropna(subset=["onset_step"])
    assert len(found) >= 3 and (found["lead_steps"] == collapse - found["onset_step"]).all()


def _partition_every_start(x, y, min_seg, pen):
    """The optimal partition by trying every start for every end (the definition; what _partition prunes)."""
    from lld_monitor.detect.onset import _segment_costs

    n = y.size
    cum = [np.r_[0.0, np.cumsum(v)] for v in (x, y, x * x, x * y, y * y)]
    best, prev = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=int)
    best[0] = -pen
    for j in range(min_seg, n + 1):
        starts = np.arange(0, j - min_seg + 1)
        starts = starts[np.isfinite(best[starts])]
        if starts.size:
            tot = best[starts] + _segment_costs(cum, j, starts) + pen
            k = int(np.argmin(tot))
            best[j], prev[j] = tot[k], starts[k]
    cuts, j = [], n
    while j > 0:
        cuts.append(int(prev[j]))
        j = prev[j]
    return sorted(cuts)


def test_pruned_partition_and_vectorized_refine_match_the_definitions():
    """Issue 30: the change-point search prunes starts (PELT) and scores every refinement at once; the segments
    are those of the exhaustive search, the refined points those of one least squares per candidate."""
    from lld_monitor.detect.onset import _partition, _refine

    rng = np.random.default_rng(7)
    for trial in range(60):
        n = int(rng.integers(40, 400))
        x = (np.sort(rng.choice(np.arange(2 * n), n, replace=False)).astype(float) if trial % 3
             else np.arange(n, dtype=float))  # steps with gaps, or every step
        y = np.cumsum(rng.normal(0, 1, n)) * rng.choice([0.01, 1.0, 100.0])
        for c in rng.integers(0, n, int(rng.integers(0, 4))):
            y[c:] += rng.normal(0, 5) + 0.05 * rng.normal() * (x[c:] - x[c])
        sigma = max(1.4826 * float(np.median(np.abs(np.diff(y)))), 1e-12)
        pen, ms = 3 * sigma * sigma * np.log(n), int(rng.choice([5, 10, 20]))
        cuts = _partition(x, y, ms, pen)
        assert cuts == _partition_every_start(x, y, ms, pen), trial
        refined = _refine(x, y, cuts, ms)
        for k in range(1, len(cuts)):  # each refined point is the best single break between its neighbours
            lo, hi = (refined[k - 1], cuts[k + 1] if k + 1 < len(cuts) else n)
            xs, ys = x[lo:hi], y[lo:hi]

            def sse(tau, xs=xs, ys=ys):
                best = np.inf
                for extra in (np.clip(xs - x[tau], 0, None), (xs >= x[tau]).astype(float)):
                    a = np.column_stack([np.ones_like(xs), xs - xs[0], extra])
                    coef, _, rank, _ = np.linalg.lstsq(a, ys, rcond=None)
                    if rank == 3:
                        best = min(best, float(np.sum((a @ coef - ys) ** 2)))
                return best
            taus = range(lo + ms // 2, hi - ms // 2)
            if len(taus):
                assert sse(refined[k]) <= min(sse(t) for t in taus) * (1 + 1e-9) + 1e-12, (trial, k)
