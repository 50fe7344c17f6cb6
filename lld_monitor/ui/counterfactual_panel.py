"""Streamlit glue of the 'LLDS would have applied' panels (Live health, Token inspector, Compare runs).

The data and figures are `lld_monitor.ui.counterfactual`'s (testable without Streamlit); this module keeps the
settings in the session, runs one `lld-monitor whatif` subprocess per (store, run, settings) at a time
(shared by sessions) and polls it until the result is in the cache.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from lld_monitor.counterfactual import cache as wc
from lld_monitor.store.location import canonical
from lld_monitor.ui import counterfactual as uw
from lld_monitor.ui import widgets

SETTINGS_KEY = "_whatif_settings"  # the session's LLDS settings, shared by the three pages
POLL_S = 1.0
RELAUNCH_S = 30.0  # a live run that logged more: at most one new `lld-monitor whatif` per run this often


def current_settings() -> dict[str, Any]:
    cfg = st.session_state.get(SETTINGS_KEY)
    return dict(cfg) if isinstance(cfg, dict) else wc.settings()


def settings_controls(prefix: str) -> dict[str, Any]:
    """λ, gate and norm pickers (defaults: lld.LLDSConfig's); the choice holds on every page of the session."""
    cfg = current_settings()
    c1, c2, c3 = st.columns(3)
    lam = c1.number_input("λ", min_value=0.001, max_value=100.0, value=float(cfg["lam"]), step=0.05, format="%.3f",
                          key=f"{prefix}_lam", help="penalty = λ · L_LLDS (the paper: 0.2); changing it needs no recompute")
    gate = c2.selectbox("Gate", wc.GATES, index=wc.GATES.index(cfg["gate"]), key=f"{prefix}_gate",
                        help="action: A-gate (paper v2 default); response: R-gate; token: no gate (Eq. 9)")
    norm = c3.selectbox("Normalization", wc.NORMS, index=wc.NORMS.index(cfg["norm"]), key=f"{prefix}_norm",
                        help="response: per preserved response (paper); token_mean: over all action tokens (code); "
                             "seq_mean: per-response means over all responses")
    cfg = wc.settings(lam=lam, gate=gate, norm=norm)
    st.session_state[SETTINGS_KEY] = cfg
    return cfg


@st.cache_resource(show_spinner=False)
def _jobs() -> dict[tuple, dict[str, Any]]:
    """(store, run_id, settings key) -> {"job": WhatIfJob, "token_steps": steps known when it started}."""
    return {}


def _job_key(store: str, run_id: str, cfg: dict[str, Any]) -> tuple:
    return (canonical(store), run_id, wc.setting_key(cfg))


def view_and_job(store: str, run: dict[str, Any], cfg: dict[str, Any], start: bool = True):
    """The run's counterfactual view, starting `lld-monitor whatif` when the cache lacks token-logged steps
    (never twice at once for the same run and settings; after a failure only on `retry`). Returns (view, job)."""
    view = widgets.with_reader(store, uw.whatif_view, store, run, cfg)
    jobs = _jobs()
    key = _job_key(store, view.run_id, cfg)
    entry = jobs.get(key)
    job = entry["job"] if entry else None
    if start and view.needs_run and (job is None or (not job.running and job.error() is None
                                                     and view.n_token_steps > entry["token_steps"]
                                                     and job.seconds >= RELAUNCH_S)):
        if job is not None:
            job.close()
        job = uw.WhatIfJob(store, view.run_id, cfg)
        jobs[key] = {"job": job, "token_steps": view.n_token_steps}
    return view, job


def retry(store: str, run_id: str, cfg: dict[str, Any]) -> None:
    entry = _jobs().pop(_job_key(store, run_id, cfg), None)
    if entry:
        entry["job"].close()


def job_status(store: str, run: dict[str, Any], view: uw.WhatIfView, job: uw.WhatIfJob | None, prefix: str) -> bool:
    """Say what is happening (computing, failed, no tokens); poll a running job. True while it runs."""
    if view.state == uw.NO_TOKENS:
        st.info(view.message)
        return False
    if job is not None and job.running:
        st.caption(f"Computing what LLDS would have done on {view.n_behind} token-logged step(s) with "
                   f"`lld-monitor whatif` ({job.seconds:.0f} s so far); the panel fills in when it is done.")

        @st.fragment(run_every=POLL_S)
        def _poll() -> None:
            if not job.running:
                st.rerun(scope="app")

        _poll()
        return True
    err = job.error() if job is not None else None
    if err and view.needs_run:
        st.warning(f"`lld-monitor whatif` failed:\n\n```\n{err}\n```")
        if st.button("Try again", key=f"{prefix}_retry"):
            retry(store, view.run_id, view.settings)
            st.rerun()
    return False


def live_health_panel(ctx: widgets.Context) -> None:
    """Live health: the optional 'LLDS would have applied' panel under the main chart."""
    run = ctx.run or {}
    if not st.toggle("LLDS would have applied", value=False, key="live_whatif",
                     help="The LLDS term (lld.llds_loss, the trainer's function) evaluated on this run's stored tokens "
                          "at the end of each token-logged step: what LLDS would have penalised had it been on. "
                          "Computed once by `lld-monitor whatif` and cached beside the run."):
        return
    st.subheader("LLDS would have applied")
    cfg = settings_controls("live_whatif")
    try:
        view, job = view_and_job(ctx.store, run, cfg)
        ov = widgets.cached_overview(ctx.store, ctx.run_id, ctx.version(), ctx.run)
    except widgets.StoreProblem as exc:
        st.warning(str(exc))
        return
    running = job_status(ctx.store, run, view, job, "live_whatif")
    if not view.has_data:
        return
    logged = ov.signals[["step", "llds_loss"]] if "llds_loss" in ov.signals.columns else None
    fig = uw.whatif_figure(view, ov.bands, logged=logged)
    widgets.plotly(fig, key="live_whatif_fig")
    s = view.steps
    acted = int((s["penalty"] > 0).sum())
    st.caption(
        f"At the end of each token-logged step, on the logged groups only ({int(s['n_samples'].median())} samples "
        f"per step): the penalty LLDS ({uw.settings_text(cfg)}) would have measured there, not a replay of training. "
        f"It would have acted on {acted} of {len(s)} token-logged steps."
        + (" The grey line is what this run applied (its logged llds_loss, the mean over the step's updates on "
           "all groups): the same term measured during the updates, so not the same number." if logged is not None
           and (logged["llds_loss"].fillna(0) > 0).any() else "")
        + ("" if running or view.state == uw.READY else f" {view.message}"))


def token_outline(ctx: widgets.Context, step: int, sample: tuple[int, int], advantage: float | None) -> set[int] | None:
    """Token inspector: the toggle and the positions to outline (None when off or not available)."""
    run = ctx.run or {}
    on = st.toggle("Outline the tokens LLDS would have penalised", value=False, key="tok_whatif",
                   help="Tokens of preserved (Â ≥ 0) responses whose gate LLDS would have opened and whose "
                        "likelihood fell during the step (lld.llds_token_flags, the trainer's gating).")
    if not on:
        return None
    cfg = current_settings()
    try:
        view, job = view_and_job(ctx.store, run, cfg)
    except widgets.StoreProblem as exc:
        st.warning(str(exc))
        return None
    if job_status(ctx.store, run, view, job, "tok_whatif") or not view.has_data:
        return None
    rows = view.steps[view.steps["step"] == int(step)]
    if rows.empty:
        st.caption(f"Step {step} is not in the counterfactual yet.")
        return None
    penalised, gated = uw.token_outline(view, step, sample[0], sample[1])
    if advantage is not None and not pd.isna(advantage) and advantage < 0:
        st.caption("This response is not preserved (Â < 0): LLDS leaves its tokens alone.")
    else:
        st.caption(f"LLDS ({uw.settings_text(cfg)}) would have penalised {len(penalised)} token(s) of this response "
                   f"(outlined), of {len(gated)} whose gate it would have opened; the step's penalty would have been "
                   f"{float(rows['penalty'].iloc[0]):.3g}.")
    return penalised


def compare_panel(ctx: widgets.Context, runs: pd.DataFrame, shown: list[str], names: dict[str, str]) -> None:
    """Compare runs: each shown run's counterfactual beside the logged llds_loss of the LLDS runs among them."""
    if not st.toggle("LLDS would have applied vs applied", value=False, key="cmp_whatif",
                     help="The vanilla run's counterfactual (lld-monitor whatif) beside its LLDS twin's logged "
                          "llds_loss, on one step axis."):
        return
    cfg = current_settings()
    counterfactuals, applied, busy = [], [], False
    for rid in shown:
        run = {k: (None if v is pd.NA else v) for k, v in runs[runs["run_id"] == rid].iloc[0].to_dict().items()}
        try:
            view, job = view_and_job(ctx.store, run, cfg)
            sig = widgets.cached_signals(ctx.store, rid, ctx.version(rid))
        except widgets.StoreProblem as exc:
            st.warning(str(exc))
            return
        if view.state == uw.NO_TOKENS:
            st.caption(f"{names[rid]}: no token rows, so no counterfactual (its logged signals still show).")
        else:
            busy = job_status(ctx.store, run, view, job, f"cmp_whatif_{rid}") or busy
        counterfactuals.append((names[rid], run.get("mode"), view))
        if str(run.get("mode")) in ("llds", "llds_ma"):
            applied.append((names[rid], run.get("mode"), sig[["step", "llds_loss"]] if "llds_loss" in sig else None))
    widgets.plotly(uw.whatif_compare_figure(counterfactuals, applied), key="cmp_whatif_fig")
    st.caption(f"Would have applied: λ·L_LLDS ({uw.settings_text(cfg)}) at the end of each token-logged step, on the "
               "logged groups (dotted for an LLDS run's own). Applied: the LLDS run's logged llds_loss, the mean of "
               "λ·L_LLDS over the step's updates, each measured before its optimizer step on every group. Same term, "
               "measured at different moments on different samples: compare their levels and trends, not step values.")
