"""Live health: the run's key signals on one shared step axis, phases shaded, alerts marked; refreshes while live."""

import time

import streamlit as st

from lld_monitor.ui import counterfactual_panel, figures, pairing, queries, widgets
from lld_monitor.ui import phase_bands as ph

PENDING_POLL_S = 1.0
ctx = widgets.current()
st.title("Live health")
if widgets.require_run(ctx):
    st.caption(widgets.WHAT_TO_WATCH)
    run = ctx.run or {}
    twin_id = pairing.best_twin(ctx.runs, ctx.run_id)
    twin_row = ctx.runs[ctx.runs["run_id"] == twin_id].iloc[0] if twin_id else None
    c1, c2, c3 = st.columns([2, 1, 1.4], vertical_alignment="bottom")
    smoothing = c1.slider("Smoothing (EMA; the raw trace stays faint behind)", 0.0, 0.99, 0.6, 0.01, key="live_smoothing")
    show_info = c2.toggle("Show info alerts", value=False, key="live_info",
                          help="info = isolated spikes and stagnation signs; warning and critical are always shown")
    overlay = False
    if twin_row is not None:
        overlay = c3.toggle(f"Overlay the {ph.mode_label(twin_row['mode'])} twin", value=False, key="live_twin",
                            help=f"{twin_row['name']}: the run with the same config in another mode, drawn in its "
                                 "mode's colour (Compare runs has more).")
    live = run.get("status") == "running" or (overlay and twin_row is not None and twin_row["status"] == "running")

    # a long run without stored detector state is replayed in the background: its fragment polls until that ends
    replaying = widgets.tracker(ctx.store, ctx.run_id).replaying

    @st.fragment(run_every=widgets.REFRESH_S if live else (PENDING_POLL_S if replaying else None))
    def live_panel() -> None:
        store, run_id = ctx.store, ctx.run_id
        if live:  # re-read the runs table on each tick (the sidebar's copy is from the last full run)
            try:
                runs = widgets.cached_runs(store)
            except widgets.StoreProblem as exc:
                st.warning(str(exc))
                return
            ctx.runs = runs
        try:
            ov = widgets.cached_overview(store, run_id, ctx.version(run_id), ctx.run)
            twin = None
            if overlay and twin_id:
                twin = (f"{twin_row['name']} ({ph.mode_label(twin_row['mode'])})",
                        widgets.cached_signals(store, twin_id, ctx.version(twin_id)), str(twin_row["mode"]))
        except widgets.StoreProblem as exc:
            st.warning(str(exc))
            return
        except KeyError:
            st.warning(f"Run `{run_id}` is no longer in the store.")
            return
        widgets.status_line(ov)
        if ov.n_steps == 0:
            st.info("This run has no steps yet; the page refreshes by itself while the run is live.")
        else:
            if ov.n_steps == 1:
                st.caption("Only one step so far: trends and phases need more steps.")
            alerts = ph.filter_alerts(ov.alerts, ("info", "warning", "critical") if show_info else ("warning", "critical"))
            hidden = len(ov.alerts) - len(alerts)
            label = f"{ov.run.get('name')} ({ph.mode_label(ov.run.get('mode'))})"
            step_range = widgets.step_range_control(ov.signals, key=f"live_range_{run_id}")
            fig = figures.live_health_figure(ov.signals, ov.bands, alerts, smoothing, mode=ov.run.get("mode"),
                                             run_label=label, twin=twin, phase_ii_step=ov.phase_ii_step,
                                             step_range=step_range)
            widgets.plotly(fig, key="live_fig")
            st.caption(figures.live_legend_caption(ov.bands, hidden))
            steps = ov.signals["step"]  # the forecast chart spans the signals chart's steps
            forecast_panel(ov, step_range or ((float(steps.min()), float(steps.max())) if len(steps) else None))
            name = widgets.safe_name(ov.run.get("name") or run_id)
            st.download_button("Download the signals (CSV)", lambda: queries.to_csv_bytes(ov.signals),
                               file_name=f"{name}_signals.csv", mime="text/csv", key="live_csv", on_click="ignore",
                               icon=":material/download:")
            if len(ov.alerts):
                with st.expander(f"Alerts ({len(alerts)} shown, {hidden} info hidden)" if hidden
                                 else f"Alerts ({len(alerts)})", expanded=False):
                    st.dataframe(alerts, hide_index=True, width="stretch")
        if live and ov.status != "running" and run.get("status") == "running":
            st.rerun()  # the run ended: redraw the page once without the refresh timer
        if ov.detection.pending and not replaying:  # the replay began in this run: once more, with the poll timer
            time.sleep(PENDING_POLL_S)
            st.rerun()
        elif not ov.detection.pending and replaying and not live:
            st.rerun()  # the replay is done: redraw the page once without the poll timer

    def forecast_panel(ov, step_range) -> None:
        det = ov.detection
        if det.pending or det.forecast_model is None:
            return
        p_now = det.p_collapse
        first = det.forecast[det.forecast["p_collapse"] >= ph.FORECAST_THRESHOLD]
        first_step = int(first["step"].iloc[0]) if len(first) else None
        c1, c2, c3 = st.columns(3)
        if det.collapse_step is not None:
            c1.metric("Reward collapsed at step", det.collapse_step)
        else:
            c1.metric(f"p(collapse within {det.horizon} steps)", "—" if p_now is None else f"{p_now:.2f}",
                      help="The chance the reward collapses (its 10-step mean below half its peak for 5 steps) within "
                           "the next steps, from the signals logged so far; calibrated on runs it was not fitted on "
                           "(docs/detector.md, 'Forecast'). The detector raises a warning the first time it reaches "
                           f"{ph.FORECAST_THRESHOLD:g}.")
        ahead = None if first_step is None or det.collapse_step is None else det.collapse_step - first_step
        c2.metric(f"First p ≥ {ph.FORECAST_THRESHOLD:g}",
                  ("never" if det.collapse_step is not None else "not yet") if first_step is None else f"step {first_step}",
                  None if ahead is None else f"{ahead} steps before the collapse", delta_color="off")
        c3.metric("Forecast model", det.forecast_model,
                  help="Set with `lld-monitor serve --forecast-model FILE` (a model from `lld-monitor forecast fit`)")
        widgets.plotly(figures.forecast_figure(det.forecast, ov.bands, collapse_step=det.collapse_step,
                                               horizon=det.horizon, threshold=ph.FORECAST_THRESHOLD,
                                               model=det.forecast_model, step_range=step_range),
                       key="live_forecast_fig")

    live_panel()
    counterfactual_panel.live_health_panel(ctx)
