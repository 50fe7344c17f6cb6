"""Post-mortem: phase timeline, which signal moved first and its lead on the collapse, top displaced samples, export."""

import re

import streamlit as st

from lld_monitor.ui import figures, queries, widgets

ctx = widgets.current()
st.title("Post-mortem")
if widgets.require_run(ctx):
    k = st.number_input("Top displaced samples per phase", 1, 50, 5, key="pm_k")
    try:
        pm = widgets.cached_post_mortem(ctx.store, ctx.run_id, int(k), ctx.version(), ctx.run)
    except widgets.StoreProblem as exc:
        st.warning(str(exc))
        st.stop()
    ov = pm.overview
    if ov.status == "running":
        st.info("This run is still live: the post-mortem shows it up to its last step.")
    if ov.n_steps == 0:
        st.info("This run has no steps yet.")
        st.stop()

    st.subheader("Phase timeline")
    widgets.plotly(figures.phase_timeline_figure(ov.bands, ov.alerts, ov.detection.collapse_step), key="pm_timeline")
    for note in ov.notes:
        st.caption(note)

    st.subheader("What moved first")
    if pm.reference_step is None:
        st.write("The reward neither collapsed nor declined by 20 %: onsets are listed without a lead time.")
    else:
        st.write(f"Reference: **{pm.reference_kind}** at step **{pm.reference_step}**.")
    st.caption("Onset = the step each signal's sustained change began (change points on the smoothed series, "
               "docs/detector.md); isolated spikes are listed apart.")
    onset_box = st.container()  # filled last: on a long run the onsets take a while, the rest shows meanwhile

    def show_onsets() -> None:
        with onset_box, st.spinner("Finding where each signal's sustained change began…"):
            try:
                onsets, spikes = widgets.cached_onsets(ctx.store, ctx.run_id, pm.reference_step, ctx.version())
            except widgets.StoreProblem as exc:
                st.warning(str(exc))
                return
            found = onsets[onsets["onset_step"].notna()] if len(onsets) else onsets
            if found.empty:
                st.write("No signal shows a sustained change" + (" before the reference." if pm.reference_step else "."))
            else:
                first = found.iloc[0]
                lead_txt = ("" if str(first["lead_steps"]) == "<NA>"
                            else f", {int(first['lead_steps'])} steps before the reference")
                st.markdown(f"First to move: **{first['column']}** ({first['direction']}, {first['size_sigma']} σ) "
                            f"from step **{int(first['onset_step'])}**{lead_txt}.")
            if len(onsets):
                st.dataframe(onsets, hide_index=True, width="stretch")
            if len(spikes):
                with st.expander(f"Isolated spikes ({len(spikes)}): not sustained, not an onset"):
                    st.dataframe(spikes, hide_index=True, width="stretch")

    if not pm.leads.empty:
        st.markdown("**First alert of each signal** (the detector's alerts; an alert can be an isolated spike)")
        if pm.leads["lead_steps"].notna().any():
            widgets.plotly(figures.lead_figure(pm.leads), key="pm_leads")
        with st.expander("First alerts as a table"):
            st.dataframe(pm.leads, hide_index=True, width="stretch")

    st.subheader("Top displaced samples per phase")
    st.caption("Preserved samples (advantage ≥ 0) whose summed log-likelihood fell most (Δ = after − before); "
               "when the run logged tokens, among the token-logged steps, so each opens in the token inspector.")
    if pm.top.empty:
        st.write("No per-sample data for this run (imported runs carry step signals only).")
    else:
        for phase, grp in pm.top.groupby("phase", sort=False):
            st.markdown(f"**{phase}**")
            for _, r in grp.iterrows():
                label = (f"step {int(r['step'])} · sample {int(r['sample_idx'])}"
                         + (f" (rank {int(r['rank'])})" if int(r['rank']) else "")
                         + f" · Δ {r['delta_sum']:+.3f} · reward {r['reward']:.2f}")
                if bool(r["has_tokens"]):
                    widgets.token_link(ctx.run_id, r["step"], r["sample_idx"], r["rank"], label)
                else:
                    st.write(label + " (no token data at this step)")

    st.subheader("Export")
    st.caption("PNG: use the camera icon in each chart's toolbar (Plotly's own download). Tables of the run:")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str((ctx.run or {}).get("name") or ctx.run_id))[:80] or "run"
    version = ctx.version()

    def _table(name: str):
        return widgets.cached_export(ctx.store, ctx.run_id, version)[name]

    c = st.columns(4)
    c[0].download_button("signals.csv", lambda: queries.to_csv_bytes(_table("signals")),
                         file_name=f"{safe}_signals.csv", mime="text/csv", key="dl_sig_csv", on_click="ignore")
    c[1].download_button("signals.parquet", lambda: queries.to_parquet_bytes(_table("signals")),
                         file_name=f"{safe}_signals.parquet", mime="application/octet-stream", key="dl_sig_pq", on_click="ignore")
    c[2].download_button("samples.parquet", lambda: queries.to_parquet_bytes(_table("samples")),
                         file_name=f"{safe}_samples.parquet", mime="application/octet-stream", key="dl_smp_pq", on_click="ignore")
    c[3].download_button("alerts.csv", lambda: queries.to_csv_bytes(_table("alerts")),
                         file_name=f"{safe}_alerts.csv", mime="text/csv", key="dl_alerts_csv", on_click="ignore")
    show_onsets()
