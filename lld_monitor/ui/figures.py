"""Plotly figure builders. Pure: DataFrames in, `go.Figure` out (no Streamlit, no store access)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lld_monitor.detect.phases import ACCELERATION, COLLAPSE
from lld_monitor.ui import series as sig
from lld_monitor.ui.downsample import MAX_POINTS, m4_indices, window
from lld_monitor.ui.phase_bands import (
    PHASE_COLORS,
    PHASE_SOLID,
    SEVERITY_COLORS,
    SEVERITY_MEANING,
    mode_color,
    mode_label,
    phase_short,
    phase_title,
)

ROLE_COLORS = {"action": "#1f77b4", "answer": "#2ca02c", "tool": "#9e9e9e"}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
SEVERITY_ORDER = ("critical", "warning", "info")
RAW_OPACITY = 0.25  # the raw trace behind a smoothed line (W&B / TensorBoard convention)
LEGEND_ENTRY_PX = 235  # fixed legend entry width: entries line up in columns
LIVE_SIDE_MARGINS = dict(l=60, r=50)
"""Left and right margins (px, not grown by Plotly's automargin) of Live health's signals and forecast charts, so
that a step sits at the same x in both."""


def run_styles(modes: list[str | None]) -> list[tuple[str, str]]:
    """(colour, dash) per run: the colour says the mode (the same on every page), a second run of the same
    mode keeps the colour and gets the next dash."""
    seen: dict[str, int] = {}
    out = []
    for m in modes:
        k = str(m)
        i = seen.get(k, 0)
        seen[k] = i + 1
        out.append((mode_color(m), DASHES[i % len(DASHES)]))
    return out


def _mode(n: int) -> str:
    return "lines+markers" if n <= 30 else "lines"


def empty_figure(message: str, height: int = 260) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=height, margin=dict(l=20, r=20, t=30, b=20))
    return fig


def _axis_refs(fig: go.Figure, rows: int) -> list[tuple[str, str]]:
    """(xref, yref) of column 1 of each row; a plain figure (no subplots) has ("x", "y")."""
    if getattr(fig, "_grid_ref", None) is None:
        return [("x", "y")]
    refs = []
    for r in range(1, rows + 1):
        sp = fig.get_subplot(r, 1)
        refs.append((sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")))
    return refs


BAND_RECTS_MAX = 40
"""Up to this many phase bands, one rectangle per band and panel; above it (long runs whose phases flip often),
one path per phase and panel holding all its bands: the same shading, far fewer SVG shapes to draw."""


def add_phase_bands(fig: go.Figure, bands: pd.DataFrame | None, *, rows: int = 1, label: bool = True) -> None:
    """Shade every phase band across all subplots (shared step axis), labelled once in the top panel.

    Shapes are built as plain dicts and set in one layout update: `add_vrect` per band and row re-validates
    the whole layout each time (seconds for a few dozen bands)."""
    if bands is None or bands.empty:
        return
    refs = _axis_refs(fig, rows)
    shapes, notes = list(fig.layout.shapes or ()), list(fig.layout.annotations or ())
    n = len(bands)
    span = max(1.0, float(bands["end"].max()) - float(bands["start"].min()))
    paths: dict[str, list[str]] = {}
    for i, b in enumerate(bands.itertuples(index=False)):
        # a band runs from its first step up to the next band's first step (the last one to the last step)
        x0, x1 = float(b.start), float(b.end) + (0.5 if i == n - 1 else 0.0)
        if i == 0:
            x0 -= 0.5
        color = PHASE_COLORS.get(str(b.phase), "rgba(128,128,128,0.1)")
        if n > BAND_RECTS_MAX:
            paths.setdefault(color, []).append(f"M{x0:g},0H{x1:g}V1H{x0:g}Z")
        else:
            for xref, yref in refs:
                shapes.append(dict(type="rect", xref=xref, yref=f"{yref} domain", x0=x0, x1=x1, y0=0, y1=1,
                                   fillcolor=color, line=dict(width=0), layer="below"))
        if label and (x1 - x0) / span >= 0.06:  # a narrow band keeps its shade, not a label that overlaps
            xref, yref = refs[0]
            notes.append(dict(x=(x0 + x1) / 2, y=1.0, xref=xref, yref=f"{yref} domain", yanchor="top", showarrow=False,
                              text=f"<b>{phase_short(str(b.phase))}</b>", name="phase-band",
                              font=dict(size=11, color=PHASE_SOLID.get(str(b.phase), "#555"))))
    for color, parts in paths.items():
        for xref, yref in refs:
            shapes.append(dict(type="path", xref=xref, yref=f"{yref} domain", path="".join(parts), fillcolor=color,
                               line=dict(width=0), layer="below"))
    fig.update_layout(shapes=shapes, annotations=notes)


def clip_bands(bands: pd.DataFrame | None, step_range: tuple[float, float] | None) -> pd.DataFrame | None:
    """The bands that overlap `step_range`, cut to it (None: all of them)."""
    if bands is None or bands.empty or step_range is None:
        return bands
    lo, hi = step_range
    last = np.arange(len(bands)) == len(bands) - 1  # a band covers start <= step < end; the last one its end too
    out = bands[((bands["end"] > lo) | last) & (bands["end"] >= lo) & (bands["start"] <= hi)].copy()
    out["start"] = out["start"].clip(lower=lo)
    out["end"] = out["end"].clip(upper=hi)
    return out.reset_index(drop=True)


def _value_at(steps: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """values at the nearest stored step ≤ each `at` (alerts may fall between logged steps)."""
    if len(steps) == 0:
        return np.full(len(at), np.nan)
    idx = np.clip(np.searchsorted(steps, at, side="right") - 1, 0, len(steps) - 1)
    return values[idx]


def add_alert_markers(fig: go.Figure, alerts: pd.DataFrame | None, panels: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """A marker per alert on every panel (at the panel's first signal's value), hover = the alert message;
    one legend entry per severity that says what it means."""
    if alerts is None or len(alerts) == 0:
        return
    a = alerts.sort_values("step")
    for sev in SEVERITY_ORDER:
        sub = a[a["severity"].astype(str) == sev]
        if sub.empty:
            continue
        at = sub["step"].to_numpy(dtype="float64")
        text = [f"<b>{sev} alert</b> · step {int(st)}<br>{sig_}: {m}" for st, sig_, m in
                zip(sub["step"], sub["signal"], sub["message"].fillna(""))]
        for i, (row, steps, values) in enumerate(panels):
            fig.add_trace(
                go.Scatter(
                    x=at, y=_value_at(steps, values, at), mode="markers", name=f"{sev} alert: {SEVERITY_MEANING[sev]}",
                    legendgroup=f"alerts-{sev}", showlegend=(i == 0), legendrank=1200 + SEVERITY_ORDER.index(sev),
                    marker=dict(symbol="triangle-down", size=11 if sev != "info" else 8, color=SEVERITY_COLORS[sev],
                                line=dict(width=1, color="white")),
                    hovertext=text, hoverinfo="text",
                ),
                row=row, col=1,
            )


def _add_signal(fig, steps, values, name, color, smoothing, row, secondary=None, dash=None, group=None, show=True,
                legend_name=None, width=2.0, step_range=None, max_points=MAX_POINTS):
    """One signal: with smoothing, the EMA line plus the raw trace faint behind it (hover shows both).

    The EMA runs over the whole series; then only `step_range` is drawn, at most `max_points` points per line
    (M4: first, min, max and last point of each pixel column, so spikes stay; lld_monitor/ui/downsample.py)."""
    kw = {"secondary_y": secondary} if secondary is not None else {}
    n = int(np.isfinite(values).sum())
    legend = {"legendgroup": group or name, "showlegend": show}
    inside = window(steps, step_range)
    x, raw = steps[inside], values[inside]
    if smoothing > 0 and n > 1:
        smooth = sig.ema(values, smoothing)[inside]
        ir, ie = m4_indices(x, raw, max_points), m4_indices(x, smooth, max_points)
        fig.add_trace(
            go.Scatter(x=x[ir], y=raw[ir], mode="lines", name=f"{name} (raw)", legendgroup=group or name,
                       line=dict(color=color, width=1, dash=dash), opacity=RAW_OPACITY, showlegend=False,
                       hoverinfo="skip"),
            row=row, col=1, **kw,
        )
        fig.add_trace(
            go.Scatter(x=x[ie], y=smooth[ie], mode="lines", name=legend_name or name,
                       line=dict(color=color, width=width, dash=dash), customdata=raw[ie], **legend,
                       hovertemplate=f"{name}: %{{y:.4g}} (raw %{{customdata:.4g}})<extra></extra>"),
            row=row, col=1, **kw,
        )
    else:
        i = m4_indices(x, raw, max_points)
        fig.add_trace(
            go.Scatter(x=x[i], y=raw[i], mode=_mode(len(i)), name=legend_name or name,
                       line=dict(color=color, width=width, dash=dash), **legend,
                       hovertemplate=f"{name}: %{{y:.4g}}<extra></extra>"),
            row=row, col=1, **kw,
        )


def downsampled(signals: pd.DataFrame | None, step_range: tuple[float, float] | None = None,
                max_points: int = MAX_POINTS) -> bool:
    """True when the chart of `signals` over `step_range` draws fewer points than it has (M4 downsampling)."""
    if signals is None or signals.empty or "step" not in signals.columns:
        return False
    steps = pd.to_numeric(signals["step"], errors="coerce").to_numpy(dtype="float64")
    return int(window(steps, step_range).sum()) > max_points


def add_phase_legend(fig: go.Figure, bands: pd.DataFrame | None) -> None:
    """Legend entries (a square per phase present) that say what each band's shade means."""
    if bands is None or bands.empty:
        return
    for ph in dict.fromkeys(bands["phase"].astype(str)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"{phase_title(ph)}", hoverinfo="skip",
                                 legendgroup="phases", legendrank=1100,
                                 marker=dict(symbol="square", size=12, color=PHASE_SOLID.get(ph, "#999"), opacity=0.45)))


CAPTION_PHASES_MAX = 10
"""At most this many phase changes are spelled out under the live chart (the first and the last half)."""


def live_legend_caption(bands: pd.DataFrame | None, hidden_info: int = 0) -> str:
    """One line under the live chart: the phases the run went through, in order, and the hidden info alerts."""
    bits = []
    if bands is not None and len(bands):
        seq = []
        for b in bands.itertuples(index=False):
            t = f"{phase_title(str(b.phase))} from step {int(b.start)}"
            if not seq or not seq[-1].startswith(phase_title(str(b.phase)) + " "):
                seq.append(t)
        if len(seq) > CAPTION_PHASES_MAX:  # a long run whose phases flip: the start and the end, not a wall of text
            k = CAPTION_PHASES_MAX // 2
            seq = seq[:k] + [f"… {len(seq) - 2 * k} more changes (the alerts table and the post-mortem timeline have "
                             "them all) …"] + seq[-k:]
        bits.append("Phases: " + " → ".join(seq) + ".")
    if hidden_info:
        bits.append(f"{hidden_info} info alert(s) hidden (isolated spikes): turn on *Show info alerts* to see them.")
    bits.append("Camera icon on the chart: PNG.")
    return " ".join(bits)


def add_step_marker(fig: go.Figure, step: int | float, text: str, color: str, row: int, rows: int,
                    xanchor: str = "right") -> None:
    """A dashed vertical line at `step` in one panel with a label at its foot (e.g. the phase II onset), left of
    the line (`xanchor="right"`) or right of it (`"left"`)."""
    refs = _axis_refs(fig, rows)
    xref, yref = refs[row - 1]
    fig.add_shape(type="line", xref=xref, yref=f"{yref} domain", x0=step, x1=step, y0=0, y1=1,
                  line=dict(color=color, width=2, dash="dash"))
    fig.add_annotation(x=step, y=0.02, xref=xref, yref=f"{yref} domain", text=text, showarrow=False, xanchor=xanchor,
                       yanchor="bottom", name="step-marker", font=dict(size=11, color=color), bgcolor="rgba(255,255,255,0.8)")


def late_phase_start(bands: pd.DataFrame | None) -> int | None:
    """The first step of the run's last stretch of phase III (acceleration) / reward collapse; None if it never got
    there. With one stretch (the usual spiral) that is where phase III began; a long run whose phase III flickered
    early (a brief entry at step 594 of 20,000, back to phase II) is fitted to the steps before its final stretch,
    not to its first 3 %."""
    if bands is None or bands.empty:
        return None
    late = bands["phase"].astype(str).isin([ACCELERATION, COLLAPSE]).to_numpy()
    if not late.any():
        return None
    last = len(late) - 1 - int(np.argmax(late[::-1]))  # the last late band
    first = last
    while first > 0 and late[first - 1]:
        first -= 1
    return int(bands["start"].iloc[first])


def fit_early_axis(fig: go.Figure, row: int, series: list[tuple[np.ndarray, np.ndarray]], cut: int,
                   smoothing: float, step_range: tuple[float, float] | None = None) -> None:
    """Fit panel `row`'s y-axis to the drawn lines (EMA when smoothing) at steps before `cut`, when later values
    leave that range; say so in the panel. Zooming out (or the modebar's autoscale) shows everything.
    `step_range`: only the steps drawn count."""
    if not series:  # the run has none of the panel's signals (e.g. no displacement in a W&B import)
        return
    before, after = [], []
    for steps, values in series:
        drawn = sig.ema(values, smoothing) if smoothing > 0 else values
        ok = np.isfinite(drawn) & window(steps, step_range)
        before.append(drawn[ok & (steps < cut)])
        after.append(drawn[ok & (steps >= cut)])
    b, a = np.concatenate(before), np.concatenate(after)
    if len(b) < 2:
        return
    lo, hi = float(b.min()), float(b.max())
    if not len(a) or (a.min() >= lo and a.max() <= hi):
        return
    pad = 0.15 * (hi - lo) if hi > lo else max(abs(hi), 1e-3) * 0.1
    fig.update_yaxes(range=[lo - pad, hi + pad], row=row, col=1, secondary_y=False)
    xref, yref = _axis_refs(fig, row)[row - 1]
    fig.add_annotation(text=f"axis fitted to steps < {cut}: later values run off it (autoscale shows all)",
                       showarrow=False, xref=f"{xref} domain", yref=f"{yref} domain", x=1, y=1, xanchor="right", yanchor="top",
                       font=dict(size=10, color="#777"), bgcolor="rgba(255,255,255,0.7)", name="early-axis-note")


def live_health_figure(
    signals: pd.DataFrame,
    bands: pd.DataFrame | None = None,
    alerts: pd.DataFrame | None = None,
    smoothing: float = 0.0,
    panels: tuple[sig.SignalSpec, ...] = sig.LIVE_PANELS,
    height_per_panel: int = 170,
    *,
    mode: str | None = None,
    run_label: str | None = None,
    twin: tuple[str, pd.DataFrame, str | None] | None = None,
    phase_ii_step: int | None = None,
    step_range: tuple[float, float] | None = None,
    max_points: int = MAX_POINTS,
) -> go.Figure:
    """The run's key signals stacked on one shared step axis (zoom one panel, all follow), phase bands shaded,
    alerts marked on every panel, the phase II onset drawn on the correct-response log-likelihood.

    Lines take the run's mode colour (the same on every page); a panel's second signal is dotted on the right
    axis. `twin` = (label, signals, mode) overlays another run (e.g. the LLDS twin) in its own mode colour.
    `step_range` = (first, last) draws only those steps (a zoomed view: every point when they fit); a line of
    more than `max_points` points is drawn at the chart's resolution (first / min / max / last per pixel column,
    so spikes and the collapse stay visible). Smoothing and the phases always come from the whole run."""
    frame = sig.canonical_frame(signals)
    if len(frame) == 0:
        return empty_figure("No steps logged yet.")
    if step_range is not None:
        step_range = (float(step_range[0]), float(step_range[1]))
        bands = clip_bands(bands, step_range)
        if alerts is not None and len(alerts):
            a_steps = pd.to_numeric(alerts["step"], errors="coerce")
            alerts = alerts[(a_steps >= step_range[0]) & (a_steps <= step_range[1])]
        if phase_ii_step is not None and not step_range[0] <= phase_ii_step <= step_range[1]:
            phase_ii_step = None
    steps = frame["step"].to_numpy(dtype="float64")
    runs = [(run_label or mode_label(mode), frame, mode)]
    if twin is not None:
        tf = sig.canonical_frame(twin[1])
        if len(tf):
            runs.append((twin[0], tf, twin[2]))
    styles = run_styles([m for _, _, m in runs])
    specs = [[{"secondary_y": bool(p.secondary)}] for p in panels]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.055,
                        subplot_titles=[p.title for p in panels], specs=specs)
    fig.update_annotations(font_size=13)  # the panel titles
    marker_panels: list[tuple[int, np.ndarray, np.ndarray]] = []
    for r, panel in enumerate(panels, start=1):
        first_values = None
        for j, (label_, f, _m) in enumerate(runs):
            color, dash = styles[j]
            run_steps = f["step"].to_numpy(dtype="float64")
            for secondary, names in ((False, panel.signals), (True, panel.secondary)):
                for name in names:
                    if name not in f.columns:
                        continue
                    values = f[name].to_numpy(dtype="float64")
                    if j == 0 and first_values is None and not secondary:
                        first_values = values
                    hover = f"{sig.label(name)} · {label_}" if len(runs) > 1 else sig.label(name)
                    _add_signal(fig, run_steps, values, hover, color, smoothing, r,
                                secondary=secondary if panel.secondary else None,
                                dash="dot" if secondary else (dash if j else None), group=label_,
                                show=(r == 1 and not secondary), legend_name=label_,
                                width=1.5 if secondary else 2.0, step_range=step_range, max_points=max_points)
        if first_values is None:
            fig.add_annotation(text="not logged by this run", showarrow=False, row=r, col=1,
                               x=0.5, y=0.5, xref="x domain", yref="y domain", font=dict(color="#888"))
            first_values = np.full(len(steps), np.nan)
        marker_panels.append((r, steps, first_values))
    add_phase_bands(fig, bands, rows=len(panels))
    add_phase_legend(fig, bands)
    add_alert_markers(fig, alerts, marker_panels)
    if phase_ii_step is not None:
        ll_row = next((i for i, p in enumerate(panels, start=1) if "ll_correct_mean" in p.signals), None)
        if ll_row is not None:
            first, last = (float(steps.min()), float(steps.max())) if step_range is None else step_range
            # the label sits left of the line, or right of it near the axis start (Plotly's autorange fits
            # labels too: a label left of an onset at step 23 of 20,000 stretched the axis below step 0)
            left = (phase_ii_step - first) < 0.3 * max(last - first, 1.0)
            add_step_marker(fig, phase_ii_step, f"phase II onset · step {int(phase_ii_step)}",
                            PHASE_SOLID.get("decay", "#e67800"), ll_row, len(panels),
                            xanchor="left" if left else "right")
    cut = late_phase_start(bands)
    if cut is not None:
        for r, panel in enumerate(panels, start=1):
            if panel.early:
                fit_early_axis(fig, r, [(f["step"].to_numpy(dtype="float64"), f[n].to_numpy(dtype="float64"))
                                        for _, f, _ in runs for n in panel.signals if n in f.columns], cut, smoothing,
                               step_range)
    for r, panel in enumerate(panels, start=1):
        if not panel.secondary:
            continue
        vals = [f[n].to_numpy(dtype="float64") for _, f, _ in runs for n in (*panel.signals, *panel.secondary)
                if n in f.columns]
        finite = np.concatenate([v[np.isfinite(v)] for v in vals]) if vals else np.array([])
        if len(finite) and finite.min() >= 0 and finite.max() <= 1:
            # both sides on the same 0..1 scale (reward and accuracy): one axis, not two that disagree
            primary = fig.get_subplot(r, 1).yaxis.plotly_name.replace("axis", "")
            fig.update_yaxes(matches=primary, showticklabels=False, row=r, col=1, secondary_y=True)
        elif any(n.startswith("frac_") for n in panel.secondary):
            fig.update_yaxes(tickformat=".0%", nticks=4, row=r, col=1, secondary_y=True)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_xaxes(showspikes=True, spikemode="across", spikethickness=1, spikecolor="#999", spikedash="dot")
    # autorange within the steps drawn: Plotly pads marker traces by 5 % of the axis, so an alert near step 0 of a
    # long run pushed the axis a twentieth of the run below step 0 (a fixed `range` instead breaks the y
    # autorange of the reward panel, whose right axis matches its left one)
    if step_range is None:
        drawn = np.concatenate([f["step"].to_numpy(dtype="float64") for _, f, _ in runs])
        first, last = float(np.nanmin(drawn)), float(np.nanmax(drawn))
    else:
        first, last = step_range
    fig.update_xaxes(autorangeoptions=dict(minallowed=first - 0.5, maxallowed=last + 0.5))
    # the legend sits above the panels: room for its rows at the narrowest layout (2 entries a row)
    n_entries = sum(1 for t in fig.data if t.showlegend is not False)
    top = 55 + 21 * -(-n_entries // 2)
    plot_h = height_per_panel * len(panels) + 20
    # fixed side margins and the whole width (make_subplots keeps 6 % for right axes; their ticks fit the margin):
    # the forecast chart below lines up step for step
    fig.update_yaxes(automargin=False)
    fig.update_xaxes(domain=[0.0, 1.0])
    fig.update_layout(
        height=plot_h + top + 40, hovermode="x unified",
        margin=dict(**LIVE_SIDE_MARGINS, t=top, b=40),
        legend=dict(orientation="h", y=1.0 + 26 / plot_h, x=0, yanchor="bottom", traceorder="normal", font=dict(size=12),
                    itemsizing="constant", entrywidth=LEGEND_ENTRY_PX, tracegroupgap=0, bgcolor="rgba(0,0,0,0)"),
    )
    return fig


def signal_title(name: str) -> str:
    """A panel title: the signal's label and its unit from the signal registry (when it knows the signal)."""
    label = sig.label(name)
    try:
        from lld_monitor.signals import BY_NAME
    except ImportError:
        return label
    row = BY_NAME.get(name)
    return f"{label} ({row.unit})" if row is not None and row.unit and row.unit not in label else label


def compare_figure(
    runs: list[tuple[str, pd.DataFrame]],
    names: list[str] | tuple[str, ...] = sig.COMPARE_DEFAULT,
    smoothing: float = 0.0,
    bands: pd.DataFrame | None = None,
    height_per_panel: int = 170,
    modes: list[str | None] | None = None,
) -> go.Figure:
    """Several runs overlaid on the same signals, one panel per signal, aligned on the step axis (shared x:
    zooming one panel zooms all; hover shows every run at that step).

    `runs` is a list of (label, signals DataFrame); `modes` (one per run) colours each run by its mode, the
    same colours as every other page; `bands` (optional) shades the first run's phases.
    """
    names = list(names)
    if not runs or not names:
        return empty_figure("Pick at least one run and one signal.")
    styles = run_styles(list(modes) if modes is not None else [None] * len(runs))
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=[signal_title(n) for n in names])
    fig.update_annotations(font_size=13)
    for i, (run_label, signals) in enumerate(runs):
        frame = sig.canonical_frame(signals, names) if signals is not None else pd.DataFrame()
        extra = [n for n in names if n not in frame.columns and signals is not None and n in signals.columns]
        for n in extra:
            frame[n] = pd.to_numeric(signals[n], errors="coerce").to_numpy()
        color, dash = styles[i]
        shown = False
        for r, n in enumerate(names, start=1):
            if n not in frame.columns:
                continue
            _add_signal(fig, frame["step"].to_numpy(dtype="float64"), frame[n].to_numpy(dtype="float64"),
                        run_label, color, smoothing, r, dash=dash, group=run_label, show=not shown)
            shown = True
    add_phase_bands(fig, bands, rows=len(names))
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    fig.update_xaxes(showspikes=True, spikemode="across", spikethickness=1, spikecolor="#999", spikedash="dot")
    plot_h = height_per_panel * len(names)
    fig.update_layout(height=plot_h + 130, hovermode="x unified", margin=dict(l=60, r=30, t=90, b=40),
                      legend=dict(orientation="h", y=1.0 + 28 / plot_h, x=0, yanchor="bottom"))  # above the titles
    return fig


def compare_table(frames: dict[str, pd.DataFrame], names: list[str]) -> pd.DataFrame:
    """The compared series in long form (run, step, signal, value): the CSV behind the compare chart."""
    parts = []
    for run_label, f in frames.items():
        cols = [n for n in names if f is not None and n in f.columns]
        if f is None or not len(f) or not cols:
            continue
        long = f[["step", *cols]].melt(id_vars="step", var_name="signal", value_name="value")
        long.insert(0, "run", run_label)
        parts.append(long)
    if not parts:
        return pd.DataFrame(columns=["run", "step", "signal", "value"])
    return pd.concat(parts, ignore_index=True)


def token_delta_figure(tokens: pd.DataFrame) -> go.Figure:
    """One response's per-token Δ along its positions, coloured by role; tool tokens drawn as grey gaps."""
    if tokens is None or tokens.empty:
        return empty_figure("No tokens for this sample.", height=220)
    t = tokens.sort_values("position")
    delta = (t["logp_new"].astype("float64") - t["logp_old"].astype("float64"))
    fig = go.Figure()
    for role in ("action", "answer", "tool"):
        m = (t["role"] == role).to_numpy()
        if not m.any():
            continue
        sub = t[m]
        y = delta[m] if role != "tool" else np.zeros(int(m.sum()))
        fig.add_trace(go.Bar(
            x=sub["position"], y=y, name=role if role != "tool" else "tool (unscored)",
            marker_color=ROLE_COLORS[role], customdata=np.stack([sub["token_text"].fillna("").astype(str),
                                                                 sub["action_idx"].astype(str)], axis=1),
            hovertemplate="pos %{x} · %{customdata[0]}<br>action %{customdata[1]}<br>Δ %{y:.4f}<extra>" + role + "</extra>",
        ))
    fig.update_layout(height=260, bargap=0.05, margin=dict(l=60, r=20, t=60, b=40),
                      title=dict(text="Δ per token along this response (nats; below 0 = its likelihood fell)",
                                 font=dict(size=13)),
                      xaxis_title="token position", yaxis_title="Δ (nats)",
                      legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0))
    return fig


def role_delta_distribution(step_tokens: pd.DataFrame) -> go.Figure:
    """The step's distribution of token Δ per role (tool tokens have no Δ and are counted only)."""
    if step_tokens is None or step_tokens.empty:
        return empty_figure("No token data at this step.", height=260)
    fig = go.Figure()
    delta = step_tokens["logp_new"].astype("float64") - step_tokens["logp_old"].astype("float64")
    for role in ("action", "answer"):
        d = delta[(step_tokens["role"] == role).to_numpy()].dropna()
        if len(d):
            fig.add_trace(go.Violin(y=d, name=f"{role} (n={len(d)})", line_color=ROLE_COLORS[role],
                                    box_visible=True, meanline_visible=True, points=False, spanmode="hard"))
    n_tool = int((step_tokens["role"] == "tool").sum())
    if not fig.data:
        return empty_figure("No scored tokens at this step.", height=260)
    fig.add_hline(y=0, line_dash="dot", line_color="#888")
    fig.update_layout(height=300, margin=dict(l=60, r=20, t=40, b=40), yaxis_title="token Δ (nats)",
                      title=dict(text=f"Every scored token of the step's logged samples ({n_tool} tool tokens unscored)",
                                 font=dict(size=13)),
                      showlegend=False)
    return fig


def phase_timeline_figure(bands: pd.DataFrame, alerts: pd.DataFrame | None = None,
                          collapse_step: int | None = None) -> go.Figure:
    """Phases as coloured segments along the step axis, alerts as markers per signal row."""
    if bands is None or bands.empty:
        return empty_figure("No phases (the run has no steps).", height=200)
    fig = go.Figure()
    n = len(bands)
    for i, (_, b) in enumerate(bands.iterrows()):
        last = i == n - 1
        fig.add_trace(go.Bar(
            x=[float(b["end"]) - float(b["start"]) + (1 if last else 0)], base=[float(b["start"]) - (0.5 if last else 0)],
            y=["phase"], orientation="h",
            marker_color=PHASE_SOLID.get(str(b["phase"]), "#888"), name=str(b["phase"]),
            hovertemplate=f"{b['phase']}: steps {int(b['start'])}–{int(b['end']) - (0 if last else 1)}<extra></extra>",
            text=phase_short(str(b["phase"])), textposition="inside", insidetextanchor="middle",
        ))
    n_rows = 1
    if alerts is not None and len(alerts):
        # phase-change alerts (signal "phase") sit on the phase row itself; the other signals get a row each,
        # in the order they first alerted (top = first)
        signals_ = [x for x in dict.fromkeys(alerts.sort_values("step")["signal"].astype(str)) if x != "phase"]
        n_rows += len(signals_)
        fig.add_trace(go.Scatter(
            x=alerts["step"], y=alerts["signal"].astype(str), mode="markers", name="alerts",
            marker=dict(symbol="diamond", size=10, color=[SEVERITY_COLORS.get(str(s), "#555") for s in alerts["severity"]]),
            hovertext=[f"step {int(s)} · {sev}: {m}" for s, sev, m in zip(alerts["step"], alerts["severity"], alerts["message"].fillna(""))],
            hoverinfo="text",
        ))
        fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(signals_)) + ["phase"])
    if collapse_step is not None:
        fig.add_vline(x=collapse_step, line_color="#d62728", line_dash="dash",
                      annotation_text=f"collapse @ {collapse_step}", annotation_position="top")
    fig.update_layout(barmode="overlay", height=160 + 28 * n_rows, showlegend=False, xaxis_title="step",
                      margin=dict(l=140, r=20, t=60, b=40))
    return fig


def lead_figure(leads: pd.DataFrame) -> go.Figure:
    """Horizontal bars: how many steps each signal's first alert led the collapse."""
    if leads is None or leads.empty or leads["lead_steps"].isna().all():
        return empty_figure("No lead times (no alerts or no collapse).", height=200)
    d = leads.dropna(subset=["lead_steps"]).sort_values("lead_steps")
    fig = go.Figure(go.Bar(x=d["lead_steps"].astype(float), y=d["signal"], orientation="h",
                           marker_color=[SEVERITY_COLORS.get(str(s), "#555") for s in d["severity"]],
                           hovertemplate="%{y}: first alert %{x} steps before collapse<extra></extra>"))
    fig.update_layout(height=120 + 26 * len(d), xaxis_title="steps ahead of the collapse", margin=dict(l=160, r=20, t=30, b=40))
    return fig


FORECAST_COLOR = "#6a3d9a"


def forecast_figure(forecast: pd.DataFrame | None, bands: pd.DataFrame | None = None, *,
                    collapse_step: int | None = None, horizon: int | None = None, threshold: float = 0.5,
                    model: str | None = None, step_range: tuple[float, float] | None = None,
                    max_points: int = MAX_POINTS, height: int = 240) -> go.Figure:
    """p_collapse (the chance the reward collapses within the next `horizon` steps) over the run's steps, on the
    phase bands, with the alert threshold and the reward collapse marked. `forecast`: columns step, p_collapse
    (defined before the collapse only). `step_range`: the steps shown (Live health passes the signals chart's, the
    whole run when it is not zoomed, so that both charts span the same steps)."""
    if forecast is None or forecast.empty:
        return empty_figure("No collapse forecast for this run (no model, or too few steps yet).", height=height)
    f = forecast.sort_values("step")
    steps = f["step"].to_numpy(dtype="float64")
    p = f["p_collapse"].to_numpy(dtype="float64")
    if step_range is not None:
        keep = window(steps, step_range)
        steps, p = steps[keep], p[keep]
        bands = clip_bands(bands, step_range)
        if collapse_step is not None and not step_range[0] <= collapse_step <= step_range[1]:
            collapse_step = None
    idx = m4_indices(steps, p, max_points)
    fig = go.Figure()
    within = f"within {horizon} steps" if horizon else "soon"
    fig.add_trace(go.Scatter(x=steps[idx], y=p[idx], mode=_mode(len(idx)), name=f"p(collapse {within})",
                             line=dict(color=FORECAST_COLOR, width=2),
                             hovertemplate="step %{x}: p = %{y:.2f}<extra></extra>"))
    add_phase_bands(fig, bands, rows=1, label=False)  # labelled on the signals' chart above it
    fig.add_hline(y=threshold, line_color=SEVERITY_COLORS["warning"], line_dash="dot",
                  annotation_text=f"alert at p ≥ {threshold:g}", annotation_position="bottom left",
                  annotation_font=dict(size=11, color=SEVERITY_COLORS["warning"]))
    above = np.flatnonzero(p >= threshold)
    if above.size:
        first = steps[above[0]]
        fig.add_trace(go.Scatter(x=[first], y=[p[above[0]]], mode="markers", name=f"first p ≥ {threshold:g}",
                                 marker=dict(symbol="diamond", size=11, color=SEVERITY_COLORS["warning"]),
                                 hovertemplate=f"first p ≥ {threshold:g} at step %{{x}}<extra></extra>"))
    if collapse_step is not None:
        fig.add_vline(x=collapse_step, line_color=PHASE_SOLID[COLLAPSE], line_dash="dash",
                      annotation_text=f"reward collapse @ {collapse_step}", annotation_position="top left",
                      annotation_font=dict(size=11, color=PHASE_SOLID[COLLAPSE]))
    title = f"Collapse forecast: p(reward collapses {within})" + (f" · model {model}" if model else "")
    fig.update_layout(height=height, title=dict(text=title, font=dict(size=14)), showlegend=False,
                      margin=dict(**LIVE_SIDE_MARGINS, t=40, b=40), xaxis_title="step", hovermode="x")
    fig.update_yaxes(range=[-0.02, 1.02], tickformat=".1f", automargin=False)
    if step_range is not None:
        fig.update_xaxes(range=[step_range[0] - 0.5, step_range[1] + 0.5])
    return fig
