"""AppTest for every dashboard page: a generated store (vanilla + LLDS twin, a one-step run, an imported run
without token data), an empty store, no store, and a path that is not a store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.synth_store import SynthConfig, write_pair, write_run  # noqa: E402

APP = str(ROOT / "app.py")
PAGES = ["pages/live_health.py", "pages/compare_runs.py", "pages/token_inspector.py", "pages/post_mortem.py"]
MIN_CHARTS = {"pages/live_health.py": 1, "pages/compare_runs.py": 1, "pages/token_inspector.py": 2,
              "pages/post_mortem.py": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ui_store") / "store"
    vanilla, llds = write_pair(path, steps=90, token_every=6, flush_every=30)
    one = write_run(path, SynthConfig(name="one-step", mode="vanilla", steps=1, seed=5, token_every=1))
    imported = write_run(path, SynthConfig(name="wandb-import", mode="unknown", source="wandb", steps=40,
                                           samples=False, token_every=0, seed=6))
    return {"path": str(path), "vanilla": vanilla, "llds": llds, "one": one, "imported": imported}


def _app(store_path: str, run_id: str | None = None, page: str | None = None, **qp) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=90)
    at.session_state["store_path"] = store_path
    if run_id is not None:
        at.session_state["run_id"] = run_id
    for k, v in qp.items():
        at.query_params[k] = v
    at.run()
    if page is not None:
        at.switch_page(page).run()
    return at


def _charts(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


def _text(at: AppTest) -> str:
    parts = []
    for kind in ("markdown", "caption", "info", "warning", "error", "success"):
        parts += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(parts)


def _array(v) -> list:
    """A Plotly JSON array: a list, or a typed array ({"dtype", "bdata": base64})."""
    if isinstance(v, dict) and "bdata" in v:
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v)


def _assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_on_generated_store(store, page):
    at = _app(store["path"], store["vanilla"], page)
    _assert_clean(at)
    assert _charts(at) >= MIN_CHARTS[page]
    # the sidebar is on every page: store location + run picker with mode, source, status and phase
    assert at.sidebar.text_input(key="store_path").value == store["path"]
    picker = at.sidebar.selectbox(key="run_id")
    assert picker.value == store["vanilla"]
    # short labels (the sidebar is narrow): the mode only when the name does not say it, the source only when
    # it is not local, the status only when live or crashed; then the phase
    assert any(o.startswith("synth-vanilla · ") for o in picker.options)
    assert any(o.startswith("wandb-import · wandb") for o in picker.options)
    assert all(len(o) <= 40 for o in picker.options), picker.options


def test_live_health_controls_and_status(store):
    at = _app(store["path"], store["vanilla"])
    _assert_clean(at)
    assert at.slider(key="live_smoothing").value == pytest.approx(0.6)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Status"] == "finished" and metrics["Steps logged"] == "90" and metrics["Last step"] == "89"
    at.slider(key="live_smoothing").set_value(0.0).run()
    _assert_clean(at)
    # the vanilla synthetic run collapses: phase badge in the sidebar says so
    assert "collapse" in " ".join(str(m.value) for m in at.sidebar.markdown)


def test_compare_toggle_switches_the_shown_run(store):
    at = _app(store["path"], store["vanilla"], "pages/compare_runs.py")
    _assert_clean(at)
    assert at.selectbox(key="cmp_twin").value == store["llds"]  # paired by config
    assert "same config" in at.selectbox(key="cmp_twin").format_func(store["llds"])
    shown = lambda: next(c.value for c in at.caption if str(c.value).startswith("Showing:"))  # noqa: E731
    assert "synth-vanilla" in shown() and "synth-llds" in shown()
    at.segmented_control(key="cmp_show").set_value("twin").run()
    _assert_clean(at)
    assert "synth-llds" in shown() and "synth-vanilla" not in shown()
    at.segmented_control(key="cmp_show").set_value("base").run()
    assert "synth-vanilla" in shown() and "synth-llds" not in shown()
    # differences table at chosen steps; bad input gets a message, not a crash
    at.text_input(key="cmp_steps").set_value("10, 60, abc").run()
    _assert_clean(at)
    assert any("abc" in str(w.value) for w in at.warning)
    table = at.dataframe[0].value
    assert sorted(set(table["step"])) == [10, 60]


def test_token_inspector_controls_and_query_params(store):
    at = _app(store["path"], store["vanilla"], "pages/token_inspector.py")
    _assert_clean(at)
    # it opens where displacement shows best, on a sample whose tokens were stored (not an empty box)
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import queries as q

    with open_store_reader(store["path"]) as r:
        ov = q.run_overview(r, store["vanilla"])
        best = q.best_token_pick(r, store["vanilla"], phase_ii_step=ov.phase_ii_step)
    assert ov.phase_ii_step is not None and best.step >= ov.phase_ii_step and best.step % 6 == 0
    assert at.select_slider(key="tok_step").value == best.step
    assert at.selectbox(key="tok_pick").value == (best.sample_idx, best.rank)
    assert "No tokens were stored" not in _text(at)
    assert any("lld-tokens" in h.proto.body for h in at.get("html"))
    for color in ("prob_old", "prob_new"):  # Δ is the default
        at.radio(key="tok_color").set_value(color).run()
        _assert_clean(at)
    at.radio(key="tok_filter").set_value("correct").run()
    _assert_clean(at)
    # a post-mortem link: ?run=..&step=..&sample=..&rank=..
    link = _app(store["path"], None, "pages/token_inspector.py", run=store["vanilla"], step="42", sample="3", rank="0")
    _assert_clean(link)
    assert link.select_slider(key="tok_step").value == 42
    assert link.selectbox(key="tok_pick").value == (3, 0)


def test_post_mortem_lists_leads_and_links(store):
    at = _app(store["path"], store["vanilla"], "pages/post_mortem.py")
    _assert_clean(at)
    text = _text(at)
    assert "First to move:" in text and "Reference: **reward collapse** at step" in text
    assert len(at.dataframe) >= 1 and len(at.get("page_link")) >= 1
    assert len(at.get("download_button")) == 4


@pytest.mark.parametrize("page", PAGES)
def test_one_step_run(store, page):
    at = _app(store["path"], store["one"], page)
    _assert_clean(at)


@pytest.mark.parametrize("page", PAGES)
def test_imported_run_without_token_data(store, page):
    at = _app(store["path"], store["imported"], page)
    _assert_clean(at)
    if page == "pages/token_inspector.py":
        assert "no token data" in _text(at) and "W&B" in _text(at)
    if page == "pages/live_health.py":
        assert _charts(at) == 2  # the signals and the collapse forecast (the scalars model: no displacement logged)


@pytest.fixture
def empty_store(tmp_path):
    from lld_monitor.store.storedir import open_store_for_write

    p = tmp_path / "empty"
    open_store_for_write(p)
    return str(p)


@pytest.mark.parametrize("page", PAGES)
def test_empty_store(empty_store, page):
    at = _app(empty_store, None, page)
    _assert_clean(at)
    assert "has no runs yet" in _text(at)


@pytest.mark.parametrize("page", PAGES)
def test_no_store(tmp_path, page):
    at = _app(str(tmp_path / "missing"), None, page)
    _assert_clean(at)
    assert "No store at" in _text(at)


def test_not_a_store(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "store.json").write_text("{not json")
    plain = tmp_path / "file.txt"
    plain.write_text("hello")
    for p in (foreign, plain):
        for page in PAGES:
            at = _app(str(p), None, page)
            _assert_clean(at)
            assert "not an lld-monitor store" in _text(at), _text(at)


def test_switching_store_in_the_sidebar(store, empty_store):
    at = _app(store["path"], store["vanilla"])
    assert _charts(at) == 2  # the signals and the collapse forecast
    at.sidebar.text_input(key="store_path").set_value(empty_store).run()
    _assert_clean(at)
    assert _charts(at) == 0 and "has no runs yet" in _text(at)


SAMPLE_RUNS = ROOT / "sample_runs"


@pytest.mark.skipif(not (SAMPLE_RUNS / "store.json").exists(), reason="sample_runs/ has no store yet (made by the backend)")
@pytest.mark.parametrize("page", PAGES)
def test_every_page_on_the_bundled_sample_runs(page):
    from lld_monitor.store import open_store_reader

    with open_store_reader(SAMPLE_RUNS) as r:
        runs = r.runs()
    assert len(runs), "sample_runs/ is a store without runs"
    for run_id in runs["run_id"]:
        at = _app(str(SAMPLE_RUNS), run_id, page)
        _assert_clean(at)
        if page in ("pages/live_health.py", "pages/post_mortem.py"):
            assert _charts(at) >= 1


def test_newer_schema_store_says_upgrade(tmp_path):
    import json

    p = tmp_path / "newer"
    p.mkdir()
    (p / "store.json").write_text(json.dumps({"format": "lld-monitor-store", "schema_version": 99}))
    at = _app(str(p), None)
    _assert_clean(at)
    assert "newer lld-monitor" in _text(at), _text(at)


@pytest.mark.skipif(not (SAMPLE_RUNS / "store.json").exists(), reason="sample_runs/ has no store yet (made by the backend)")
def test_live_health_forecast_panel_shows_the_detector_s_forecast(tmp_path):
    """issue 37: the forecast panel on the bundled vanilla run draws exactly the detector's p_collapse, with the
    status figures (collapse step, first p >= 0.5 and its lead, the model) that `detect_run` gives."""
    import json
    import shutil

    from lld_monitor.detect import detect_run
    from lld_monitor.store import open_store_reader

    store = tmp_path / "s"
    shutil.copytree(SAMPLE_RUNS, store)  # the page may cache a detector replay beside the run
    with open_store_reader(store) as r:
        runs = r.runs()
        rid = str(runs[runs["mode"] == "vanilla"]["run_id"].iloc[0])
        res = detect_run(r.signals(rid))
    assert res.forecast_model == "all" and res.collapse_step is not None
    at = _app(str(store), rid, "pages/live_health.py")
    _assert_clean(at)
    metrics = {m.label: (m.value, m.delta) for m in at.metric}
    assert metrics["Reward collapsed at step"][0] == str(res.collapse_step)
    assert metrics["Forecast model"][0] == "all"
    first = next((s for s, p in res.forecast if p >= 0.5), None)
    label = "First p ≥ 0.5"
    if first is None:
        assert metrics[label][0] == "never"
    else:
        assert metrics[label] == (f"step {first}", f"{res.collapse_step - first} steps before the collapse")
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    fig = next(f for f in figs if "Collapse forecast" in f["layout"].get("title", {}).get("text", ""))
    p_trace = fig["data"][0]
    assert list(_array(p_trace["x"])) == [float(s) for s, _ in res.forecast]
    assert list(_array(p_trace["y"])) == pytest.approx([p for _, p in res.forecast], abs=1e-12)
    assert any(sh.get("y0") == 0.5 for sh in fig["layout"]["shapes"])  # the alert line
