"""The collapse forecast (detect/forecast_model.py, forecast_fit.py): the model file, the probability and the fit by hand,
the labels as pre-registered, online == offline, the alert, checkpoints, the `forecast` command and `forecast fit`."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pandas as pd
import pytest

from lld_monitor.cli import main
from lld_monitor.detect import detect_run, load_detector_config
from lld_monitor.detect import forecast_fit as ff
from lld_monitor.detect.forecast_model import FEATURES, MODEL_ENV, THRESHOLD, ForecastModel, model_for, scalar_columns
from lld_monitor.detect.online import OnlineDetector
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl
from lld_monitor.logger import RunLogger
from lld_monitor.store import open_store_reader

H = 30


def _model(**kw) -> ForecastModel:
    base = dict(name="hand", horizon=H, inputs="all", features=("reward_vs_peak", "ll_z"), mean=(1.0, 0.0),
                scale=(2.0, 4.0), coef=(1.0, -2.0), intercept=-1.0, fitted={"by": "hand"})
    return ForecastModel(**{**base, **kw})


def _spiral(seed: int, shift: int = 0) -> pd.DataFrame:
    return spiral(SpiralSpec(seed=seed, decay_start=80 + shift, accel_start=150 + shift, collapse_start=180 + shift))


def _runs() -> dict[str, pd.DataFrame]:
    out = {f"spiral-{s}": _spiral(s, 10 * (s % 3) - 10) for s in range(5)}
    out.update({f"healthy-{s}": healthy(seed=s) for s in range(3)})
    return out


@pytest.fixture(scope="module")
def fitted() -> tuple[dict[str, ff.RunSteps], ForecastModel]:
    cfg = load_detector_config(None)
    steps = {k: ff.run_steps(k, df, H, "all", cfg) for k, df in _runs().items()}
    return steps, ff.fit(list(steps.values()), "synthetic", "all", H, l2=10.0)


# ---------------------------------------------------------------------------------------------- the model file
def test_model_round_trip_fingerprint_and_bad_files(tmp_path):
    m = _model()
    p = tmp_path / "m.json"
    p.write_text(m.to_json())
    assert ForecastModel.load(p) == m
    assert ForecastModel.load(p).fingerprint == m.fingerprint
    assert _model(name="other", fitted={}).fingerprint == m.fingerprint  # provenance is not what it computes
    assert _model(intercept=0.0).fingerprint != m.fingerprint
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "name": "x"}')
    with pytest.raises(ValueError, match="forecast fit"):
        ForecastModel.load(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not a forecast model"):
        ForecastModel.load(bad)
    with pytest.raises(FileNotFoundError):
        ForecastModel.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown features"):
        _model(features=("reward_vs_peak", "nope"))
    with pytest.raises(ValueError, match="inputs"):
        _model(inputs="some")


def test_probability_by_hand():
    m = _model()
    # z = -1 + 1 * (3 - 1) / 2 - 2 * (2 - 0) / 4 = -1 + 1 - 1 = -1
    assert m.probability({"reward_vs_peak": 3.0, "ll_z": 2.0}) == pytest.approx(1 / (1 + math.e), abs=1e-15)
    # a missing (NaN or absent) feature stands at its mean: z = -1 + 1 = 0
    assert m.probability({"reward_vs_peak": 3.0, "ll_z": math.nan}) == 0.5
    assert m.probability({"reward_vs_peak": 3.0}) == 0.5
    assert m.probability({"ll_z": 1e6}) == 0.0  # no overflow far out


def test_steps_to_line_by_hand():
    """The steps until the smoothed reward (10-point mean) reaches 0.5 x its peak at its 20-point trend."""
    from lld_monitor.detect.forecast_model import LINE_MAX_STEPS, detector_features

    det = OnlineDetector(load_detector_config(None), None)
    reward = [1.0] * 40 + [1.0 - 0.01 * k for k in range(1, 41)]  # flat, then down 0.01 a step
    got = {}
    for step, r in enumerate(reward):
        det.update(step, {"reward_mean": r})
        got[step] = detector_features(det)["steps_to_line"]
    assert got[20] == pytest.approx(math.log1p(LINE_MAX_STEPS))  # flat: not falling
    # step 79: the last 20 points fall 0.01 a step exactly; smoothed = mean(0.69 ... 0.60) = 0.645, peak 1.0
    assert got[79] == pytest.approx(math.log1p((0.645 - 0.5) / 0.01), rel=1e-9)
    assert got[59] == pytest.approx(math.log1p((0.845 - 0.5) / 0.01), rel=1e-9)


def test_fit_logistic_meets_its_optimality_conditions():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = (x @ [1.5, -1.0, 0.0] + rng.normal(size=400) > 0.3).astype(float)
    for l2 in (0.1, 10.0):
        w, b = ff.fit_logistic(x, y, l2)
        p = 1 / (1 + np.exp(-(x @ w + b)))
        assert np.abs(x.T @ (p - y) + l2 * w).max() < 1e-8  # gradient of the penalized loss is zero
        assert abs((p - y).sum()) < 1e-8  # the intercept is not penalized: mean p = base rate
    w_small, _ = ff.fit_logistic(x, y, 0.1)
    w_big, _ = ff.fit_logistic(x, y, 1000.0)
    assert np.linalg.norm(w_big) < 0.5 * np.linalg.norm(w_small)
    assert w_small[0] > 1.0 and w_small[1] < -0.5


# ---------------------------------------------------------------------------------------------- labels
def test_labels_are_the_preregistered_ones(fitted):
    steps, _ = fitted
    r = steps["spiral-0"]
    c = r.collapse_step
    assert c is not None
    f = r.frame
    before = f[f["step"] < c]
    assert (before["y"] == ((c - before["step"]) <= H).astype(float)).all()
    assert before["defined"].all()
    after = f[f["step"] >= c]
    assert len(after) and after["y"].isna().all() and not after["defined"].any()
    h = steps["healthy-0"]
    assert h.collapse_step is None
    last = int(h.frame["step"].max())
    assert (h.frame.loc[h.frame["step"] <= last - H, "y"] == 0).all()
    assert h.frame.loc[h.frame["step"] > last - H, "y"].isna().all()  # censored: the future is not known
    assert h.frame["defined"].all()


def test_fit_uses_the_signals_and_beats_the_constant(fitted):
    steps, model = fitted
    runs = list(steps.values())
    preds = [ff.predict(model, r) for r in runs]
    sc = ff.scores_of(runs, preds)
    const = ff.scores_of(runs, ff.constant_baseline(runs, sc.base_rate))
    assert sc.brier < 0.7 * const.brier
    assert all(v is not None and v > 0 for v in sc.leads.values())
    assert max(sc.max_p_no_collapse.values()) < THRESHOLD
    assert set(model.features) <= set(FEATURES) and len(model.features) >= 8
    assert model.fitted["l2"] == 10.0


def test_reliability_and_ece_by_hand():
    p = np.array([0.05, 0.05, 0.95, 0.95, 0.55])
    y = np.array([0.0, 1.0, 1.0, 1.0, 0.0])
    table, ece = ff.reliability(p, y)
    assert list(table["n"]) == [2, 0, 0, 0, 0, 1, 0, 0, 0, 2]
    # |0.05 - 0.5| * 2/5 + |0.55 - 0| * 1/5 + |0.95 - 1| * 2/5
    assert ece == pytest.approx(0.45 * 0.4 + 0.55 * 0.2 + 0.05 * 0.4)


def test_not_enough_runs_says_what_there_is():
    runs = [ff.RunSteps("a", pd.DataFrame(), 10), ff.RunSteps("b", pd.DataFrame(), None)]
    with pytest.raises(ff.NotEnoughRuns, match=r"this store has 2 run\(s\) with steps, 1 collapsed and 1 did not"):
        ff.check_enough(runs)


# ---------------------------------------------------------------------------------------------- online == offline
def test_online_forecast_equals_the_fit_s_predict_and_alerts_once(fitted):
    steps, model = fitted
    cfg = load_detector_config(None)
    for name, df in _runs().items():
        res = detect_run(df, cfg, model)
        p = ff.predict(model, steps[name])
        f = steps[name].frame
        want = [(int(s), float(q)) for s, q in zip(f["step"], p) if np.isfinite(q)]
        assert [s for s, _ in res.forecast] == [s for s, _ in want], name
        assert np.allclose([q for _, q in res.forecast], [q for _, q in want], rtol=0, atol=1e-12), name
        alerts = [a for a in res.alerts if a.signal == "forecast"]
        crossed = [s for s, q in res.forecast if q >= THRESHOLD]
        assert len(alerts) == (1 if crossed else 0), name
        if crossed:
            assert alerts[0].step == crossed[0] and alerts[0].severity == "warning"
            assert f"within the next {H} steps" in alerts[0].message
        assert res.forecast_model == "synthetic"
        if res.collapse_step is not None:
            assert all(s < res.collapse_step for s, _ in res.forecast)


def test_checkpoint_resume_keeps_the_forecast(fitted):
    _, model = fitted
    cfg = load_detector_config(None)
    df = _spiral(3)
    full = detect_run(df, cfg, model)
    rows = df.to_dict("records")
    det = OnlineDetector(cfg, model)
    for rec in rows[:120]:
        det.update(int(rec.pop("step")), rec)
    back = OnlineDetector.from_state(det.to_state(), cfg, alerts=list(det.alerts),
                                     phase_changes=list(det.phase_changes), forecast_model=model,
                                     forecast=list(det.forecast))
    for rec in rows[120:]:
        back.update(int(rec.pop("step")), rec)
    res = back.result()
    assert res.forecast == full.forecast
    assert [a.step for a in res.alerts if a.signal == "forecast"] == \
        [a.step for a in full.alerts if a.signal == "forecast"]


def test_auto_picks_the_env_model_and_a_bad_one_only_warns(fitted, tmp_path, monkeypatch, caplog):
    _, model = fitted
    p = tmp_path / "mine.json"
    p.write_text(model.to_json())
    monkeypatch.setenv(MODEL_ENV, str(p))
    df = _spiral(1)
    assert model_for(df.iloc[0].to_dict()) == model
    res = detect_run(df)  # forecast=AUTO
    assert res.forecast_model == "synthetic" and res.forecast == detect_run(df, None, model).forecast
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "missing.json"))
    det = OnlineDetector(None, "auto")
    with caplog.at_level(logging.WARNING, logger="lld_monitor.detect.online"):  # (pages and CLIs quiet lld_monitor.detect)
        for rec in df.head(40).to_dict("records"):
            det.update(int(rec.pop("step")), rec)
    assert det.forecast_model is None and det.forecast == []
    assert "no collapse forecast" in caplog.text and "missing.json" in caplog.text


def test_a_scalars_model_sees_only_the_scalars(fitted):
    steps, _ = fitted
    cfg = load_detector_config(None)
    runs = {k: to_verl(df) for k, df in _runs().items()}
    scal = [ff.run_steps(k, df, H, "scalars", cfg) for k, df in runs.items()]
    model = ff.fit(scal, "scalars-synthetic", "scalars", H, l2=10.0)
    assert model.inputs == "scalars"
    df = _runs()["spiral-2"]  # our trainer's columns: more than the model may see
    assert set(scalar_columns(df.columns)) < set(df.columns)
    res = detect_run(df, cfg, model)
    alone = detect_run(df[scalar_columns(df.columns)], cfg, model)
    assert res.forecast == alone.forecast
    assert res.phase_changes == detect_run(df, cfg, None).phase_changes  # the phases still see every column


# ---------------------------------------------------------------------------------------------- the commands
def _write(store, name, df):
    with RunLogger(str(store), name, "vanilla", {}, handle_signals=False) as log:
        for rec in df.to_dict("records"):
            step = int(rec.pop("step"))
            log.log_step(step, scalars={k: v for k, v in rec.items() if not math.isnan(v)})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("forecast_store")
    for name, df in _runs().items():
        _write(path, name, df)
    return path


def test_forecast_fit_then_forecast_and_detect_with_it(store, tmp_path, capsys):
    out = tmp_path / "mine.json"
    assert main(["forecast", "fit", "--store", str(store), "--out", str(out), "--folds", "4"]) == 0
    text = capsys.readouterr().out
    assert "8 runs (5 with a reward collapse)" in text and "held-out (4-fold by run): Brier" in text
    model = ForecastModel.load(out)
    assert model.horizon == H and model.inputs == "all" and model.fitted["heldout"]["folds"] == 4
    assert sorted(model.fitted["runs"]) == sorted(_runs())

    assert main(["forecast", "--store", str(store), "--model", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == set(_runs())
    r = runs["spiral-0"]
    assert set(r) == {"name", "horizon", "model", "collapse_step", "steps"}
    assert r["model"] == "mine" and r["horizon"] == H and isinstance(r["collapse_step"], int)
    for s in r["steps"]:
        assert set(s) == {"step", "p_collapse"}
        assert (s["p_collapse"] is None) == (s["step"] >= r["collapse_step"])
    known = [s for s in r["steps"] if s["p_collapse"] is not None]
    assert known and all(0.0 <= s["p_collapse"] <= 1.0 for s in known)

    assert main(["detect", "--store", str(store), "--model", str(out), "--json", "--run", "spiral-0", "healthy-1"]) == 0
    det = {d["name"]: d for d in json.loads(capsys.readouterr().out)["runs"]}
    assert {d["forecast_model"] for d in det.values()} == {"mine"}
    first = next(s["step"] for s in known if s["p_collapse"] >= THRESHOLD)
    assert [a["step"] for a in det["spiral-0"]["alerts"] if a["signal"] == "forecast"] == [first]
    assert first < r["collapse_step"]
    assert det["spiral-0"]["p_collapse"] is None  # the reward has collapsed: nothing left to forecast
    last = [s for s in runs["healthy-1"]["steps"] if s["p_collapse"] is not None][-1]
    assert (det["healthy-1"]["p_collapse_step"], det["healthy-1"]["p_collapse"]) == (last["step"], last["p_collapse"])


def test_forecast_command_errors(store, tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(_model().to_json())
    assert main(["forecast", "--store", str(store), "--model", str(m), "--horizon", "10"]) == 2
    assert "predicts within 30 steps, not 10" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["forecast", "--store", str(store), "--model", str(bad)]) == 2
    assert "forecast fit" in capsys.readouterr().err
    assert main(["forecast", "fit", "--store", str(store)]) == 2
    assert "--out FILE is required" in capsys.readouterr().err
    assert main(["forecast", "fit", "--store", str(store), "--run", "spiral-0", "healthy-0", "--out",
                 str(tmp_path / "x.json")]) == 2
    assert "this store has 2 run(s) with steps, 1 collapsed and 1 did not" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit, match="no store"):
        main(["forecast", "--store", str(tmp_path / "nowhere")])


def test_runlogger_stores_the_forecast_of_its_detector(fitted, tmp_path, monkeypatch):
    _, model = fitted
    p = tmp_path / "mine.json"
    p.write_text(model.to_json())
    monkeypatch.setenv(MODEL_ENV, str(p))
    df = _spiral(4)
    _write(tmp_path / "s", "live", df)
    r = open_store_reader(tmp_path / "s")
    try:
        rid = r.runs()["run_id"].iloc[0]
        stored = [a for a in r.alerts(rid).to_dict("records") if a["signal"] == "forecast"]
    finally:
        r.close()
    res = detect_run(df, None, model)
    want = [a for a in res.alerts if a.signal == "forecast"]
    assert len(stored) == len(want) == 1
    assert stored[0]["step"] == want[0].step and stored[0]["message"] == want[0].message
