"""The signal registry is the one vocabulary: the store, the importer, the detector and the dashboard
derive from it, and docs/signals.md is its generated table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from lld_monitor import signals as key_map
from lld_monitor import signals as registry
from lld_monitor.detect.signal_sources import SIGNAL_CANDIDATES
from lld_monitor.store import schema
from lld_monitor.ui import series as ui

ROOT = Path(__file__).resolve().parents[1]


def test_docs_table_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "signals.md").read_text()
    assert doc == registry.markdown_table(), "regenerate: python -m lld_monitor.signals > docs/signals.md"
    out = subprocess.run([sys.executable, "-m", "lld_monitor.signals"], capture_output=True, text=True, check=True)
    assert out.stdout == doc


def test_each_signal_once_with_complete_rows():
    names = [s.name for s in registry.SIGNALS]
    assert len(names) == len(set(names))
    assert schema.STEP_SIGNALS == registry.STEP_SIGNALS
    for s in registry.SIGNALS:
        assert s.label and s.unit and s.meaning and s.colour.startswith("#"), s.name
        assert s.detector is None or s.detector in registry.DETECTOR_SIGNALS, s.name
        assert all(src.framework in registry.FRAMEWORKS for src in s.sources), s.name
        kinds = [src.exact for src in s.sources]
        assert kinds == sorted(kinds, reverse=True), f"{s.name}: exact keys come before proxies"
    for d in registry.DETECTOR_SIGNALS:
        ranks = [s.detector_rank for s in registry.SIGNALS if s.detector == d]
        assert sorted(ranks) == list(range(len(ranks))), d


def test_importer_maps_exact_keys_only():
    exact = {(name, src.key) for name in registry.STEP_SIGNALS for src in registry.all_sources(name) if src.exact}
    assert {(name, src.key) for name, src in key_map.KEY_MAP} <= exact
    for s in registry.SIGNALS:
        for src in s.sources:
            if not src.exact:
                row = {k: 1.0 for k in src.parts}
                assert s.name not in key_map.map_row(row), f"proxy {src.key} mapped onto {s.name}"
    assert key_map.map_row({"val/test_score/mean": 0.9}) == {}  # a validation score is not accuracy
    assert "pg_loss" not in key_map.map_row({"train/loss": 0.3})
    assert key_map.map_row({"lld/kl": 0.01, "actor/kl_loss": 0.5})["kl"] == 0.01  # our exporter's own key wins


def test_detector_and_dashboard_rank_the_same_keys():
    for name in registry.DETECTOR_SIGNALS:
        det = [c.label for c in SIGNAL_CANDIDATES[name]]
        exact_det = [c.label for c in SIGNAL_CANDIDATES[name] if c.exact]
        assert det[: len(exact_det)] == exact_det, f"{name}: a proxy ranked before an exact key"
        for col in registry.detector_columns(name):
            if col not in registry.STEP_SIGNALS:
                continue  # not drawn as a canonical series (ppo_kl stays under its verl key)
            ui_keys = [col, *ui.ALIASES.get(col, ())]
            assert [k for k in exact_det if k in ui_keys] == ui_keys, (name, col)
    # the clip fraction: whichever key the detector judged, the chart draws the same one
    frame = pd.DataFrame({"step": [0, 1], "clip_ratio/region_mean": [0.1, 0.2], "clip_ratio": [0.5, 0.6]})
    from lld_monitor.detect import resolve_columns

    assert resolve_columns(frame.columns)["clip_frac"] == "clip_ratio/region_mean"
    assert ui.canonical_frame(frame)["clip_frac"].tolist() == [0.1, 0.2]


def test_dashboard_draws_no_proxy_under_a_canonical_name():
    frame = pd.DataFrame({"step": [0, 1], "actor/pos_avg_old_log_prob": [-1.0, -2.0], "loss": [1.0, 2.0],
                          "val/test_score/mean": [0.3, 0.4]})
    canon = ui.canonical_frame(frame)
    assert set(canon.columns) == {"step"}
    assert {"actor/pos_avg_old_log_prob", "loss", "val/test_score/mean"} <= set(ui.available(frame))


@pytest.mark.parametrize(("given", "stored"), [("llds-ma", "llds_ma"), ("llds_ma", "llds_ma"), ("LLDS-MA", "llds_ma"),
                                               ("vanilla", "vanilla"), (None, "unknown")])
def test_mode_spelling(given, stored):
    assert schema.normalize_mode(given) == stored


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="llds-ma is accepted"):
        schema.normalize_mode("ppo")


def test_derived_sources():
    src = registry.Source("a / b", "verl", False)
    assert src.read({"a": 1.0, "b": 4.0}) == 0.25 and src.read({"a": 1.0, "b": 0.0}) is None
    assert registry.Source("a + b", "trl", True).read({"a": 1.0, "b": 2.0}) == 3.0
    assert registry.Source("x", "trl", True).read({"x": True}) is None  # a bool is not a number
