"""Issue 30: what the dashboard shows after a fast first load (detector restored from a checkpoint, or from the
cache beside an imported run) is identical to a full replay's: alerts, phases (per step and bands), phase starts,
collapse step. Runs with a collapse written by RunLogger, a run whose detector was restarted mid-run (a resume),
W&B imports (no online alerts: compute once, cache, restore), another detector config, rows that no longer match,
a damaged cache. Each run is 1,200-2,500 steps so the whole file stays quick."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pandas.testing as pdt
import pytest

from lld_monitor.detect import DetectorConfig, OnlineDetector
from lld_monitor.detect.checkpoint import CheckpointRecorder, replay_checkpoint, resume
from lld_monitor.detect.synthetic import SpiralSpec, spiral, to_verl
from lld_monitor.logger import LoggerOptions, RunLogger
from lld_monitor.store import RunWriter, open_store_reader
from lld_monitor.store.detector_cache import cache_files
from lld_monitor.store.schema import STEP_SIGNALS
from lld_monitor.ui import phase_bands as ph
from lld_monitor.ui import queries as q

SPEC = SpiralSpec(steps=1200, rise_end=30, decay_start=300, accel_start=900, collapse_start=1000, seed=3)


def _assert_same(fast: ph.Detection, full: ph.Detection) -> None:
    assert fast.error is None and full.error is None
    assert (fast.phase, fast.phase_starts, fast.collapse_step) == (full.phase, full.phase_starts, full.collapse_step)
    pdt.assert_frame_equal(fast.alerts, full.alerts)
    pdt.assert_frame_equal(fast.phase_by_step, full.phase_by_step)
    pdt.assert_frame_equal(fast.forecast, full.forecast)
    assert fast.forecast_model == full.forecast_model


def _overview_equals_full_replay(reader, run_id: str) -> ph.Detection:
    """A cold first load (what the page does for a run never opened) against a full replay of the same rows."""
    ov = q.run_overview(reader, run_id, tracker=ph.DetectionTracker())
    full = ph.detect(ov.signals)
    _assert_same(ov.detection, full)
    pdt.assert_frame_equal(ov.alerts, ph.merge_alerts(reader.alerts(run_id), full.alerts))
    pdt.assert_frame_equal(ov.bands, ph.bands_from_series(full.phase_by_step))
    return ov.detection


def _log_spiral(store, every: int = 100, cfg: dict | None = None) -> str:
    sig = spiral(SPEC)
    cols = [c for c in sig.columns if c != "step"]
    with RunLogger(store, "spiral", "vanilla", handle_signals=False, flush_every_steps=200,
                   detector=cfg, options=LoggerOptions(detector_checkpoint_every=every)) as lg:
        for row in sig.itertuples(index=False):
            d = row._asdict()
            lg.log_step(int(d["step"]), scalars={c: float(d[c]) for c in cols})
    return lg.run_id


def test_runlogger_checkpoints_restore_the_full_replay(tmp_path):
    rid = _log_spiral(tmp_path)
    r = open_store_reader(tmp_path)
    ck = r.detector_state(rid)
    assert ck["seq"].tolist() == list(range(12)) and ck["step"].iloc[-1] == SPEC.steps - 1  # every 100 + the end
    det = _overview_equals_full_replay(r, rid)
    assert det.collapse_step is not None and det.phase == "collapse"  # a run that collapses
    assert det.resumed_step == SPEC.steps - 1 and det.replayed == 0  # nothing replayed
    # a live run seen between two checkpoints: restored from the last one, the tail replayed
    sig = r.signals(rid)
    for upto in (250, 1150):
        fast = ph.DetectionTracker().update(sig.iloc[:upto], checkpoints=ck[ck["step"] < upto])
        assert fast.resumed_step == (upto // 100) * 100 - 1 and fast.replayed == upto % 100
        _assert_same(fast, ph.detect(sig.iloc[:upto]))
    # then refreshes feed only new steps, still equal
    tr = ph.DetectionTracker()
    tr.update(sig.iloc[:500], checkpoints=ck)
    _assert_same(tr.update(sig), ph.detect(sig))


def test_a_resumed_run_uses_only_checkpoints_that_match_what_is_stored(tmp_path):
    """A trainer restarted from step 400 re-logs steps 400-599 with other values and a fresh detector: the first
    detector's checkpoints after step 399 and every checkpoint of the second no longer match the stored rows."""
    first = spiral(SPEC)
    second = spiral(SpiralSpec(**{**SPEC.__dict__, "seed": 4}))
    cols = [c for c in first.columns if c != "step"]
    w = RunWriter.create(tmp_path, "resumed", "vanilla")
    for part, steps in ((first, range(0, 600)), (second, range(400, SPEC.steps))):
        rec = CheckpointRecorder(OnlineDetector(), every=100)
        for s in steps:
            row = {c: float(part[c].iloc[s]) for c in cols}
            w.append("steps", {"step": [s], **{k: [v] for k, v in row.items() if k in STEP_SIGNALS}})
            extra = [c for c in cols if c not in STEP_SIGNALS]  # as RunLogger splits them
            w.append("metrics", {"step": [s] * len(extra), "key": extra, "value": [row[c] for c in extra]})
            for a in rec.update(s, row):
                w.append("alerts", {k: [v] for k, v in a.to_dict().items()})
            if rec.due:
                w.append("detector_state", rec.checkpoint())
            w.flush() if s % 50 == 0 else None
        w.append("detector_state", rec.checkpoint())
    w.finish()
    r = open_store_reader(tmp_path)
    sig = r.signals(w.run_id)
    assert len(sig) == SPEC.steps + 200 and sig["step"].nunique() == SPEC.steps  # steps 400-599 twice
    det = _overview_equals_full_replay(r, w.run_id)
    assert det.resumed_step == 399 and det.replayed == SPEC.steps - 400
    assert det.collapse_step is not None


def test_imported_run_is_replayed_once_then_restored_from_its_cache(tmp_path):
    from lld_monitor.integrations.wandb.write_run import ImportSpec, write_run

    v = to_verl(spiral(SpiralSpec(**{**SPEC.__dict__, "steps": 2500, "decay_start": 600, "accel_start": 2000,
                                      "collapse_start": 2200})))
    history = [{"_step": int(s), **{k: float(x) for k, x in row.items() if k != "step"}}
               for s, (_, row) in zip(v["step"], v.iterrows())]
    res = write_run(str(tmp_path), ImportSpec(wandb_id="abc123", project="proj"), history, progress=False)
    r = open_store_reader(tmp_path)
    assert r.alerts(res.run_id).empty  # no online detector, no alerts...
    (cached,) = cache_files(tmp_path / "runs" / res.run_id)  # ...but the import stored the detector's replay
    at_import = _overview_equals_full_replay(r, res.run_id)
    assert at_import.resumed_step == 2499 and at_import.replayed == 0
    # a run imported by an older version (no replay beside it): replayed once by the first reader, then cached
    Path(cached).unlink()
    r = open_store_reader(tmp_path)
    assert r.detector_state(res.run_id).empty
    cold = _overview_equals_full_replay(r, res.run_id)
    assert cold.resumed_step is None and cold.replayed == 2500  # the one full replay...
    assert cache_files(tmp_path / "runs" / res.run_id) == [cached]  # ...cached beside the run, as the import does
    again = _overview_equals_full_replay(open_store_reader(tmp_path), res.run_id)
    assert again.resumed_step == 2499 and again.replayed == 0
    assert cold.alerts.equals(again.alerts) and len(again.alerts) and again.collapse_step is not None
    # a re-import with other values replaces the run: the old cache goes with it; the new import's replay is right
    history2 = [{**h, "critic/score/mean": h["critic/score/mean"] * 0.9} for h in history]
    write_run(str(tmp_path), ImportSpec(wandb_id="abc123", project="proj"), history2, progress=False)
    fresh = _overview_equals_full_replay(open_store_reader(tmp_path), res.run_id)
    assert fresh.resumed_step == 2499 and cache_files(tmp_path / "runs" / res.run_id) == [cached]
    assert not fresh.alerts.equals(again.alerts)


def test_checkpoints_of_another_config_or_other_rows_are_not_used(tmp_path):
    rid = _log_spiral(tmp_path, every=300, cfg={"decay_z": -3.0})
    r = open_store_reader(tmp_path)
    det = _overview_equals_full_replay(r, rid)  # the dashboard's default config: the run's checkpoints do not apply
    assert det.resumed_step is None
    sig, ck = r.signals(rid), r.detector_state(rid)
    cfg = DetectorConfig(decay_z=-3.0)
    assert resume(sig, ck, cfg).step == SPEC.steps - 1  # with their own config they do
    changed = sig.copy()
    changed.loc[changed["step"] == 700, "reward_mean"] += 1e-9  # one value differs from what the detector saw
    res = resume(changed, ck, cfg)
    assert res.step == 599  # the last checkpoint before the change
    nan_now = sig.copy()
    nan_now.loc[nan_now["step"] == 10, "entropy"] = np.nan
    assert resume(nan_now, ck, cfg) is None


def test_a_damaged_or_foreign_cache_is_ignored_and_nothing_is_lost(tmp_path):
    rid = _log_spiral(tmp_path, every=400)
    r = open_store_reader(tmp_path)
    sig = r.signals(rid)
    cache_dir = tmp_path / "runs" / rid / "detector_cache"
    cache_dir.mkdir()
    (cache_dir / "0123abcd.parquet").write_bytes(b"not parquet")
    ck = r.detector_state(rid)  # the damaged file is skipped with a warning
    assert len(ck) == 3
    # a cache of another run's replay (wrong digest) next to this run is not used either
    other = spiral(SpiralSpec(**{**SPEC.__dict__, "seed": 9}))
    det = OnlineDetector()
    from lld_monitor.detect import iter_signal_rows
    for s, row in iter_signal_rows(other):
        det.update(s, row)
    row = replay_checkpoint(det, other)
    res = resume(sig, pd.DataFrame({k: v for k, v in row.items()}))
    assert res is None
    _overview_equals_full_replay(open_store_reader(tmp_path), rid)
    assert (cache_dir / "0123abcd.parquet").read_bytes() == b"not parquet"


@pytest.mark.parametrize("cut", [19, 333])
def test_detector_state_round_trips_exactly(cut):
    import json

    sig = spiral(SPEC)
    from lld_monitor.detect import detect_run, iter_signal_rows

    rows = list(iter_signal_rows(sig))
    d = OnlineDetector()
    for s, row in rows[:cut]:
        d.update(s, row)
    assert d.forecast_model is not None  # AUTO: the shipped model for a run that logs displacement
    d2 = OnlineDetector.from_state(json.loads(json.dumps(d.to_state())), None, d.alerts, d.phase_changes,
                                   forecast_model=d.forecast_model, forecast=d.forecast)
    for s, row in rows[cut:]:
        d2.update(s, row)
    full = detect_run(sig)
    got = d2.result()
    assert got.alerts == full.alerts and got.phase_changes == full.phase_changes
    assert got.forecast == full.forecast and got.forecast_model == full.forecast_model
    assert (got.phase, got.phase_starts, got.collapse_step, got.signal_sources) == (
        full.phase, full.phase_starts, full.collapse_step, full.signal_sources)
