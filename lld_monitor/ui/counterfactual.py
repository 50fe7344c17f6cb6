"""'LLDS would have applied': the counterfactual's data, its subprocess and its figures (no Streamlit, no torch).

The counterfactual needs torch (`lld.llds_loss`), so the dashboard never computes it. It reads what
`lld-monitor whatif` cached beside the run (`lld_monitor/counterfactual/cache.py`); when that is missing, or behind
the run's token rows (a live run logged more), it starts `lld-monitor whatif` as a subprocess
(`WhatIfJob`) and reads the result once the command has written it. The command computes only the steps
the cache lacks, so a live run costs one step's worth per refresh.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lld_monitor.counterfactual import cache as wc
from lld_monitor.ui import figures
from lld_monitor.ui.phase_bands import mode_color, mode_label

log = logging.getLogger(__name__)

READY, STALE, MISSING, NO_TOKENS = "ready", "stale", "missing", "no_tokens"
REPO_ROOT = Path(__file__).resolve().parents[2]
LOGGED_COLOR = "#444444"  # the LLDS term a run applied (its logged llds_loss), beside a counterfactual


@dataclass
class WhatIfView:
    """What the dashboard knows of one run's counterfactual right now."""

    run_id: str
    settings: dict[str, Any]
    state: str  # READY | STALE (cached, but the run has token rows it lacks) | MISSING | NO_TOKENS
    steps: pd.DataFrame = field(default_factory=wc.empty_steps)  # cache.STEPS_SCHEMA + penalty
    tokens: pd.DataFrame = field(default_factory=wc.empty_tokens)
    n_token_steps: int = 0
    n_behind: int = 0  # token-logged steps not (or not freshly) in the cache
    message: str = ""

    @property
    def has_data(self) -> bool:
        return len(self.steps) > 0

    @property
    def needs_run(self) -> bool:
        """True when `lld-monitor whatif` would add something."""
        return self.state in (MISSING, STALE)


def whatif_view(reader, store: str, run: dict[str, Any], cfg: dict[str, Any]) -> WhatIfView:
    """The cached counterfactual of `run` (a runs() row) under `cfg`, and whether it covers the run's tokens."""
    run_id = str(run["run_id"])
    counts = wc.token_row_counts(reader, run_id)
    if not counts:
        return WhatIfView(run_id, cfg, NO_TOKENS, message=wc.no_tokens_message(run.get("source")))
    cached = wc.read_cache(store, run_id, cfg)
    if cached is None:
        return WhatIfView(run_id, cfg, MISSING, n_token_steps=len(counts), n_behind=len(counts),
                          message=f"Not computed yet for this run ({len(counts)} token-logged steps).")
    behind = wc.steps_to_compute(cached.steps, counts)
    keep = cached.steps["step"].astype(int).isin(set(counts))
    steps = wc.with_penalty(cached.steps[keep].reset_index(drop=True), cfg["lam"])
    state = STALE if behind or not cached.fresh_for(counts) else READY
    msg = "" if state == READY else f"{len(behind)} token-logged step(s) not computed yet."
    return WhatIfView(run_id, cfg, state, steps, cached.tokens, len(counts), len(behind), msg)


def token_outline(view: WhatIfView | None, step: int, sample_idx: int, rank: int = 0) -> tuple[set[int], set[int]]:
    """(positions LLDS would have penalised, positions whose gate is open) of one logged sample."""
    if view is None or view.tokens is None or view.tokens.empty:
        return set(), set()
    t = view.tokens
    m = (t["step"] == int(step)) & (t["sample_idx"] == int(sample_idx)) & (t["rank"] == int(rank))
    sub = t[m]
    return set(sub.loc[sub["penalized"], "position"].astype(int)), set(sub["position"].astype(int))


def settings_text(cfg: dict[str, Any]) -> str:
    """λ, gate and norm in one phrase (captions)."""
    gate = {"action": "A-gate", "response": "R-gate", "token": "no gate"}.get(cfg["gate"], cfg["gate"])
    return f"λ {cfg['lam']:g}, {gate}, norm {cfg['norm']}"


def computed_for(step_row: pd.Series | dict) -> bool:
    return int(step_row.get("n_samples", 0) or 0) > 0


# ------------------------------------------------------------------ the subprocess


def whatif_command(store: str, run_id: str, cfg: dict[str, Any]) -> list[str]:
    """`lld-monitor whatif` for (store, run, settings), as the dashboard runs it (λ does not matter for the cache)."""
    return [sys.executable, "-m", "lld_monitor.cli", "whatif", "--store", str(store), "--run", str(run_id),
            "--lam", repr(float(cfg["lam"])), "--gate", str(cfg["gate"]), "--norm", str(cfg["norm"]), "--json",
            "--no-progress"]


class WhatIfJob:
    """One `lld-monitor whatif` subprocess; stdout is discarded (the result lands in the cache), stderr kept."""

    def __init__(self, store: str, run_id: str, cfg: dict[str, Any]):
        self.command = whatif_command(store, run_id, cfg)
        fd, self.log_path = tempfile.mkstemp(prefix="lld-whatif-", suffix=".log")
        self.started = time.monotonic()
        with os.fdopen(fd, "wb") as err:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=str(REPO_ROOT))
        log.info("started %s (pid %d)", " ".join(self.command), self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def error(self) -> str | None:
        """None while running or after success; else the command's last stderr lines."""
        rc = self.proc.poll()
        if rc is None or rc == 0:
            return None
        try:
            text = Path(self.log_path).read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            text = ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-6:]) or f"`lld-monitor whatif` exited with status {rc}"

    def close(self) -> None:
        if self.running:
            self.proc.terminate()
        Path(self.log_path).unlink(missing_ok=True)


# ------------------------------------------------------------------ figures


TREND_STEPS = 10  # the trend line: a running median over about this many steps (raw points stay faint behind)


def _positive(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values) & (values > 0), values, np.nan)


def trend(steps: np.ndarray, values: np.ndarray, span: int = TREND_STEPS) -> np.ndarray:
    """Centred running median over about `span` steps (a window of points that covers them, at least 1) of the
    positive values: a log-scale series whose spikes would hide its level (a mean would follow the spikes)."""
    if len(steps) < 2:
        return _positive(values)
    gap = float(np.median(np.diff(steps))) or 1.0
    win = max(1, int(round(span / gap)))
    return pd.Series(_positive(values)).rolling(win, center=True, min_periods=1).median().to_numpy()


def _line_pair(fig: go.Figure, x: np.ndarray, y: np.ndarray, name: str, color: str, *, dash: str | None = None,
               width: float = 2.0, hover: str, customdata=None, row: int | None = None, rank: int = 1) -> None:
    """The raw points faint and the trend bold (the dashboard's convention for noisy series)."""
    kw = {"row": row, "col": 1} if row is not None else {}
    fig.add_trace(go.Scatter(x=x, y=_positive(y), mode="lines+markers", name=f"{name} (each step)", showlegend=False,
                             line=dict(color=color, width=1, dash=dash), marker=dict(size=4), opacity=0.35,
                             legendgroup=name, customdata=customdata, hovertemplate=hover), **kw)
    fig.add_trace(go.Scatter(x=x, y=trend(x, y), mode="lines", name=name, legendgroup=name, legendrank=rank,
                             line=dict(color=color, width=width, dash=dash), hoverinfo="skip"), **kw)


def whatif_figure(view: WhatIfView, bands: pd.DataFrame | None = None, *, logged: pd.DataFrame | None = None,
                  height: int = 450) -> go.Figure:
    """Two panels on one step axis, phase bands behind: the penalty λ·L_LLDS LLDS would have added at the end
    of each token-logged step (log scale), and the share of preserved responses whose gate it would have opened.
    `logged` (step, llds_loss): the LLDS term the run itself applied, when it is an LLDS run."""
    s = view.steps
    if s is None or s.empty:
        return figures.empty_figure("No counterfactual yet.", height=220)
    steps = s["step"].to_numpy(dtype="float64")
    pen = s["penalty"].to_numpy(dtype="float64")
    n_pre = s["n_preserved"].to_numpy(dtype="float64")
    share = np.divide(s["n_gated_responses"].to_numpy(dtype="float64"), n_pre, out=np.full(len(s), np.nan),
                      where=n_pre > 0)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.65, 0.35],
                        subplot_titles=[f"penalty LLDS would have added, λ·L_LLDS ({settings_text(view.settings)}; "
                                        "log scale)",
                                        "preserved responses (Â ≥ 0) LLDS would have gated"])
    fig.update_annotations(font_size=13)
    green = mode_color("llds")
    custom = np.stack([s["n_preserved"], s["n_gated_responses"], s["n_gated_actions"], s["n_penalized_tokens"],
                       s["n_samples"]], axis=1)
    _line_pair(fig, steps, pen, f"would have applied (median of {TREND_STEPS} steps)", green, customdata=custom,
               row=1, rank=1,
               hover="penalty %{y:.3g}<br>%{customdata[3]} tokens penalised, %{customdata[2]} actions and "
                     "%{customdata[1]} of %{customdata[0]} preserved responses gated (of %{customdata[4]} logged)"
                     "<extra>would have applied</extra>")
    zero = np.isfinite(pen) & (pen <= 0)
    if zero.any():  # LLDS would not have acted: nothing to draw on a log axis, so say it on the share panel
        fig.add_trace(go.Scatter(x=steps[zero], y=np.zeros(int(zero.sum())), mode="markers", name="nothing penalised",
                                 marker=dict(symbol="x-thin", size=7, color="#888", line=dict(width=1.5, color="#888")),
                                 hovertemplate="step %{x}: LLDS would not have acted<extra></extra>", legendrank=3),
                      row=2, col=1)
    if logged is not None and len(logged) and "llds_loss" in logged.columns:
        lv = logged["llds_loss"].to_numpy(dtype="float64")
        if np.nanmax(np.where(np.isfinite(lv), lv, 0.0), initial=0.0) > 0:
            _line_pair(fig, logged["step"].to_numpy(dtype="float64"), lv,
                       "applied (logged llds_loss: mean over the step's updates, all groups)", LOGGED_COLOR,
                       width=1.5, row=1, rank=2, hover="logged llds_loss %{y:.3g}<extra>applied</extra>")
    fig.add_trace(go.Bar(x=steps, y=share, name="share of preserved responses gated", marker_color=green, opacity=0.55,
                         hovertemplate="%{y:.0%} of the preserved responses gated<extra></extra>", showlegend=False),
                  row=2, col=1)
    fig.update_yaxes(type="log", exponentformat="power", title_text="λ·L_LLDS", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", title_text="gated", row=2, col=1)
    figures.add_phase_bands(fig, bands, rows=2)
    figures.add_phase_legend(fig, bands)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_xaxes(showspikes=True, spikemode="across", spikethickness=1, spikecolor="#999", spikedash="dot")
    fig.update_layout(height=height, hovermode="x unified", bargap=0.1, margin=dict(l=70, r=30, t=120, b=40),
                      legend=dict(orientation="h", y=1.1, x=0, yanchor="bottom", font=dict(size=12),
                                  traceorder="normal", tracegroupgap=0, itemsizing="constant"))
    return fig


def whatif_compare_figure(counterfactuals: list[tuple[str, str | None, WhatIfView]],
                          applied: list[tuple[str, str | None, pd.DataFrame]], height: int = 380) -> go.Figure:
    """On one step axis (log scale): each run's counterfactual penalty (what LLDS would have applied at the end
    of the step, on its logged groups; dotted when the run is itself an LLDS run) and each LLDS run's logged
    llds_loss (what it applied, as the mean over the step's updates on all groups), coloured by mode."""
    fig = go.Figure()
    for label, mode, view in counterfactuals:
        if view is None or view.steps.empty:
            continue
        s = view.steps
        _line_pair(fig, s["step"].to_numpy(dtype="float64"), s["penalty"].to_numpy(dtype="float64"),
                   f"{label}: would have applied (end of step, logged groups)", mode_color(mode),
                   dash="dot" if mode in ("llds", "llds_ma") else None,
                   hover="%{y:.3g}<extra>" + f"{label}: would have applied</extra>")
    for label, mode, sig in applied:
        if sig is None or not len(sig) or "llds_loss" not in sig.columns:
            continue
        v = sig["llds_loss"].to_numpy(dtype="float64")
        if not (np.isfinite(v) & (v > 0)).any():
            continue
        _line_pair(fig, sig["step"].to_numpy(dtype="float64"), v, f"{label}: applied (logged llds_loss, mean over updates)",
                   mode_color(mode), width=2.4, hover="%{y:.3g}<extra>" + f"{label}: applied</extra>")
    if not fig.data:
        return figures.empty_figure("No counterfactual and no logged LLDS term to show.", height=220)
    fig.update_yaxes(type="log", exponentformat="power", title_text="λ·L_LLDS")
    fig.update_xaxes(title_text="step", showspikes=True, spikemode="across", spikethickness=1, spikecolor="#999",
                     spikedash="dot")
    fig.update_layout(height=height, hovermode="x unified", margin=dict(l=70, r=30, t=110, b=40),
                      title=dict(text=f"LLDS term: what it would have applied vs what it applied (lines: median of "
                                      f"{TREND_STEPS} steps; faint: each step)", font=dict(size=13), x=0.01, y=0.98,
                                 yanchor="top"),
                      legend=dict(orientation="h", y=1.03, x=0, yanchor="bottom", font=dict(size=12)))
    return fig


def run_title(run: dict[str, Any] | pd.Series) -> str:
    return f"{run.get('name')} ({mode_label(run.get('mode'))})"
