"""The 'LLDS would have applied' panels (issue 31) in AppTest, on a copy of the bundled runs:
Live health starts `lld-monitor whatif` when the panel opens and then draws its numbers; the token
inspector outlines the tokens LLDS would have penalised; Compare runs shows the vanilla run's counterfactual
beside the LLDS twin's logged llds_loss; a run without tokens says what to log and starts nothing."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
from streamlit.testing.v1 import AppTest

from lld_monitor.cli import main
from lld_monitor.counterfactual import cache as wc
from lld_monitor.store import RunWriter, open_store_reader
from lld_monitor.ui import counterfactual_panel

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    src = ROOT / "sample_runs"
    if not (src / "store.json").exists():
        pytest.skip("no sample_runs/")
    dst = tmp_path_factory.mktemp("whatif_pages") / "store"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(wc.DERIVED_DIR))
    with open_store_reader(dst) as r:
        runs = r.runs()
    ids = {m: str(runs[runs["mode"] == m].iloc[0]["run_id"]) for m in ("vanilla", "llds")}
    w = RunWriter.create(dst, "imported", "vanilla", source="wandb")
    w.append("steps", {"step": list(range(5)), "reward_mean": [0.5] * 5})
    w.finish()
    ids["imported"] = w.run_id
    return dst, ids


def _app(store_path: Path, run_id: str, page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state["store_path"] = str(store_path)
    at.session_state["run_id"] = run_id
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _figure(at: AppTest, key_title: str) -> go.Figure:
    for c in at.get("plotly_chart"):
        if key_title in json.dumps(json.loads(c.proto.spec).get("layout", {})):
            return pio.from_json(c.proto.spec)
    raise AssertionError(f"no chart with {key_title!r}")


def _array(v) -> np.ndarray:
    """A trace's y as the browser gets it: a list, or Plotly's typed array {"dtype", "bdata"} (base64)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).astype("float64")
    return np.asarray([np.nan if x is None else x for x in (v if v is not None else [])], dtype="float64")


def _positive_values(fig: go.Figure, name_part: str) -> np.ndarray:
    ys = [_array(tr.to_plotly_json().get("y")) for tr in fig.data if name_part in str(tr.name or "")]
    assert ys, f"no trace named like {name_part!r}"
    y = np.concatenate(ys)
    return y[np.isfinite(y) & (y > 0)]


def _wait_for_job(store_path: Path, run_id: str, timeout: float = 180.0) -> None:
    key = counterfactual_panel._job_key(str(store_path), run_id, wc.settings())
    entry = counterfactual_panel._jobs().get(key)
    assert entry is not None, "opening the panel did not start `lld-monitor whatif`"
    t0 = time.monotonic()
    while entry["job"].running and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
    assert not entry["job"].running and entry["job"].error() is None, entry["job"].error()


def test_live_health_panel_computes_then_draws(store):
    path, ids = store
    at = _app(path, ids["vanilla"])
    n_charts = len(at.get("plotly_chart"))
    at.toggle(key="live_whatif").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("lld-monitor whatif" in str(c.value) for c in at.caption)  # computing, said so
    _wait_for_job(path, ids["vanilla"])
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == n_charts + 1
    fig = _figure(at, "penalty LLDS would have added")
    pen = _positive_values(fig, "would have applied (median of 10 steps) (each step)")
    with open_store_reader(path) as r:
        n_token_steps = len(r.token_steps(ids["vanilla"]))
    assert 0.5 * n_token_steps < len(pen) <= n_token_steps  # data, not just a panel
    assert any(sh.type == "rect" for sh in fig.layout.shapes)  # phase bands behind
    assert wc.read_cache(path, ids["vanilla"], wc.settings()) is not None  # written by the subprocess


def test_token_inspector_outlines_penalised_tokens(store):
    path, ids = store
    assert main(["whatif", "--store", str(path), "--run", ids["vanilla"], "--no-progress", "--json"]) == 0
    at = _app(path, ids["vanilla"], "pages/token_inspector.py")
    at.toggle(key="tok_whatif").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    step = at.select_slider(key="tok_step").value
    sample_idx, rank = at.selectbox(key="tok_pick").value
    cached = wc.read_cache(path, ids["vanilla"], wc.settings())
    t = cached.tokens
    want = int(((t["step"] == step) & (t["sample_idx"] == sample_idx) & (t["rank"] == rank) & t["penalized"]).sum())
    body = next(h.proto.body for h in at.get("html") if "lld-tokens" in h.proto.body)
    assert body.count("lld-penalized") == want
    assert any(f"would have penalised {want} token(s)" in str(c.value) for c in at.caption)
    # the inspector opens on the preserved sample whose likelihood fell most: LLDS had something to say there
    assert want > 0


def test_compare_page_counterfactual_beside_logged(store):
    path, ids = store
    for rid in (ids["vanilla"], ids["llds"]):
        assert main(["whatif", "--store", str(path), "--run", rid, "--no-progress", "--json"]) == 0
    at = _app(path, ids["vanilla"], "pages/compare_runs.py")
    at.toggle(key="cmp_whatif").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    fig = _figure(at, "what it would have applied vs what it applied")
    assert len(_positive_values(fig, "(vanilla): would have applied")) > 0
    assert len(_positive_values(fig, "(LLDS): applied")) > 0


def test_run_without_tokens_explains_and_starts_nothing(store):
    path, ids = store
    at = _app(path, ids["imported"])
    at.toggle(key="live_whatif").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("no token rows" in str(i.value) and "logp_new" in str(i.value) for i in at.info)
    assert counterfactual_panel._jobs().get(counterfactual_panel._job_key(str(path), ids["imported"], wc.settings())) is None
