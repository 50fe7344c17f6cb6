"""Compare runs: overlay runs on the same signals, toggle a vanilla run against its LLDS / LLDS-MA twin."""

import streamlit as st

from lld_monitor.ui import counterfactual_panel, figures, pairing, queries, widgets
from lld_monitor.ui import phase_bands as ph
from lld_monitor.ui import series as sig

ctx = widgets.current()
st.title("Compare runs")
if widgets.require_run(ctx):
    runs = ctx.runs
    names = {r["run_id"]: f"{r['name']} ({ph.mode_label(r['mode'])}"
             + ("" if r["source"] == "local" else f", {r['source']}") + ")" for _, r in runs.iterrows()}
    modes = dict(zip(runs["run_id"], runs["mode"].astype(str)))
    base = ctx.run_id
    cands = pairing.twin_candidates(runs, base)
    others = [rid for rid in runs["run_id"] if rid != base]
    if not others:
        st.info("The store has a single run: nothing to compare it with yet. Start its twin with "
                "`lld-monitor train --mode llds` (or import one from W&B).")
    else:
        ordered = list(cands["run_id"]) + [rid for rid in others if rid not in set(cands["run_id"])]
        exact = set(cands.loc[cands["exact"], "run_id"]) if len(cands) else set()

        def twin_label(rid: str) -> str:
            return names[rid] + ("  ✓ same config" if rid in exact else "")

        c1, c2 = st.columns([2, 1])
        twin = c1.selectbox("Twin of the sidebar run (paired by config; or choose)", ordered, key="cmp_twin",
                            format_func=twin_label)
        if twin not in exact:
            c1.caption("No run with exactly the same config (apart from mode / regularizer keys): closest shown.")
        base_row = runs[runs["run_id"] == base].iloc[0]
        twin_row = runs[runs["run_id"] == twin].iloc[0]
        choice = c2.segmented_control(
            "Show", ["base", "twin", "both"], default="both", key="cmp_show",
            format_func=lambda o: {"base": ph.mode_label(base_row["mode"]), "twin": ph.mode_label(twin_row["mode"]),
                                   "both": "both"}[o],
            help="One click switches between the run and its twin.",
        ) or "both"
        extra = st.multiselect("Overlay other runs (local and imported)", [r for r in others if r != twin],
                               key="cmp_extra", format_func=lambda rid: names[rid])
        shown = {"base": [base], "twin": [twin], "both": [base, twin]}[choice] + list(extra)
        st.caption("Showing: " + " · ".join(names[r] for r in shown))

        versions = tuple(ctx.version(r) for r in shown)
        avail: list[str] = []
        try:
            for r in shown:
                for n in sig.available(widgets.cached_signals(ctx.store, r, ctx.version(r))):
                    if n not in avail:
                        avail.append(n)
        except widgets.StoreProblem as exc:
            st.warning(str(exc))
            st.stop()
        default = [n for n in sig.COMPARE_DEFAULT if n in avail] or avail[:4]
        chosen = st.multiselect("Signals", avail, default=default, key="cmp_signals", format_func=sig.label)
        smoothing = st.slider("Smoothing (EMA; the raw trace stays faint behind)", 0.0, 0.99, 0.6, 0.01,
                              key="cmp_smoothing")
        frames = widgets.cached_compare(ctx.store, tuple(shown), tuple(chosen), versions)
        fig = figures.compare_figure([(names[r], frames[r]) for r in shown], chosen, smoothing,
                                     modes=[modes[r] for r in shown])
        widgets.plotly(fig, key="cmp_fig")
        st.caption("Colour = mode, the same on every page (a second run of a mode is dashed). Hover shows every run "
                   "at that step; drag to zoom (all panels follow), double-click to reset; camera icon: PNG.")
        st.download_button("Download these series (CSV)", queries.to_csv_bytes(figures.compare_table(
            {names[r]: frames[r] for r in shown}, chosen)), file_name="compare.csv", mime="text/csv",
            key="cmp_csv", on_click="ignore", icon=":material/download:")
        counterfactual_panel.compare_panel(ctx, runs, shown, names)

        st.subheader("Differences at chosen steps")
        last = [int(f["step"].max()) for f in frames.values() if len(f)]
        common_last = min(last) if last else 0
        default_steps = sorted({int(common_last * x) for x in (0.25, 0.5, 0.75, 1.0)})
        raw = st.text_input("Steps (comma-separated)", ", ".join(map(str, default_steps)), key="cmp_steps")
        steps, bad = [], []
        for tok in raw.split(","):
            tok = tok.strip()
            if not tok:
                continue
            try:
                steps.append(int(tok))
            except ValueError:
                bad.append(tok)
        if bad:
            st.warning(f"Not a step number: {', '.join(bad)} (use whole numbers like 50, 100).")
        if steps and chosen:
            table = pairing.differences_table({names[r]: frames[r] for r in shown}, steps, chosen)
            table["signal"] = table["signal"].map(sig.label)
            st.dataframe(table, hide_index=True, width="stretch")
            st.caption("Each value is the run's latest stored step at or before the asked step.")
