"""Live health: the run's key signals on one shared step axis, phases shaded, alerts marked; refreshes while live."""

import streamlit as st

from lld_monitor.ui import figures, widgets

ctx = widgets.current()
st.title("Live health")
if widgets.require_run(ctx):
    smoothing = st.slider("EMA smoothing (raw trace stays visible)", 0.0, 0.99, 0.6, 0.01, key="live_smoothing")
    live = (ctx.run or {}).get("status") == "running"

    @st.fragment(run_every=widgets.REFRESH_S if live else None)
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
            widgets.plotly(figures.live_health_figure(ov.signals, ov.bands, ov.alerts, smoothing), key="live_fig")
            if len(ov.alerts):
                with st.expander(f"Alerts ({len(ov.alerts)})", expanded=False):
                    st.dataframe(ov.alerts, hide_index=True, width="stretch")
        if live and ov.status != "running":
            st.rerun()  # the run ended: redraw the page once without the refresh timer

    live_panel()
