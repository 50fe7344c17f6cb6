"""Online detector behaviour: online == offline, missing signals, NaN gaps, non-finite values,
signal-name resolution (canonical / verl / TRL), bad input, contract names."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from lld_monitor.detect import (
    PHASES,
    PROXY_DECLINE_MESSAGE,
    SEVERITIES,
    Alert,
    DetectorConfig,
    OnlineDetector,
    detect_run,
    resolve_columns,
)
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl
from lld_monitor.store import schema


def online(df: pd.DataFrame, cfg=None, drop_nan=True):
    """Feed rows one at a time, as RunLogger's writer does (NaN/None keys dropped like the logger)."""
    det = OnlineDetector(cfg)
    per_step = []
    for rec in df.to_dict("records"):
        step = int(rec.pop("step"))
        sig = {k: v for k, v in rec.items() if not (drop_nan and (v is None or (isinstance(v, float) and math.isnan(v))))}
        per_step.extend(det.update(step, sig))
    return det, per_step


def severe(alerts):
    return [a for a in alerts if a.severity in ("warning", "critical")]


def test_contract_names_match_schema():
    assert set(PHASES) == set(schema.PHASES)
    assert SEVERITIES == schema.SEVERITIES
    assert [f.name for f in dataclasses.fields(Alert)] == [n for n in schema.ALERTS.names if n != "run_id"]


@pytest.mark.parametrize("make", [
    lambda: spiral(SpiralSpec(seed=4)),
    lambda: healthy(seed=4, noise=1.5),
    lambda: to_verl(spiral(SpiralSpec(seed=5))),
])
def test_online_equals_offline(make):
    df = make()
    rng = np.random.default_rng(0)
    gaps = df.copy()
    for c in gaps.columns.drop("step"):
        gaps.loc[rng.random(len(gaps)) < 0.1, c] = np.nan
    for frame in (df, gaps):
        det, per_step = online(frame)
        res = detect_run(frame)
        assert per_step == res.alerts == det.alerts
        assert (det.phase, det.phase_starts, det.collapse_step) == (res.phase, res.phase_starts, res.collapse_step)
        assert per_step  # something was said


def test_offline_unsorted_duplicate_and_extra_columns_are_handled():
    df = spiral(SpiralSpec(seed=2))
    res = detect_run(df)
    shuffled = df.sample(frac=1.0, random_state=1)
    dup = pd.concat([shuffled, df.iloc[[10]]])  # the same row again (duplicate step, same values)
    dup["lr"] = 1e-5
    dup["some/unknown_key"] = "text"
    res2 = detect_run(dup)
    assert res2.alerts == res.alerts


def test_steps_not_increasing_are_ignored_online():
    det = OnlineDetector()
    assert det.update(5, {"reward_mean": 0.3}) == []
    assert det.update(5, {"reward_mean": 0.0}) == []
    assert det.update(3, {"reward_mean": 0.0}) == []
    assert det.phase == "healthy" and det.phase_starts == {"healthy": 5}


def test_rows_with_nothing_known_are_not_updates():
    det = OnlineDetector()
    for s in range(100):
        det.update(s, {"lr": 1e-4, "reward_mean": float("nan")})
    assert det.phase_starts == {} and det.alerts == []


def test_missing_likelihood_signals_reward_only():
    # only reward: the detector cannot warn early but still sees the collapse and never crashes
    df = spiral(SpiralSpec(seed=1))[["step", "reward_mean"]]
    res = detect_run(df)
    assert res.collapse_step is not None
    assert res.phase == "collapse"
    assert set(res.signal_sources) == {"reward"}
    assert not [a for a in severe(res.alerts) if a.step < res.collapse_step]


def test_no_signal_columns_at_all():
    res = detect_run(pd.DataFrame({"step": np.arange(50), "lr": 1e-5}))
    assert res.phase == "healthy" and res.alerts == [] and res.collapse_step is None
    res = detect_run(pd.DataFrame({"step": pd.Series([], dtype="int64")}))
    assert res.phase == "healthy" and res.alerts == []


def test_nan_gaps_still_warn_early():
    spec = SpiralSpec(seed=3)
    df = spiral(spec)
    rng = np.random.default_rng(3)
    for c in df.columns.drop("step"):
        df.loc[rng.random(len(df)) < 0.3, c] = np.nan
    df.loc[(df.step >= 60) & (df.step < 80), df.columns.drop("step")] = np.nan  # a 20-step hole
    res = detect_run(df)
    w = severe(res.alerts)
    assert w and res.collapse_step is not None
    assert res.collapse_step - w[0].step >= 20


def test_non_finite_values_are_reported_not_used():
    df = healthy(seed=8)
    df["grad_norm"] = df["grad_norm"].astype(float)
    df.loc[df.step.isin([100, 101, 102, 103]), "grad_norm"] = np.inf
    df.loc[df.step == 150, "entropy"] = -np.inf
    res = detect_run(df)
    nf = [a for a in res.alerts if a.message.startswith("non-finite")]
    assert [(a.step, a.signal) for a in nf] == [(100, "grad_norm"), (150, "entropy")]
    assert all(a.severity == "info" for a in nf)
    assert not severe(res.alerts)


def test_verl_names_resolve_and_scalar_only_run_warns():
    df = to_verl(spiral(SpiralSpec(seed=6)))
    assert resolve_columns(df.columns) == {
        "reward": "critic/score/mean",
        "ll_correct": "actor/pos_avg_old_log_prob",
        "entropy": "actor/entropy_loss",
        "grad_norm": "actor/grad_norm",
        "clip_frac": "actor/pg_clipfrac",
    }
    res = detect_run(df, None, None)  # the phases (the forecast's own warning: tests/test_detect_forecast.py)
    # step scalars only: the likelihood proxy's decline is an honest info, never a warning ...
    proxy = [a for a in res.alerts if a.message.startswith(PROXY_DECLINE_MESSAGE)]
    assert proxy and proxy[0].severity == "info" and proxy[0].signal == "actor/pos_avg_old_log_prob"
    assert res.collapse_step - proxy[0].step >= 20
    assert "decay" not in res.phase_starts
    # ... the first warning is phase III from two surges at once, still before the collapse
    w = severe(res.alerts)
    assert w[0].phase == "acceleration" and w[0].severity == "critical" and "surge" in w[0].message
    assert w[0].step < res.collapse_step


def test_trl_names_resolve_surges_give_critical_before_collapse():
    src = spiral(SpiralSpec(seed=7))
    df = pd.DataFrame({
        "step": src.step,
        "reward": src.reward_mean,
        "entropy": src.entropy,
        "grad_norm": src.grad_norm,
        "clip_ratio/low_mean": src.clip_frac / 2,
        "clip_ratio/high_mean": src.clip_frac / 2,
        "kl": src.kl,
    })
    assert resolve_columns(df.columns)["clip_frac"] == "clip_ratio/low_mean + clip_ratio/high_mean"
    res = detect_run(df)
    crit = [a for a in res.alerts if a.severity == "critical"]
    assert crit and crit[0].step < res.collapse_step
    assert "surge" in crit[0].message


def test_canonical_column_preferred_over_alias_in_same_row():
    df = spiral(SpiralSpec(seed=1))
    df["critic/score/mean"] = 0.0  # an alias with nonsense values must not be read
    res = detect_run(df)
    assert res.signal_sources["reward"] == "reward_mean"
    assert res.collapse_step == detect_run(spiral(SpiralSpec(seed=1))).collapse_step


def test_higher_priority_source_upgrades_during_warmup():
    det = OnlineDetector()
    det.update(0, {"actor/pos_avg_old_log_prob": -3.0})
    det.update(1, {"ll_correct_mean": -0.5, "actor/pos_avg_old_log_prob": -3.0})
    assert det.signal_sources["ll_correct"] == "ll_correct_mean"


def test_config_validation_messages():
    with pytest.raises(ValueError, match="surge_min_count"):
        DetectorConfig(surge_min_count=9, surge_window=5)
    with pytest.raises(ValueError, match="collapse_frac"):
        DetectorConfig(collapse_frac=1.5)
    with pytest.raises(ValueError, match="unknown DetectorConfig field"):
        DetectorConfig.from_dict({"decay_zz": 1})
    assert DetectorConfig.from_dict(DetectorConfig().to_dict()) == DetectorConfig()


def test_detect_run_bad_input():
    with pytest.raises(ValueError, match="no 'step' column"):
        detect_run(pd.DataFrame({"reward_mean": [0.1]}))
    with pytest.raises(TypeError, match="DataFrame"):
        detect_run({"step": [1]})  # type: ignore[arg-type]


def test_detect_imports_no_torch():
    code = "import sys, lld_monitor.detect, lld_monitor.commands.detect; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_vals = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32),
                  st.floats(min_value=-5, max_value=5))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 400), _vals, _vals, _vals, _vals), min_size=0, max_size=120),
       st.integers(0, 2**16))
def test_online_equals_offline_on_arbitrary_rows(rows, seed):
    # arbitrary steps (unsorted, repeated), None/NaN/inf values, mixed column names
    base = spiral(SpiralSpec(steps=120, seed=seed % 7))
    recs = []
    for i, (step, a, b, c, d) in enumerate(rows):
        recs.append({"step": step, "reward_mean": a, "ll_correct_mean": b,
                     "actor/grad_norm": c, "entropy": d if i % 3 else base.entropy.iloc[i % 120]})
    df = pd.DataFrame(recs, columns=["step", "reward_mean", "ll_correct_mean", "actor/grad_norm", "entropy"])
    df = pd.concat([base, df], ignore_index=True)
    res = detect_run(df)
    # the online order detect_run uses: sorted by step, last duplicate wins
    prep = df.sort_values("step", kind="stable").drop_duplicates("step", keep="last")
    det = OnlineDetector()
    for rec in prep.to_dict("records"):
        det.update(int(rec.pop("step")), rec)
    assert det.alerts == res.alerts
    assert (det.phase, det.phase_starts, det.collapse_step) == (res.phase, res.phase_starts, res.collapse_step)


def test_proxy_decline_info_is_raised_once_per_episode():
    res = detect_run(to_verl(spiral(SpiralSpec(seed=6))))
    proxy = [a for a in res.alerts if a.message.startswith(PROXY_DECLINE_MESSAGE)]
    assert len(proxy) == 1
    # and a 'suspected' info (likelihood declining, displacement not net negative) is not repeated either
    df = spiral(SpiralSpec(steps=220, seed=2, accel_start=None, collapse_start=None))
    df["delta_preserved_mean"] = np.abs(df["delta_preserved_mean"]) + 0.01
    sus = [a for a in detect_run(df).alerts if a.message.startswith("suspected phase II")]
    assert 1 <= len(sus) <= 2
