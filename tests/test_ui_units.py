"""Dashboard building blocks without Streamlit: signals, phases, pairing, token view, figures, serve helpers."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from lld_monitor.ui import figures, pairing, tokens
from lld_monitor.ui import phase_bands as phases
from lld_monitor.ui import series as sig


def _signals(n=50):
    s = np.arange(n)
    return pd.DataFrame({
        "step": s, "reward_mean": np.linspace(0.1, 0.5, n), "ll_correct_mean": -0.3 - 0.01 * s,
        "ll_incorrect_mean": -0.6 - 0.01 * s, "delta_preserved_mean": -0.001 * s,
        "frac_actions_displaced": np.linspace(0.3, 0.6, n), "entropy": np.linspace(1, 2, n),
        "grad_norm": np.where(s >= n - 5, 4.0, 0.5),
    })


def test_resolve_prefers_canonical_then_aliases():
    df = pd.DataFrame({"step": [0, 1], "actor/grad_norm": [1.0, 2.0], "critic/score/mean": [0.1, 0.2],
                       "reward_mean": [None, None]})
    assert sig.resolve(df, "grad_norm").tolist() == [1.0, 2.0]
    assert sig.resolve(df, "reward_mean").tolist() == [0.1, 0.2]  # empty canonical column falls through
    assert sig.resolve(df, "entropy") is None
    f = sig.canonical_frame(df)
    assert {"step", "grad_norm", "reward_mean"} <= set(f.columns) and "entropy" not in f.columns


def test_ema_keeps_gaps_and_zero_is_raw():
    v = np.array([0.0, 1.0, np.nan, 1.0])
    assert np.array_equal(sig.ema(v, 0.0), v, equal_nan=True)
    sm = sig.ema(v, 0.5)
    assert np.isnan(sm[2]) and 0 < sm[1] < 1 and sm[3] > sm[1]


def test_bands_from_series_keeps_recurring_phases():
    ps = pd.DataFrame({"step": [0, 1, 2, 3, 4, 5, 6],
                       "phase": ["healthy", "healthy", "decay", "collapse", "decay", "collapse", "collapse"]})
    b = phases.bands_from_series(ps)
    assert b["phase"].tolist() == ["healthy", "decay", "collapse", "decay", "collapse"]
    assert b["start"].tolist() == [0, 2, 3, 4, 5] and b["end"].tolist() == [2, 3, 4, 5, 6]
    assert phases.phase_at(b, 4) == "decay" and phases.phase_at(b, 6) == "collapse"


def test_detect_replay_matches_detect_run():
    from lld_monitor.detect import detect_run

    rng = np.random.default_rng(0)
    n = 150
    x = np.arange(n) / n
    df = pd.DataFrame({"step": np.arange(n), "reward_mean": np.clip(0.5 - 0.6 * np.clip(x - 0.7, 0, 1) * 3, 0, 1),
                       "ll_correct_mean": -0.3 - 3 * np.clip(x - 0.3, 0, 1) ** 2 + rng.normal(0, 0.005, n),
                       "entropy": 1 + np.clip(x - 0.6, 0, 1) * 5, "grad_norm": 0.5 + np.clip(x - 0.6, 0, 1) * 10})
    d = phases.detect(df)
    ref = detect_run(df)
    assert d.error is None and d.phase == ref.phase and d.collapse_step == ref.collapse_step
    assert len(d.alerts) == len(ref.alerts) and len(d.phase_by_step) == n
    assert d.phase_by_step["phase"].iloc[-1] == ref.phase
    # the first step of each phase in the series is the detector's phase_starts
    firsts = d.phase_by_step.drop_duplicates("phase").set_index("phase")["step"].to_dict()
    assert firsts == ref.phase_starts


def test_detect_empty_is_a_message_not_an_exception():
    assert phases.detect(pd.DataFrame()).error == "no steps yet"


def test_lead_table_orders_by_first_alert_and_skips_phase_rows():
    alerts = pd.DataFrame({
        "step": [10, 12, 30, 40, 41, 90], "phase": ["stagnation", "decay", "decay", "collapse", "collapse", "collapse"],
        "severity": ["info", "warning", "info", "critical", "info", "critical"],
        "signal": ["ll_correct_mean", "delta_preserved_mean", "ll_correct_mean", "grad_norm", "phase", "reward_mean"],
        "value": 0.0, "threshold": 0.0, "message": "m",
    })
    lt = phases.lead_table(alerts, collapse_step=100)
    assert lt["signal"].tolist() == ["ll_correct_mean", "delta_preserved_mean", "grad_norm", "reward_mean"]
    assert lt["lead_steps"].tolist() == [90, 88, 60, 10]
    assert phases.lead_table(alerts, None)["lead_steps"].isna().all()


def _runs(*rows):
    return pd.DataFrame([{"run_id": r[0], "name": r[0], "mode": r[1], "config": json.dumps(r[2]),
                          "started_at": pd.Timestamp("2026-01-01", tz="UTC") + pd.Timedelta(seconds=i),
                          "source": "local", "status": "finished"} for i, r in enumerate(rows)])


def test_twin_pairing_ignores_only_mode_and_regularizer_keys():
    base = {"lr": 1e-5, "model": "tiny", "seed": 0}
    runs = _runs(
        ("v", "vanilla", {**base, "mode": "vanilla", "run_name": "v"}),
        ("other_lr", "llds", {**base, "lr": 3e-5, "mode": "llds", "llds": {"lam": 0.2}}),
        ("twin", "llds", {**base, "mode": "llds", "llds": {"lam": 0.2, "gate": "action"}, "run_name": "t", "steps": 300}),
        ("ma", "llds_ma", {**base, "mode": "llds_ma", "llds": {"lam": 0.2, "answer_weight": 0.5}}),
        ("v2", "vanilla", {**base, "mode": "vanilla"}),
    )
    c = pairing.twin_candidates(runs, "v")
    assert c["run_id"].tolist() == ["twin", "ma", "other_lr"]  # vanilla v2 is not a twin of a vanilla run
    assert c["exact"].tolist() == [True, True, False]
    assert pairing.best_twin(runs, "twin") == "v2"  # newest exact vanilla
    assert pairing.best_twin(runs, "missing") is None


def test_differences_table_uses_latest_step_at_or_before():
    a = pd.DataFrame({"step": [0, 10, 20], "reward_mean": [0.1, 0.2, 0.3]})
    b = pd.DataFrame({"step": [0, 5, 15], "reward_mean": [0.0, 0.5, 0.6]})
    t = pairing.differences_table({"A": a, "B": b}, [12, 20], ["reward_mean"])
    assert t["A"].tolist() == [0.2, 0.3] and t["B"].tolist() == [0.5, 0.6]
    assert t["B − A"].round(6).tolist() == [0.3, 0.3]


def _tokens():
    return pd.DataFrame({
        "position": [0, 1, 2, 3, 4, 5],
        "token_id": [1, 2, 3, 4, 5, 6],
        "token_text": ["<search>", "x'<script>", "doc", "<answer>", "Paris", "</answer>"],
        "role": ["action", "action", "tool", "answer", "answer", "answer"],
        "action_idx": [0, 0, -1, 1, 1, 1],
        "logp_old": [-0.1, -2.0, None, -0.5, -0.2, -0.1],
        "logp_new": [-0.2, -1.0, None, -0.6, -0.3, -0.1],
        "logp_ref": [-0.1, -2.0, None, -0.5, -0.2, -0.1],
        "entropy": [0.5, 1.5, None, 0.2, 0.1, 0.1],
    })


@pytest.mark.parametrize("color_by", list(tokens.COLOR_BY))
def test_token_html_escapes_greys_tools_outlines_answer(color_by):
    h = tokens.token_html(_tokens(), color_by)
    assert "<script>" not in h and "x&#x27;&lt;script&gt;" in h
    assert h.count("class='lld-answer'") == 1  # one outlined span around the three answer tokens
    assert "tool/observation token (not scored)" in h and "action 0" in h and "action 1" in h
    assert "logp before -2.0000" in h and "logp after -1.0000" in h and "entropy 1.5000" in h
    with pytest.raises(ValueError):
        tokens.token_html(_tokens(), "nope")


def test_filter_samples_sorts_by_largest_drop():
    s = pd.DataFrame({"rank": 0, "sample_idx": [0, 1, 2, 3], "correct": [True, False, True, False],
                      "reward": [1, 0, 1, 0], "delta_sum": [-0.1, -2.0, None, 0.5]})
    assert tokens.filter_samples(s, "all", "delta_asc")["sample_idx"].tolist() == [1, 0, 3, 2]
    assert tokens.filter_samples(s, "correct", "delta_asc")["sample_idx"].tolist() == [0, 2]
    assert tokens.filter_samples(s, "incorrect", "delta_desc")["sample_idx"].tolist() == [3, 1]
    summ = tokens.token_summary(_tokens())
    assert summ["tool"] == 1 and summ["scored"] == 5 and summ["actions"] == 2
    assert summ["delta_sum"] == pytest.approx(-0.1 + 1.0 - 0.1 - 0.1 + 0.0, abs=1e-6)


def test_live_figure_has_bands_and_alerts_on_every_panel():
    df = _signals()
    bands = pd.DataFrame({"phase": ["healthy", "decay"], "start": [0, 20], "end": [20, 49]})
    alerts = pd.DataFrame({"step": [21, 45], "phase": ["decay", "collapse"], "severity": ["warning", "critical"],
                           "signal": ["ll_correct_mean", "grad_norm"], "value": 0.0, "threshold": 0.0, "message": ["a", "b"]})
    n_panels = len(sig.LIVE_PANELS)
    fig = figures.live_health_figure(df, bands, alerts, smoothing=0.5)
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(rects) == 2 * n_panels
    marker_traces = [t for t in fig.data if str(t.legendgroup).startswith("alerts-")]  # one per severity and panel
    assert len(marker_traces) == 2 * n_panels and all(len(t.x) == 1 for t in marker_traces)
    assert sum(bool(t.showlegend) for t in marker_traces) == 2  # one legend entry per severity
    # smoothing keeps the raw trace: a faint raw + a smoothed trace per signal
    raw = [t for t in fig.data if t.name and t.name.endswith("(raw)")]
    assert len(raw) == 7  # the 7 signals of _signals() (no accuracy column)
    fig0 = figures.live_health_figure(df, None, None, smoothing=0.0)
    assert not [t for t in fig0.data if t.name and t.name.endswith("(raw)")]
    assert figures.live_health_figure(pd.DataFrame(), None, None).layout.annotations[0].text == "No steps logged yet."


def test_forecast_chart_lines_up_with_the_signals_chart():
    """Live health's forecast chart sits under the signals chart: the same side margins, the whole width for the
    plot in both (make_subplots' right-axis gap removed), and the same steps on the x axis."""
    df = _signals()
    bands = pd.DataFrame({"phase": ["healthy", "decay"], "start": [0, 20], "end": [20, 49]})
    live = figures.live_health_figure(df, bands, None, smoothing=0.5)
    forecast = pd.DataFrame({"step": np.arange(40), "p_collapse": np.linspace(0, 0.9, 40)})
    fc = figures.forecast_figure(forecast, bands, collapse_step=40, step_range=(0.0, 49.0))
    for f in (live, fc):
        assert (f.layout.margin.l, f.layout.margin.r) == (60, 50)
        assert all(ax.automargin is False for ax in f.select_yaxes())
        assert all(tuple(ax.domain or (0, 1)) == (0.0, 1.0) for ax in f.select_xaxes())
    assert live.layout.xaxis.autorangeoptions.minallowed == fc.layout.xaxis.range[0] == -0.5
    assert live.layout.xaxis.autorangeoptions.maxallowed == fc.layout.xaxis.range[1] == 49.5


def test_one_step_run_draws_markers():
    fig = figures.live_health_figure(_signals(1), None, None, smoothing=0.9)
    assert fig.data and all(t.mode == "lines+markers" for t in fig.data)


def test_compare_and_token_figures():
    a, b = _signals(30), _signals(40)
    fig = figures.compare_figure([("A", a), ("B", b)], ["reward_mean", "entropy"])
    assert {t.name for t in fig.data} == {"A", "B"} and len(fig.data) == 4
    td = figures.token_delta_figure(_tokens())
    assert {t.name for t in td.data} == {"action", "answer", "tool (unscored)"}
    rd = figures.role_delta_distribution(_tokens())
    assert len(rd.data) == 2  # action and answer; tool tokens are not scored
    tl = figures.phase_timeline_figure(pd.DataFrame({"phase": ["healthy", "collapse"], "start": [0, 10], "end": [10, 20]}),
                                       None, 15)
    assert len(tl.data) == 2


def test_serve_loopback_detection_and_warning(caplog):
    from lld_monitor.commands import serve

    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("localhost") and serve.is_loopback("::1")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("192.168.1.10")
    cmd = serve.streamlit_command("127.0.0.1", 9999)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1" and cmd[cmd.index("--server.port") + 1] == "9999"
    caplog.set_level(logging.WARNING)
    proc = serve.start_server("/nonexistent-store", "0.0.0.0", 1, quiet=True)  # port 1: fails fast, unprivileged
    serve.stop_server(proc, timeout=5)
    assert any("0.0.0.0" in r.getMessage() and "anyone" in r.getMessage() for r in caplog.records)


def test_tracker_feeds_only_new_steps_and_matches_a_full_replay():
    n = 160
    x = np.arange(n) / n
    df = pd.DataFrame({"step": np.arange(n), "reward_mean": np.clip(0.5 - 1.8 * np.clip(x - 0.7, 0, 1), 0, 1),
                       "ll_correct_mean": -0.3 - 3 * np.clip(x - 0.3, 0, 1) ** 2, "entropy": 1 + 5 * np.clip(x - 0.6, 0, 1),
                       "grad_norm": 0.5 + 10 * np.clip(x - 0.6, 0, 1)})
    tr = phases.DetectionTracker()
    for end in (10, 11, 80, 80, n):  # growing prefixes, one repeated (a refresh with nothing new)
        inc = tr.update(df.iloc[:end])
    full = phases.detect(df)
    assert inc.phase == full.phase and inc.collapse_step == full.collapse_step
    assert inc.alerts.equals(full.alerts) and inc.phase_by_step.equals(full.phase_by_step)
    # a shorter table (re-import) resets instead of mixing histories
    again = tr.update(df.iloc[:50])
    assert again.phase_by_step.equals(phases.detect(df.iloc[:50]).phase_by_step)


def test_phase_timeline_rows_phase_on_top_signals_in_alert_order():
    bands = pd.DataFrame({"phase": ["healthy", "decay"], "start": [0, 10], "end": [10, 30]})
    alerts = pd.DataFrame({"step": [5, 12, 12, 20], "phase": ["healthy", "decay", "decay", "decay"],
                           "severity": ["info", "warning", "info", "info"],
                           "signal": ["ll_correct_mean", "phase", "entropy", "ll_correct_mean"],
                           "value": 0.0, "threshold": 0.0, "message": "m"})
    fig = figures.phase_timeline_figure(bands, alerts, None)
    assert list(fig.layout.yaxis.categoryarray) == ["entropy", "ll_correct_mean", "phase"]  # bottom -> top


def test_early_panels_fit_the_steps_before_phase_iii():
    """After phase III begins, the likelihood and Δ panels' y-axes fit the steps before it (the phase II move stays
    readable); the other panels and runs that never reach phase III keep autorange."""
    n = 100
    s = np.arange(n)
    df = _signals(n)
    df["ll_correct_mean"] = np.where(s < 60, -0.01 - 0.0005 * s, -0.5 - 0.01 * (s - 60))  # falls off a cliff at 60
    bands = pd.DataFrame({"phase": ["healthy", "decay", "acceleration"], "start": [0, 30, 60], "end": [30, 60, 99]})
    assert figures.late_phase_start(bands) == 60
    fig = figures.live_health_figure(df, bands, None, smoothing=0.0)
    ll_row = next(i for i, p in enumerate(sig.LIVE_PANELS, start=1) if "ll_correct_mean" in p.signals)
    lo, hi = fig.get_subplot(ll_row, 1).yaxis.range
    before = df.ll_correct_mean[s < 60]
    assert lo < before.min() < before.max() < hi and lo > -0.1  # the cliff to -0.89 is off the axis
    assert any(a.name == "early-axis-note" and "steps < 60" in a.text for a in fig.layout.annotations)
    ent_row = next(i for i, p in enumerate(sig.LIVE_PANELS, start=1) if "entropy" in p.signals)
    assert fig.get_subplot(ent_row, 1).yaxis.range is None  # not an early panel
    # no phase III: nothing is fitted
    calm = figures.live_health_figure(df, bands.iloc[:2], None, smoothing=0.0)
    assert calm.get_subplot(ll_row, 1).yaxis.range is None
    assert not any(a.name == "early-axis-note" for a in calm.layout.annotations)
    # a brief early phase III (back to phase II) does not decide the fit: the final stretch does
    flicker = pd.DataFrame({"phase": ["decay", "acceleration", "decay", "acceleration", "collapse"],
                            "start": [0, 5, 8, 60, 80], "end": [5, 8, 60, 80, 99]})
    assert figures.late_phase_start(flicker) == 60
