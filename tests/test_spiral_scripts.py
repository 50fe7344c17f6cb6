"""The experiment scripts on the bundled sample runs: the docs table is computed, not typed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_runs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_analyze_spiral_table_matches_the_stored_runs():
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.summarize(str(SAMPLES))
    with open_store_reader(SAMPLES) as r:
        runs = r.runs()
        assert len(rows) == len(runs)
        for row in rows:
            sig = r.signals(row["run_id"])
            assert row["detector_collapse_step"] == reward_collapse_step(sig)
            assert row["steps"] == len(sig)
            d = sig["delta_preserved"]
            assert row["delta_preserved_neg_share"] == pytest.approx(float((d < 0).mean()))
            assert row["reward_trough"] <= row["reward_peak"] and row["reward_trough_step"] >= row["reward_peak_step"]
    table = mod.markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    modes = [line.split("|")[1].strip() for line in table[2:]]
    assert modes == sorted(modes, key=lambda n: (0 if n.startswith("vanilla") else 2 if "llds-ma" in n else 1, n))
    for row, line in zip(sorted(rows, key=lambda x: {"vanilla": 0, "llds": 1, "llds_ma": 2}[x["mode"]]), table[2:]):
        col = row["detector_collapse_step"]
        assert line.rstrip(" |").endswith("–" if col is None else str(col))


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_goal_table_follows_the_written_criteria():
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.summarize(str(SAMPLES))
    with open_store_reader(SAMPLES) as r:
        for row in rows:
            sig = r.signals(row["run_id"])
            rew = sig.set_index("step")["reward_mean"]
            assert row["collapse_step"] == reward_collapse_step(sig)
            assert row["reward_last20"] == pytest.approx(float(rew.iloc[-20:].mean()))
            assert row["holds"] == (row["collapse_step"] is None and row["reward_last20"] >= 0.85 * row["reward_peak"])
            if row["paper_order"]:
                assert row["reward_hold_steps"] >= mod.HOLD_STEPS
                assert row["surge_step"] < row["collapse_step"]
    table = mod.goal_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    counts = mod.goal(rows)
    assert counts.startswith("vanilla collapses: ") and "LLDS holds" in counts
