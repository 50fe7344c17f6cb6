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
