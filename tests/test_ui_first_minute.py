"""Issue 16, the newcomer's first minute: what the dashboard opens on and how it tells the spiral's story
(pure functions, plus AppTest for the run the demo opens on)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.synth_store import write_pair  # noqa: E402
from lld_monitor.commands import serve  # noqa: E402
from lld_monitor.ui import figures, queries, widgets  # noqa: E402
from lld_monitor.ui import phase_bands as ph  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("first_minute") / "store"
    vanilla, llds = write_pair(path, steps=90, token_every=6, flush_every=30)
    return {"path": str(path), "vanilla": vanilla, "llds": llds}


def _runs(**cols) -> pd.DataFrame:
    base = {"run_id": ["a", "b", "c"], "name": ["demo-llds-seed2", "demo-vanilla-seed2", "vanilla-seed3"],
            "mode": ["llds", "vanilla", "vanilla"], "source": ["local"] * 3, "status": ["running", "running", "finished"]}
    base.update(cols)
    return pd.DataFrame(base)


def test_default_run_prefers_the_named_then_the_live_vanilla_run():
    runs = _runs()
    assert queries.default_run(runs) == "b"  # newest live vanilla run
    assert queries.default_run(runs, "demo-llds-seed2") == "a" and queries.default_run(runs, "c") == "c"
    assert queries.default_run(runs, "not-there") == "b"
    assert queries.default_run(_runs(status=["finished"] * 3)) == "b"  # newest vanilla run
    assert queries.default_run(_runs(mode=["llds", "llds_ma", "unknown"], status=["finished"] * 3)) == "a"
    assert queries.default_run(pd.DataFrame()) is None


def test_run_labels_are_short():
    row = {"name": "vanilla-seed3", "mode": "vanilla", "source": "local", "status": "finished"}
    assert queries.run_label(row, "collapse") == "vanilla-seed3 · collapse"
    row = {"name": "demo-llds-seed2", "mode": "llds", "source": "local", "status": "running"}
    assert queries.run_label(row, "decay") == "demo-llds-seed2 · live · decay"
    row = {"name": "search-r1-ppo", "mode": "llds_ma", "source": "wandb", "status": "crashed"}
    assert queries.run_label(row) == "search-r1-ppo · llds-ma · wandb · crashed"


def test_alerts_filter_and_mode_colours():
    alerts = pd.DataFrame({"step": [1, 2, 3], "phase": ["healthy"] * 3, "severity": ["info", "warning", "critical"],
                           "signal": ["x"] * 3, "value": 0.0, "threshold": 0.0, "message": ["m"] * 3})
    assert list(ph.filter_alerts(alerts)["severity"]) == ["warning", "critical"]
    assert len(ph.filter_alerts(alerts, ("info", "warning", "critical"))) == 3
    assert len(ph.filter_alerts(None)) == 0
    styles = figures.run_styles(["vanilla", "llds", "vanilla", "llds_ma", None])
    assert styles[0] == (ph.MODE_COLORS["vanilla"], "solid") and styles[2] == (ph.MODE_COLORS["vanilla"], "dash")
    assert styles[1][0] == ph.MODE_COLORS["llds"] and styles[3][0] == ph.MODE_COLORS["llds_ma"]
    assert styles[4][0] == ph.MODE_COLORS["unknown"]
    assert len(set(ph.MODE_COLORS.values())) == len(ph.MODE_COLORS)
    assert ph.phase_ii() == ph.detector_phases()[2]


def test_live_figure_tells_the_story(pair):
    from lld_monitor.store import open_store_reader

    with open_store_reader(pair["path"]) as r:
        ov = queries.run_overview(r, pair["vanilla"])
        twin = r.signals(pair["llds"])
    assert ov.phase_ii_step is not None
    fig = figures.live_health_figure(ov.signals, ov.bands, ph.filter_alerts(ov.alerts), 0.6, mode="vanilla",
                                     run_label="v", twin=("l", twin, "llds"), phase_ii_step=ov.phase_ii_step)
    # the correct-response log-likelihood has a panel of its own, with the phase II onset drawn on it
    titles = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("Log-likelihood of correct responses (nats per action token)") for t in titles)
    assert any(t == f"phase II onset · step {ov.phase_ii_step}" for t in titles)
    assert any(s.type == "line" and s.x0 == ov.phase_ii_step for s in fig.layout.shapes)
    # the run in its mode's colour, the twin in its own; every legend entry says what it is
    colours = {t.legendgroup: t.line.color for t in fig.data if t.mode == "lines" and t.showlegend}
    assert colours == {"v": ph.MODE_COLORS["vanilla"], "l": ph.MODE_COLORS["llds"]}
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert any(n.startswith("warning alert:") for n in legend) and ph.phase_title(ph.phase_ii()) in legend
    assert not any(str(t.legendgroup) == "alerts-info" for t in fig.data)
    cap = figures.live_legend_caption(ov.bands, 3)
    assert "3 info alert(s) hidden" in cap and ph.phase_title(ph.phase_ii()) in cap


def test_compare_colours_by_mode_and_csv():
    a = pd.DataFrame({"step": [0, 1, 2], "reward_mean": [0.1, 0.2, 0.3]})
    fig = figures.compare_figure([("A", a), ("B", a)], ["reward_mean"], modes=["llds", "vanilla"])
    assert [t.line.color for t in fig.data] == [ph.MODE_COLORS["llds"], ph.MODE_COLORS["vanilla"]]
    table = figures.compare_table({"A": a, "B": a}, ["reward_mean"])
    assert list(table.columns) == ["run", "step", "signal", "value"] and len(table) == 6


def test_token_view_lists_samples_with_tokens_first(pair):
    from lld_monitor.store import open_store_reader

    with open_store_reader(pair["path"]) as r:
        pick = queries.best_token_pick(r, pair["vanilla"])
        view = queries.token_view(r, pair["vanilla"], pick.step)
    assert view.samples["has_tokens"].iloc[0] and not view.tokens.empty
    flags = view.samples["has_tokens"].tolist()
    assert flags == sorted(flags, reverse=True)  # tokens first, then the rest
    row = view.samples[(view.samples["sample_idx"] == pick.sample_idx) & (view.samples["rank"] == pick.rank)].iloc[0]
    assert row["advantage"] >= 0 and row["has_tokens"]


def _app(store: str) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    at.session_state["store_path"] = store
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_demo_opens_on_its_vanilla_run_and_waits_for_it(pair, monkeypatch):
    # `lld-monitor demo` hands the server the name of its live vanilla run
    assert serve.OPEN_RUN_ENV == widgets.OPEN_RUN_ENV
    monkeypatch.setenv(widgets.OPEN_RUN_ENV, "synth-llds")
    assert _app(pair["path"]).sidebar.selectbox(key="run_id").value == pair["llds"]
    # before its first step the run is not in the store: the page says it waits, then switches to it
    monkeypatch.setenv(widgets.OPEN_RUN_ENV, "demo-vanilla-seed2")
    at = _app(pair["path"])
    assert "Waiting for **demo-vanilla-seed2**" in "".join(c.value for c in at.sidebar.caption)
    monkeypatch.setenv(widgets.OPEN_RUN_ENV, "synth-llds")  # as if it had appeared
    at.run()
    assert at.sidebar.selectbox(key="run_id").value == pair["llds"]
