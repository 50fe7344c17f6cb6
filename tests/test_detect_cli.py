"""`lld-monitor detect` over a real store written by RunLogger (its online detector in the writer
thread), and the stored online alerts == the offline replay."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lld_monitor.cli import main
from lld_monitor.detect import PHASE_TITLES, PHASES, detect_run
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl
from lld_monitor.logger import RunLogger
from lld_monitor.store import open_store_reader


def _write(store, name, mode, df, source="local"):
    with RunLogger(str(store), name, mode, {}, source=source, handle_signals=False) as log:
        for rec in df.to_dict("records"):
            step = int(rec.pop("step"))
            log.log_step(step, scalars={k: v for k, v in rec.items() if not math.isnan(v)})
        return log.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("detect_store")
    ids = {
        "vanilla-s0": _write(path, "vanilla-s0", "vanilla", spiral(SpiralSpec(seed=0))),
        "llds-s0": _write(path, "llds-s0", "llds", healthy(seed=0)),
        "verl-import": _write(path, "verl-import", "unknown", to_verl(spiral(SpiralSpec(seed=1))), source="wandb"),
    }
    return path, ids


def test_stored_online_alerts_equal_offline(store):
    path, ids = store
    r = open_store_reader(path)
    try:
        for name, rid in ids.items():
            stored = r.alerts(rid)
            res = detect_run(r.signals(rid))
            assert len(stored) == len(res.alerts) > 0, name
            for row, a in zip(stored.to_dict("records"), res.alerts):
                assert (row["step"], row["severity"], row["phase"], row["signal"], row["message"]) == \
                    (a.step, a.severity, a.phase, a.signal, a.message)
                assert np.isclose(row["value"], a.value, equal_nan=True)
    finally:
        r.close()


def test_detect_json_contract(store, capsys):
    path, _ = store
    assert main(["detect", "--store", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["name"]: r for r in out["runs"]}
    assert set(runs) == {"vanilla-s0", "llds-s0", "verl-import"}
    for r in runs.values():
        # the original contract's fields, plus the added ones
        assert set(r) == {"name", "mode", "source", "phase", "phase_starts", "collapse_step", "alerts",
                          "phase_title", "reward_collapsed", "phase_changes", "p_collapse", "p_collapse_step",
                          "forecast_model"}
        assert r["phase"] in PHASES and r["phase_title"] == PHASE_TITLES[r["phase"]]
        assert r["reward_collapsed"] == (r["collapse_step"] is not None)
        assert r["phase_changes"][-1]["phase"] == r["phase"]
        assert {c["phase"] for c in r["phase_changes"]} == set(r["phase_starts"])
        for a in r["alerts"]:
            assert set(a) == {"step", "phase", "severity", "signal", "value", "threshold", "message"}
            assert a["severity"] in ("info", "warning", "critical")
    v = runs["vanilla-s0"]
    assert v["mode"] == "vanilla" and v["source"] == "local" and v["phase"] == "collapse"
    assert isinstance(v["collapse_step"], int)
    assert v["phase_starts"]["decay"] < v["phase_starts"]["acceleration"] < v["collapse_step"]
    assert v["phase_title"] == "reward collapsed"
    assert runs["llds-s0"]["collapse_step"] is None
    assert not [a for a in runs["llds-s0"]["alerts"] if a["severity"] != "info"]
    assert runs["verl-import"]["source"] == "wandb"
    assert any(a["signal"] == "actor/pos_avg_old_log_prob" for a in runs["verl-import"]["alerts"])


def test_detect_one_run_text_and_filter(store, capsys):
    path, _ = store
    assert main(["detect", "--store", str(path), "--run", "vanilla-s0", "--min-severity", "warning"]) == 0
    text = capsys.readouterr().out
    assert "vanilla-s0" in text and "llds-s0" not in text
    assert "phase now: reward collapsed (collapse)" in text and "reward collapse: step" in text
    assert " info " not in text and "warning" in text


def test_detect_bad_store_and_run(tmp_path, store, capsys):
    assert main(["detect", "--store", str(tmp_path / "nope")]) == 2
    assert "no store at" in capsys.readouterr().err
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("hello")
    assert main(["detect", "--store", str(tmp_path / "foreign")]) == 2
    assert capsys.readouterr().err.strip()
    path, _ = store
    assert main(["detect", "--store", str(path), "--run", "no-such-run"]) == 2
    assert "no-such-run" in capsys.readouterr().err


def test_detect_config_file(store, tmp_path, capsys):
    path, _ = store
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"collapse_frac": 0.05}))
    assert main(["detect", "--store", str(path), "--run", "vanilla-s0", "--json", "--config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    base = main(["detect", "--store", str(path), "--run", "vanilla-s0", "--json"])
    out2 = json.loads(capsys.readouterr().out)
    assert base == 0 and out["runs"][0]["collapse_step"] != out2["runs"][0]["collapse_step"]
    cfg.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(SystemExit, match="unknown DetectorConfig field"):
        main(["detect", "--store", str(path), "--config", str(cfg)])


def test_one_config_file_reaches_cli_runlogger_and_the_default_detector(tmp_path, monkeypatch, capsys):
    """--config's file format is what RunLogger(detector=...) and $LLD_MONITOR_DETECTOR_CONFIG
    (read by every detector built without a config: RunLogger, the dashboard, `detect` without --config) take."""
    from lld_monitor.detect import CONFIG_ENV, OnlineDetector, load_detector_config

    cfg_file = tmp_path / "det.json"
    cfg_file.write_text(json.dumps({"collapse_frac": 0.05}))
    df = spiral(SpiralSpec(seed=0))
    store = tmp_path / "store"
    with RunLogger(str(store), "cfg-run", "vanilla", {}, handle_signals=False, detector=str(cfg_file)) as log:
        assert log._detector.detector.cfg.collapse_frac == 0.05
        for rec in df.to_dict("records"):
            log.log_step(int(rec.pop("step")), scalars=rec)
        rid = log.run_id
    r = open_store_reader(store)
    try:
        stored = r.alerts(rid)
        sig = r.signals(rid)
    finally:
        r.close()
    with_cfg = detect_run(sig, load_detector_config(str(cfg_file)))
    assert [(a.step, a.message) for a in with_cfg.alerts] == list(zip(stored["step"], stored["message"]))
    assert with_cfg.collapse_step != detect_run(sig).collapse_step  # the config changed the outcome
    # the environment variable: the default detector and `detect` without --config read the same file
    monkeypatch.setenv(CONFIG_ENV, str(cfg_file))
    assert OnlineDetector().cfg.collapse_frac == 0.05
    assert main(["detect", "--store", str(store), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["collapse_step"] == with_cfg.collapse_step
    # a bad file is a clear error, before any run is created
    cfg_file.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        RunLogger(str(tmp_path / "store2"), "bad", "vanilla", {}, handle_signals=False)
    assert not (tmp_path / "store2").exists()


def test_detect_onsets_adds_fields_and_text(store, capsys):
    path, _ = store
    assert main(["detect", "--store", str(path), "--run", "vanilla-s0", "--onsets", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["runs"][0]
    assert {"reference", "onsets", "spikes"} <= set(rec)
    assert rec["reference"] == {"step": rec["collapse_step"], "kind": "reward collapse"}
    found = [o for o in rec["onsets"] if o["onset_step"] is not None]
    assert found and all(o["lead_steps"] == rec["collapse_step"] - o["onset_step"] for o in found)
    assert [o["onset_step"] for o in found] == sorted(o["onset_step"] for o in found)
    assert main(["detect", "--store", str(path), "--run", "vanilla-s0", "--onsets"]) == 0
    assert "onsets (reference: reward collapse at step" in capsys.readouterr().out
