"""Token inspector: one response's tokens coloured by probability or Δ, tools greyed, answer outlined."""

import streamlit as st

from lld_monitor.ui import counterfactual_panel, figures, tokens, widgets

ctx = widgets.current()
st.title("Token inspector")


def _int_qp(name: str):
    v = st.query_params.get(name)
    try:
        return None if v in (None, "") else int(v)
    except ValueError:
        return None


if widgets.require_run(ctx):
    version = ctx.version()
    # links from the post-mortem carry ?run=..&step=..&sample=..&rank=..; apply them once
    link = (_int_qp("step"), _int_qp("sample"), _int_qp("rank"))
    if link[0] is not None and st.session_state.get("_tok_link") != (ctx.run_id, *link):
        st.session_state["_tok_link"] = (ctx.run_id, *link)
        st.session_state["tok_step"] = link[0]
        if link[1] is not None:
            st.session_state["tok_pick"] = (link[1], link[2] or 0)
            st.session_state["tok_filter"] = "all"
    try:
        logged_steps = widgets.cached_token_steps(ctx.store, ctx.run_id, version)
        # first visit of this run (no link): open where displacement shows best (phase II onset, else the run's
        # most displaced preserved sample), on a sample whose tokens were stored
        default = None
        if logged_steps and link[0] is None and st.session_state.get("_tok_default_for") != ctx.run_id:
            ov = widgets.cached_overview(ctx.store, ctx.run_id, version, ctx.run)
            default = widgets.cached_token_pick(ctx.store, ctx.run_id, ov.phase_ii_step, version)
            st.session_state["_tok_default_for"] = ctx.run_id
            if default is not None:
                st.session_state["tok_step"] = default.step
                st.session_state["tok_pick"] = (default.sample_idx, default.rank)
                st.session_state["tok_filter"] = "all"
                st.session_state["_tok_why"] = (ctx.run_id, default.step, default.sample_idx, default.rank, default.why)
    except widgets.StoreProblem as exc:
        st.warning(str(exc))
        st.stop()
    if not logged_steps:
        src = (ctx.run or {}).get("source")
        st.info("This run has no token data"
                + (" (runs imported from W&B carry step signals only)." if src == "wandb" else ".")
                + " Token logging is sampled: `RunLogger(token_every=k, token_groups=m)`; the other pages work without it.")
        st.stop()
    c1, c2, c3 = st.columns([1, 1, 1])
    if st.session_state.get("tok_step") not in logged_steps:
        st.session_state["tok_step"] = logged_steps[-1]
    step = c1.select_slider("Step (with token data)", options=logged_steps, key="tok_step") if len(logged_steps) > 1 \
        else c1.selectbox("Step (with token data)", logged_steps, key="tok_step")
    which = c2.radio("Samples", list(tokens.SAMPLE_FILTERS), horizontal=True, key="tok_filter")
    sort = c3.selectbox("Order", list(tokens.SAMPLE_SORTS), format_func=tokens.SAMPLE_SORTS.get, key="tok_sort")
    view = widgets.cached_token_view(ctx.store, ctx.run_id, step, None, 0, which, sort, version)
    if view.samples.empty:
        st.info(f"No {which} samples at step {step}.")
    else:
        options = [(int(r["sample_idx"]), int(r["rank"])) for _, r in view.samples.iterrows()]
        labels = {(int(r["sample_idx"]), int(r["rank"])): tokens.sample_label(r) for _, r in view.samples.iterrows()}
        if st.session_state.get("tok_pick") not in options:
            st.session_state["tok_pick"] = options[0]
        n_tok = int(view.samples["has_tokens"].sum()) if "has_tokens" in view.samples else len(options)
        pick = st.selectbox(f"Sample ({n_tok} of {len(options)} with stored tokens, listed first)", options, key="tok_pick",
                            format_func=lambda o: labels.get(o, str(o)),
                            help="Token logging is sampled (a few groups per logged step); the other samples have "
                                 "their summed Δ but no per-token rows.")
        why = st.session_state.get("_tok_why")
        if why and why[:4] == (ctx.run_id, step, *pick):
            st.caption(why[4])
        color_by = st.radio("Colour by", list(tokens.COLOR_BY), format_func=tokens.COLOR_BY.get, horizontal=True,
                            key="tok_color")
        one = widgets.cached_token_view(ctx.store, ctx.run_id, step, pick[0], pick[1], which, sort, version)
        row = view.samples[(view.samples["sample_idx"] == pick[0]) & (view.samples["rank"] == pick[1])].iloc[0]
        summary = tokens.token_summary(one.tokens)
        m = st.columns(5)
        m[0].metric("Reward", f"{row['reward']:.2f}")
        m[1].metric("Advantage", f"{row['advantage']:+.3f}")
        m[2].metric("Σ Δ (scored tokens)", "—" if summary["delta_sum"] is None else f"{summary['delta_sum']:+.3f}")
        m[3].metric("Actions", summary["actions"])
        m[4].metric("Tool tokens (unscored)", summary["tool"])
        if isinstance(row.get("question"), str) and row.get("question"):
            st.text(f"Question: {row['question']}\nGold: {row.get('gold') or '—'}")  # plain text: no markup from data
        outline = counterfactual_panel.token_outline(ctx, step, pick, row.get("advantage")) if not one.tokens.empty else None
        if one.tokens.empty:
            st.info("No tokens were stored for this sample (token logging is sampled): pick one listed first, "
                    "those have tokens.")
        else:
            scale = tokens.delta_scale(one.tokens) if color_by == "delta" else 1.0
            st.html(tokens.legend_html(color_by, scale, penalized=outline is not None))
            st.html(tokens.token_html(one.tokens, color_by, penalized=outline))
            st.caption("Hover a token for log-prob before / after / ref, Δ and entropy.")
            widgets.plotly(figures.token_delta_figure(one.tokens), key="tok_delta_fig")
    st.subheader(f"Token Δ by role at step {view.step} (nats per token)")
    widgets.plotly(figures.role_delta_distribution(view.step_tokens), key="tok_role_fig")
