"""Issue 30: long runs are drawn at the chart's resolution (M4: first / min / max / last per pixel column) and a
step range shows every point; spikes, the collapse and the phases stay where they are."""

from __future__ import annotations

import numpy as np
import pandas as pd

from lld_monitor.ui import figures
from lld_monitor.ui.downsample import MAX_POINTS, m4_indices


def _long_run(n: int = 20_000) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    s = np.arange(n)
    grad = 0.5 + rng.normal(0, 0.01, n)
    grad[int(n * 0.61725)] = 9.0  # a one-step spike (step 12,345 of 20,000)
    reward = np.clip(0.5 - 0.5 * np.clip((s - 0.8 * n) / (0.1 * n), 0, 1), 0, 1) + rng.normal(0, 0.01, n)
    return pd.DataFrame({"step": s, "reward_mean": reward, "grad_norm": grad,
                         "ll_correct_mean": -0.3 + rng.normal(0, 0.01, n), "entropy": 1 + rng.normal(0, 0.01, n)})


def test_m4_keeps_every_extreme_and_wide_gaps_only():
    n = 50_000
    x = np.arange(n, dtype=float)
    y = np.sin(x / 500) + np.random.default_rng(1).normal(0, 0.1, n)
    y[31_337] = 40.0
    y[20_000:21_000] = np.nan  # a gap wider than a pixel column: stays a gap
    y[7] = np.nan  # one missing step: bridged
    idx = m4_indices(x, y)
    assert len(idx) <= MAX_POINTS + 2 and np.all(np.diff(idx) > 0)
    assert 31_337 in idx and np.nanmin(y[idx]) == np.nanmin(y) and np.nanmax(y[idx]) == 40.0
    assert np.isnan(y[idx]).sum() == 1 and 20_000 <= idx[np.isnan(y[idx])][0] < 21_000
    # every pixel column's min and max survive
    k = -(-n // (MAX_POINTS // 4))
    for col in (0, 17, 311, n // k - 1):
        seg = y[col * k:(col + 1) * k]
        kept = y[idx[(idx >= col * k) & (idx < (col + 1) * k)]]
        if np.isfinite(seg).any():
            assert np.nanmax(kept) == np.nanmax(seg) and np.nanmin(kept) == np.nanmin(seg)
    short = np.arange(100, dtype=float)
    assert np.array_equal(m4_indices(short, short), np.arange(100))


def test_long_run_figure_is_downsampled_with_the_spike_and_zooms_to_every_point():
    df = _long_run()
    assert figures.downsampled(df) and not figures.downsampled(df, (1000, 2000))
    fig = figures.live_health_figure(df, None, None, smoothing=0.6)
    lines = [t for t in fig.data if t.x is not None and len(t.x) > 50]
    assert lines and all(len(t.x) <= MAX_POINTS + 2 for t in lines)
    raw_grad = next(t for t in fig.data if t.name == "grad norm (raw)")
    assert max(raw_grad.y) == 9.0 and 12_345 in set(raw_grad.x)
    assert min(next(t for t in fig.data if t.name == "reward (mean) (raw)").y) < 0.05  # the collapse is drawn
    assert fig.layout.xaxis.autorangeoptions.minallowed == -0.5  # no padding below step 0
    zoom = figures.live_health_figure(df, None, None, smoothing=0.6, step_range=(12_000, 12_999))
    raw_zoom = next(t for t in zoom.data if t.name == "grad norm (raw)")
    assert list(raw_zoom.x) == list(range(12_000, 13_000))  # every step of the window
    def ema_trace(f):
        return next(t for t in f.data if t.customdata is not None and "grad norm" in str(t.hovertemplate))

    smooth_zoom, full_ema = ema_trace(zoom), ema_trace(fig)
    at = list(full_ema.x).index(12_345)  # the smoothing is the whole run's, not restarted at the window
    assert smooth_zoom.y[345] == full_ema.y[at]


def test_many_bands_are_one_path_per_phase_and_panel():
    df = _long_run(5_000)
    starts = np.arange(0, 5_000, 50)
    phases = np.where(np.arange(len(starts)) % 2, "decay", "acceleration")
    bands = pd.DataFrame({"phase": phases, "start": starts, "end": np.r_[starts[1:], 4_999]})
    fig = figures.live_health_figure(df, bands, None)
    paths = [s for s in fig.layout.shapes if s.type == "path"]
    n_panels = len(figures.sig.LIVE_PANELS)
    assert len(paths) == 2 * n_panels and not [s for s in fig.layout.shapes if s.type == "rect"]
    assert sum(p.path.count("M") for p in paths) == len(bands) * n_panels
    zoom = figures.live_health_figure(df, bands, None, step_range=(1_000, 1_200))
    assert figures.clip_bands(bands, (1_000, 1_200))["start"].tolist() == [1_000, 1_050, 1_100, 1_150, 1_200]
    assert [s for s in zoom.layout.shapes if s.type == "rect"]  # 5 bands: rectangles again


def test_live_page_on_a_long_run_offers_a_step_range(tmp_path):
    """The page a person opens: a 5,000-step run gets the "Steps shown" slider; a narrow range draws every step."""
    import sys
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from bench.synth_store import SynthConfig, write_run

    rid = write_run(tmp_path, SynthConfig(name="long", steps=5_000, samples=False, token_every=0, flush_every=1000,
                                          checkpoint_every=1000))
    at = AppTest.from_file(str(root / "app.py"), default_timeout=90)
    at.session_state["store_path"] = str(tmp_path)
    at.session_state["run_id"] = rid
    at.run()
    at.switch_page("pages/live_health.py").run()
    assert not at.exception, [e.value for e in at.exception]
    slider = at.slider(key=f"live_range_{rid}")
    assert slider.value == (0, 4_999)
    assert any("drawn at the chart's resolution" in str(c.value) for c in at.caption)
    slider.set_value((1_000, 2_000)).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Every one of the 1,001 steps" in str(c.value) for c in at.caption)
    assert len(at.get("plotly_chart")) >= 1


def test_caption_of_a_run_whose_phases_flip_names_the_start_and_the_end():
    starts = list(range(0, 1000, 10))
    bands = pd.DataFrame({"phase": ["decay", "acceleration"] * 50, "start": starts, "end": starts[1:] + [999]})
    cap = figures.live_legend_caption(bands)
    assert cap.count("→") <= figures.CAPTION_PHASES_MAX + 1 and "90 more changes" in cap
    assert "from step 0 " in cap and "from step 990." in cap
