"""Detector phase transitions on synthetic trajectories with known boundaries
(lld_monitor.detect.synthetic follows the paper's order of events)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pytest

from lld_monitor.detect import DetectorConfig, reward_collapse_step
from lld_monitor.detect import detect_run as _detect_run
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl

# the phases and their alerts; the forecast and its own alert are tests/test_detect_forecast.py's
detect_run = partial(_detect_run, forecast=None)

SEVERE = ("warning", "critical")


def first(alerts, severities=SEVERE):
    steps = [a.step for a in alerts if a.severity in severities]
    return steps[0] if steps else None


def test_rise_then_plateau_is_stagnation_info_only():
    # likelihood rises until 30 then flat; no decay, no collapse
    df = spiral(SpiralSpec(steps=200, decay_start=None, accel_start=None, collapse_start=None, seed=3))
    df["delta_preserved_mean"] = np.random.default_rng(3).normal(0.02, 0.03, len(df))
    res = detect_run(df)
    assert res.phase == "stagnation"
    assert 30 <= res.phase_starts["stagnation"] <= 90
    assert first(res.alerts) is None
    assert res.collapse_step is None
    stag = [a for a in res.alerts if a.phase == "stagnation" and a.signal == "ll_correct_mean"]
    assert stag and stag[0].severity == "info" and stag[0].threshold == DetectorConfig().rise_z


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stagnation_to_decay_warns_in_phase_two(seed):
    spec = SpiralSpec(seed=seed)
    res = detect_run(spiral(spec))
    assert res.phase_starts["stagnation"] < res.phase_starts["decay"]
    assert spec.decay_start <= res.phase_starts["decay"] <= spec.decay_start + 40
    warn = [a for a in res.alerts if a.severity == "warning"]
    assert warn[0].phase == "decay" and warn[0].step == res.phase_starts["decay"]
    assert warn[0].signal in ("ll_correct_mean", "delta_preserved_mean")
    assert warn[0].value < warn[0].threshold or warn[0].signal == "delta_preserved_mean"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decay_to_collapse_is_critical_before_reward_collapse(seed):
    spec = SpiralSpec(seed=seed)
    res = detect_run(spiral(spec))
    assert res.phase == "collapse"
    assert res.collapse_step is not None and spec.collapse_start < res.collapse_step <= spec.collapse_start + 30
    crit = [a for a in res.alerts if a.severity == "critical"]
    assert crit[0].step < res.collapse_step  # phase III is named before the reward collapses
    # phase III (acceleration) is named before the reward collapses; "collapse" only once it has
    assert res.phase_starts["decay"] < res.phase_starts["acceleration"] < res.collapse_step
    assert res.phase_starts["collapse"] >= res.collapse_step
    assert [p for _, p in res.phase_changes][-2:] == ["acceleration", "collapse"]
    # the reward-collapse alert itself
    rc = [a for a in res.alerts if a.signal == "reward_mean" and "reward collapse" in a.message]
    assert len(rc) == 1 and rc[0].value < rc[0].threshold
    lead = res.collapse_step - first(res.alerts)
    assert lead >= 20 and lead >= 0.25 * (res.collapse_step - spec.decay_start)


def test_flat_healthy_run_has_no_warning():
    rng = np.random.default_rng(7)
    n = 300
    df = pd.DataFrame({
        "step": np.arange(n),
        "reward_mean": 0.4 + rng.normal(0, 0.03, n),
        "ll_correct_mean": -0.6 + rng.normal(0, 0.02, n),
        "delta_preserved_mean": rng.normal(0.01, 0.03, n),
        "entropy": 0.9 + rng.normal(0, 0.02, n),
        "grad_norm": rng.lognormal(0, 0.1, n),
    })
    res = detect_run(df)
    assert first(res.alerts) is None
    assert res.collapse_step is None
    assert res.phase in ("healthy", "stagnation")


@pytest.mark.parametrize("seed", range(6))
def test_noisy_healthy_run_with_one_grad_spike_is_not_collapse(seed):
    df = healthy(seed=seed, noise=1.5)
    df.loc[df.step == 150, "grad_norm"] = 40.0
    res = detect_run(df)
    assert res.phase != "collapse"
    assert "collapse" not in res.phase_starts
    assert first(res.alerts) is None
    spikes = [a for a in res.alerts if a.signal == "grad_norm" and a.step == 150]
    assert len(spikes) == 1 and spikes[0].severity == "info" and spikes[0].value == 40.0
    assert spikes[0].value > spikes[0].threshold


def test_healthy_runs_many_seeds_no_false_warning():
    for seed in range(10, 20):
        for noise in (1.0, 1.5):
            res = detect_run(healthy(seed=seed, noise=noise))
            assert first(res.alerts) is None, (seed, noise, [a for a in res.alerts if a.severity != "info"])


def test_reward_collapse_definition_exact_step():
    # peak 0.6, then 0.2 from step 50; the trailing mean of 10 is 0.6 - 0.04 k after k low points,
    # below 0.3 from k = 8, i.e. step 57
    r = np.r_[np.full(50, 0.6), np.full(30, 0.2)]
    df = pd.DataFrame({"step": np.arange(80), "reward_mean": r})
    assert reward_collapse_step(df) == 57
    assert detect_run(df).collapse_step == 57
    # a dip shorter than collapse_patience is not a collapse
    r2 = np.r_[np.full(50, 0.6), np.full(5, 0.1), np.full(30, 0.6)]  # trailing mean never below 0.3
    assert reward_collapse_step(pd.DataFrame({"step": np.arange(r2.size), "reward_mean": r2})) is None
    # a run that never learned cannot collapse
    r3 = np.r_[np.full(50, 0.04), np.zeros(30)]
    assert reward_collapse_step(pd.DataFrame({"step": np.arange(80), "reward_mean": r3})) is None


def test_reward_collapse_with_nothing_else_is_critical_at_confirmation():
    r = np.r_[np.full(50, 0.6), np.full(30, 0.0)]  # trailing mean 0.6 - 0.06 k: below 0.3 from k = 6 (step 55)
    res = detect_run(pd.DataFrame({"step": np.arange(80), "reward_mean": r}))
    assert res.collapse_step == 55 and res.phase == "collapse"
    crit = [a for a in res.alerts if a.severity == "critical"]
    assert crit[0].step == 55 + DetectorConfig().collapse_patience - 1


def test_hysteresis_no_flicker_and_recovery():
    # decay for a while, then the likelihood rises again: decay is left once, never re-entered quickly
    rng = np.random.default_rng(5)
    n = 400
    t = np.arange(n, dtype=float)
    ll = -0.5 - np.clip(t - 80, 0, 70) * 0.004 + np.clip(t - 150, 0, None) * 0.004
    ll = np.minimum(ll, -0.5) + rng.normal(0, 0.02, n)
    # same-token displacement: negative while the likelihood falls, positive once it rises again
    delta = np.where((t >= 80) & (t < 150), -0.01, 0.01) + rng.normal(0, 0.003, n)
    df = pd.DataFrame({"step": t.astype(int), "ll_correct_mean": ll, "delta_preserved_mean": delta,
                       "reward_mean": 0.5 + rng.normal(0, 0.03, n)})
    res = detect_run(df)
    changes = [a for a in res.alerts if "phase back" in a.message or a.severity == "warning"]
    assert 1 <= sum(a.severity == "warning" for a in changes) <= 2
    assert res.phase != "decay"
    back = [a for a in res.alerts if "phase back" in a.message]
    assert back and back[0].value == back[0].threshold == DetectorConfig().exit_patience
    assert back[0].message.startswith("left phase II (likelihood decay) — the run recovered from it")


def test_scalar_only_verl_names_still_warn():
    spec = SpiralSpec(seed=1)
    res = detect_run(to_verl(spiral(spec)))
    assert res.signal_sources["ll_correct"] == "actor/pos_avg_old_log_prob"
    assert res.signal_sources["reward"] == "critic/score/mean"
    assert "displacement" not in res.signal_sources
    w = first(res.alerts)
    assert w is not None and res.collapse_step - w >= 20
    assert all(a.signal.startswith(("actor/", "critic/")) for a in res.alerts if a.signal != "phase")


def test_autocorrelated_noise_healthy_no_warning_spiral_still_warned():
    # training curves wander (AR(1) noise): the trend z is corrected for it
    for seed in range(8):
        res = detect_run(healthy(seed=seed, ar_phi=0.3).drop(columns=["delta_preserved_mean"]))
        assert first(res.alerts) is None, (seed, [a.message for a in res.alerts if a.severity != "info"])
        res = detect_run(spiral(SpiralSpec(seed=seed, ar_phi=0.3)).drop(columns=["delta_preserved_mean"]))
        assert res.collapse_step - first(res.alerts) >= 20


def _decline_only(seed: int, delta_mean: float) -> pd.DataFrame:
    """Likelihood flat then declining (no phase III, no collapse), same-token displacement of the given sign."""
    df = spiral(SpiralSpec(steps=220, seed=seed, accel_start=None, collapse_start=None))
    df["delta_preserved_mean"] = np.random.default_rng(seed + 50).normal(delta_mean, 0.03, len(df))
    return df


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_likelihood_decline_without_net_displacement_is_only_suspected(seed):
    # the preserved responses gain likelihood inside every step: the decline of the fresh samples'
    # likelihood is a shift of what is sampled, not displacement (paper.md section 6 caveat)
    res = detect_run(_decline_only(seed, delta_mean=+0.02))
    assert first(res.alerts) is None, [a.message for a in res.alerts if a.severity != "info"]
    shift = [a for a in res.alerts if "shift of the sampled responses" in a.message]
    assert shift and shift[0].severity == "info" and shift[0].signal == "ll_correct_mean"
    assert "decay" not in res.phase_starts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weaker_decline_counts_when_displacement_corroborates_it(seed):
    # switch off the two single-signal paths (likelihood alone, persistent displacement alone): the decay
    # must come from the two signals together, at the weaker corroborated threshold
    cfg = DetectorConfig(decay_z=-1e9, displacement_neg_frac=1.01)
    res = detect_run(_decline_only(seed, delta_mean=-0.04), cfg)
    warn = [a for a in res.alerts if a.severity == "warning"]
    assert warn and warn[0].signal == "ll_correct_mean" and warn[0].threshold == cfg.corroborated_decay_z
    assert warn[0].value < cfg.corroborated_decay_z and "< 0 on most of the last" in warn[0].message
    assert SpiralSpec().decay_start <= res.phase_starts["decay"] <= SpiralSpec().decay_start + 40
    # without the displacement column the same weak path cannot fire
    res = detect_run(_decline_only(seed, delta_mean=-0.04).drop(columns=["delta_preserved_mean"]), cfg)
    assert first(res.alerts) is None
    # and displacement that is mostly positive does not corroborate
    res = detect_run(_decline_only(seed, delta_mean=+0.02), cfg)
    assert first(res.alerts) is None


def _heavy_tailed_displacement(seed: int, big_every: int) -> np.ndarray:
    """Mostly small gains (+0.003) with a large displacing step (-0.08) every `big_every` steps."""
    rng = np.random.default_rng(seed + 70)
    d = np.abs(rng.normal(0.003, 0.001, 220))
    d[::big_every] = -0.08
    return d


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heavy_tailed_net_displacement_counts(seed):
    # most steps gain a little, a few displace a lot: the median and the count of negative steps say
    # "not displacing", the sum over the trend window says the updates lower the preserved responses
    df = _decline_only(seed, 0.0)
    df["delta_preserved_mean"] = _heavy_tailed_displacement(seed, big_every=8)  # mean < 0
    cfg = DetectorConfig(decay_z=-1e9)  # only the corroborated path (likelihood + displacement) can fire
    warn = [a for a in detect_run(df, cfg).alerts if a.severity == "warning"]
    assert warn and warn[0].signal == "ll_correct_mean" and "net negative over the last" in warn[0].message
    # the same large steps, too rare to outweigh the gains over the trend window: not net displacing
    df["delta_preserved_mean"] = _heavy_tailed_displacement(seed, big_every=60)  # one in any 45 steps: sum > 0
    assert first(detect_run(df, cfg).alerts) is None


def test_reward_dip_during_decay_is_acceleration_not_collapse_and_recovery_is_said():
    """Phase III (acceleration) is not 'reward collapsed': a run whose reward dips to 0.65 x its peak
    during the decay and comes back enters acceleration, never collapse, and leaves it saying so."""
    spec = SpiralSpec(steps=320, seed=4, accel_start=None, collapse_start=None)
    df = spiral(spec)
    t = df.step.to_numpy()
    dip = (t >= 150) & (t < 210)
    df["reward_mean"] = np.where(dip, df.reward_mean * 0.65, df.reward_mean)
    res = detect_run(df)
    assert res.collapse_step is None
    assert "acceleration" in res.phase_starts and "collapse" not in res.phase_starts
    entry = [a for a in res.alerts if a.phase == "acceleration" and a.severity == "critical"]
    assert entry and entry[0].message.startswith("phase III (acceleration)")
    assert 150 <= entry[0].step <= 180
    left = [a for a in res.alerts if a.message.startswith("left phase III (acceleration) — the run recovered")]
    assert left and left[0].step > 210 and left[0].value == DetectorConfig().exit_patience
    assert res.phase != "acceleration"
    # the phase path is recorded in order
    path = [p for _, p in res.phase_changes]
    assert path.index("decay") < path.index("acceleration") < len(path) - 1
