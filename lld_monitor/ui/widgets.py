"""Streamlit pieces the pages share: the store + run sidebar, cached data access, status and empty states.

Caching: `runs()` is re-read every REFRESH_S seconds; per-run data is cached under a *version* of the run
(rows stored, last step, status, heartbeat), so a finished run is read once and a live run is re-read
exactly when it changed. One thread-safe StoreReader per store folder is shared (st.cache_resource);
it holds no lock on the store and sees new segments on every query.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import streamlit as st

from lld_monitor.store import dashboard_store_path
from lld_monitor.store.location import canonical, exists_locally, is_bucket
from lld_monitor.ui import phase_bands as ph
from lld_monitor.ui import queries as q

log = logging.getLogger(__name__)

REFRESH_S = 2.0
OPEN_RUN_ENV = "LLD_MONITOR_DASHBOARD_RUN"  # run id or name to open when the URL names none (`lld-monitor demo`)
PHASE_BADGE = ph.PHASE_BADGE
WHAT_TO_WATCH = (
    "**What to watch.** In the LLD death spiral the **log-likelihood of correct responses** (2nd panel) stops "
    "rising (phase I, stagnation), then falls while the reward still holds (phase II: the spiral has begun, and "
    "Δ of preserved responses turns negative); entropy and grad norm surge (phase III), and only then does the "
    "**reward** collapse. Shaded bands are the detector's phases, ▼ its alerts; drag to zoom (all panels follow), "
    "double-click to reset."
)
STATUS_BADGE = {"running": "blue", "finished": "gray", "crashed": "red"}


def default_store() -> str:
    return dashboard_store_path()


# ------------------------------------------------------------------ store access


class StoreProblem(Exception):
    """A store that cannot be shown; the message is the text the page displays."""


def _open(path: str):
    from lld_monitor.store import NewerSchemaError, NotAStoreError, StoreError, open_store_reader

    if is_bucket(path):
        try:
            return open_store_reader(path)
        except (NotAStoreError, NewerSchemaError) as exc:
            raise StoreProblem(f"`{path}` is not a readable lld-monitor store: {exc}") from exc
        except StoreError as exc:
            raise StoreProblem(f"Cannot read the store `{path}`: {exc}") from exc
    p = Path(path).expanduser()
    if not p.exists():
        raise StoreProblem(
            f"No store at `{p}`. Start one with `lld-monitor demo` or `lld-monitor train --store {p}`, "
            "or type the folder of an existing store in the sidebar."
        )
    try:
        return open_store_reader(str(p))
    except NotAStoreError as exc:
        raise StoreProblem(f"`{p}` is not an lld-monitor store: {exc}") from exc
    except NewerSchemaError as exc:
        raise StoreProblem(f"`{p}` was written by a newer lld-monitor: {exc}") from exc
    except StoreError as exc:
        raise StoreProblem(f"Cannot read the store `{p}`: {exc}") from exc


@st.cache_resource(max_entries=8, show_spinner=False)
def _reader(resolved: str):
    """One StoreReader per store (folder or bucket prefix), shared by all sessions (it is thread-safe, re-reads the runs'
    manifests on every query and never locks anything the writer needs)."""
    return _open(resolved)


def with_reader(path: str, fn, *args, **kwargs):
    """fn(reader, ...) on the store at `path`; store errors become a StoreProblem with the text to show."""
    from lld_monitor.store import RunNotFoundError, StoreError

    resolved = canonical(path)
    if not exists_locally(resolved):
        _reader.clear()
        _open(resolved)  # raises the "no store" StoreProblem
    reader = _reader(resolved)
    try:
        return fn(reader, *args, **kwargs)
    except RunNotFoundError as exc:
        raise StoreProblem(f"{exc}. It may have been deleted or re-imported; pick another run.") from exc
    except StoreError as exc:
        raise StoreProblem(f"The store `{path}` could not be read just now ({exc}). "
                           "It is retried on the next refresh.") from exc


@st.cache_data(ttl=REFRESH_S, max_entries=32, show_spinner=False)
def cached_runs(path: str) -> pd.DataFrame:
    return with_reader(path, q.runs_table)


def run_version(runs: pd.DataFrame, run_id: str) -> tuple:
    """Changes whenever the run gets new rows or a new status; the key of every per-run cache."""
    row = runs[runs["run_id"] == run_id]
    if row.empty:
        return (run_id,)
    r = row.iloc[0]
    return (run_id, str(r.get("status")), str(r.get("steps")), str(r.get("last_step")), str(r.get("updated_at")))


@st.cache_resource(max_entries=256, show_spinner=False)
def tracker(path: str, run_id: str) -> ph.DetectionTracker:
    """The warm detector of one run (shared by sessions): a refresh feeds it only the new steps."""
    return ph.DetectionTracker()


# a few entries: each holds the run's signals (a 200,000-step run: ~60 MB pickled), and a live run makes a new
# version every refresh, so old entries are only memory
def cached_overview(path: str, run_id: str, version: tuple, run: dict | None = None) -> q.RunOverview:
    """The run's overview; a long run without stored detector state gets its charts at once and its phases,
    alerts and forecast when the detector's background replay is done (`ov.detection.pending` until then: the
    tracker's generation, part of the cache key, moves when it finishes). `run` (the sidebar's row) saves a
    runs() scan."""
    return _cached_overview(path, run_id, version, tracker(path, run_id).generation, run)


@st.cache_data(max_entries=12, show_spinner=False)
def _cached_overview(path: str, run_id: str, version: tuple, generation: int, _run: dict | None) -> q.RunOverview:
    return with_reader(path, q.run_overview, run_id, tracker=tracker(path, run_id), run=_run, background=True)


def cached_phase(path: str, run_id: str, version: tuple) -> str | None:
    return _cached_phase(path, run_id, version, tracker(path, run_id).generation)


@st.cache_data(max_entries=256, show_spinner=False)
def _cached_phase(path: str, run_id: str, version: tuple, generation: int) -> str | None:
    return with_reader(path, q.run_phase, run_id, tracker=tracker(path, run_id), background=True)


@st.cache_data(max_entries=64, show_spinner=False)
def cached_compare(path: str, run_ids: tuple[str, ...], names: tuple[str, ...], versions: tuple) -> dict:
    return with_reader(path, q.compare_frames, list(run_ids), list(names))


@st.cache_data(max_entries=64, show_spinner=False)
def cached_signals(path: str, run_id: str, version: tuple) -> pd.DataFrame:
    return with_reader(path, lambda r: r.signals(run_id))


@st.cache_data(max_entries=64, show_spinner=False)
def cached_token_steps(path: str, run_id: str, version: tuple) -> list[int]:
    return with_reader(path, q.token_steps, run_id)


@st.cache_data(max_entries=64, show_spinner=False)
def cached_token_view(path: str, run_id: str, step, sample_idx, rank, which: str, sort: str, version: tuple) -> q.TokenView:
    steps = cached_token_steps(path, run_id, version)
    return with_reader(path, q.token_view, run_id, step, sample_idx, rank, which, sort, steps=steps)


@st.cache_data(max_entries=64, show_spinner=False)
def cached_token_pick(path: str, run_id: str, phase_ii_step: int | None, version: tuple) -> q.TokenPick | None:
    steps = cached_token_steps(path, run_id, version)
    return with_reader(path, q.best_token_pick, run_id, steps, phase_ii_step)


@st.cache_data(max_entries=8, show_spinner=False)
def cached_post_mortem(path: str, run_id: str, k: int, version: tuple, _run: dict | None = None) -> q.PostMortem:
    """Without the onset table (`cached_onsets`): the page draws this first."""
    return with_reader(path, q.post_mortem, run_id, k, tracker=tracker(path, run_id), run=_run, with_onsets=False)


@st.cache_data(max_entries=16, show_spinner=False)
def cached_onsets(path: str, run_id: str, reference_step: int | None, version: tuple) -> tuple[pd.DataFrame, pd.DataFrame]:
    return with_reader(path, q.onsets, run_id, reference_step)


@st.cache_data(max_entries=8, show_spinner=False)
def cached_export(path: str, run_id: str, version: tuple) -> dict:
    return with_reader(path, q.run_export_tables, run_id)


# ------------------------------------------------------------------ sidebar context


@dataclass
class Context:
    store: str
    runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    run_id: str | None = None
    problem: str | None = None

    @property
    def run(self) -> dict | None:
        if self.run_id is None or self.runs.empty:
            return None
        row = self.runs[self.runs["run_id"] == self.run_id]
        if row.empty:
            return None
        return {k: (None if (v is pd.NA or v is pd.NaT) else v) for k, v in row.iloc[0].to_dict().items()}

    def version(self, run_id: str | None = None) -> tuple:
        return run_version(self.runs, run_id or self.run_id)


def _qp(name: str) -> str | None:
    v = st.query_params.get(name)
    return None if v in (None, "") else str(v)


@st.cache_data(ttl=REFRESH_S, max_entries=32, show_spinner=False)
def cached_stored_phases(path: str) -> dict[str, str]:
    return with_reader(path, q.stored_phases)


def _phase_for(store: str, runs: pd.DataFrame, run_id: str, selected: bool) -> str | None:
    """The selected run's phase from its warm detector; other runs: the detector's if it is already warm
    for them (cheap), else their latest stored alert's phase (no replay of every run on page load)."""
    try:
        if selected:  # the page shows this run's overview: compute it once, here, and the page reads the cache
            row = runs[runs["run_id"] == run_id].iloc[0].to_dict()
            row = {k: (None if (v is pd.NA or v is pd.NaT) else v) for k, v in row.items()}
            return cached_overview(store, run_id, run_version(runs, run_id), row).detection.phase
        if tracker(store, run_id).warm:
            return cached_phase(store, run_id, run_version(runs, run_id))
        return cached_stored_phases(store).get(run_id)
    except StoreProblem:
        return None


def sidebar() -> Context:
    """Store location and run picker (with mode, source, status and phase); stores the Context for the page."""
    sb = st.sidebar
    if "store_path" not in st.session_state:
        st.session_state["store_path"] = _qp("store") or default_store()
    store = sb.text_input("Store location", key="store_path",
                          help="Folder of an lld-monitor store, or a bucket prefix such as s3://bucket/runs (read with the "
                          "AWS_* variables of the server's environment; default: the bundled sample_runs/).").strip()
    ctx = Context(store=store)
    try:
        ctx.runs = cached_runs(store)
    except StoreProblem as exc:
        ctx.problem = str(exc)
    if ctx.problem is None and ctx.runs.empty:
        ctx.problem = (f"The store `{store}` has no runs yet. Start one with "
                       f"`lld-monitor train --store {store}` or `lld-monitor demo`; runs appear here within seconds.")
    if ctx.problem is not None:
        sb.warning(ctx.problem)
        st.session_state["lld_ctx"] = ctx
        return ctx

    ids = list(ctx.runs["run_id"])
    qp_run = _qp("run")
    if qp_run is not None and qp_run != st.session_state.get("_qp_run_seen"):
        st.session_state["_qp_run_seen"] = qp_run
        match = ctx.runs[(ctx.runs["run_id"] == qp_run) | (ctx.runs["name"] == qp_run)]
        if not match.empty:
            st.session_state["run_id"] = str(match.iloc[0]["run_id"])
            st.session_state["_run_auto"] = False
    preferred = os.environ.get(OPEN_RUN_ENV) or None
    auto = st.session_state.get("_run_auto", True)  # nobody picked a run yet (no ?run=, no click)
    waiting = bool(preferred) and preferred_waiting(ctx.runs, preferred)
    arrived = auto and not waiting and st.session_state.pop("_run_waited", False)  # the awaited run just appeared
    if st.session_state.get("run_id") not in ids or arrived:
        st.session_state["run_id"] = q.default_run(ctx.runs, preferred)
    chosen = st.session_state["run_id"]
    phases = {rid: _phase_for(store, ctx.runs, rid, rid == chosen) for rid in ids}
    labels = {rid: q.run_label(ctx.runs[ctx.runs["run_id"] == rid].iloc[0], phases[rid]) for rid in ids}
    ctx.run_id = sb.selectbox("Run", ids, key="run_id", format_func=lambda rid: labels.get(rid, rid),
                              on_change=_picked, help="name · mode (when the name does not say it) · live / crashed · phase")
    if auto and waiting:
        st.session_state["_run_waited"] = True
        _wait_for_run(store, preferred)
    if st.query_params.get("run") != ctx.run_id:
        st.query_params["run"] = ctx.run_id
        st.session_state["_qp_run_seen"] = ctx.run_id
    run = ctx.run or {}
    with sb.container():
        phase = phases.get(ctx.run_id)
        status_txt, phase_txt = str(run.get("status")), (ph.phase_title(phase) if phase else "no phase")
        # one line of badges that wraps (two fixed columns cut a long phase title)
        sb.markdown(f":{STATUS_BADGE.get(status_txt, 'gray')}-badge[{status_txt}] "
                    f":{PHASE_BADGE.get(phase or '', 'gray')}-badge[{phase_txt}]")
        steps = "" if run.get("status") == "running" else f"{run.get('steps', 0)} steps · "  # live count: on the page
        sb.caption(f"**{run.get('name')}** · mode **{ph.mode_label(run.get('mode'))}** · source **{run.get('source')}** · "
                   f"{steps}{len(ids)} run(s) in store")
    st.session_state["lld_ctx"] = ctx
    return ctx


def _picked() -> None:
    st.session_state["_run_auto"] = False


def preferred_waiting(runs: pd.DataFrame, preferred: str) -> bool:
    """True while the run to open (`OPEN_RUN_ENV`, e.g. the demo's live vanilla run) is not in the store yet."""
    return not ((runs["run_id"].astype(str) == preferred) | (runs["name"].astype(str) == preferred)).any()


def _wait_for_run(store: str, preferred: str) -> None:
    """Sidebar note + a 2 s poll that switches the page to the awaited run once it logged its first step."""
    st.sidebar.caption(f"Waiting for **{preferred}** (warm start); the page switches to it when it starts logging.")

    @st.fragment(run_every=REFRESH_S)
    def _poll() -> None:
        try:
            runs = cached_runs(store)
        except StoreProblem:
            return
        if not preferred_waiting(runs, preferred):
            st.rerun()

    with st.sidebar:
        _poll()


def current() -> Context:
    """The Context that app.py's sidebar made for this script run (renders the sidebar when a page runs alone)."""
    ctx = st.session_state.get("lld_ctx")
    if not isinstance(ctx, Context) or ctx.store != st.session_state.get("store_path"):
        ctx = sidebar()
    return ctx


def require_run(ctx: Context) -> bool:
    """Shows the designed empty state and returns False when there is no run to show."""
    if ctx.problem:
        st.info(ctx.problem)
        return False
    if ctx.run_id is None:
        st.info("Pick a run in the sidebar.")
        return False
    return True


def status_line(ov: q.RunOverview) -> None:
    """live / finished / crashed, steps and time since the last step."""
    st_ = ov.status
    label = {"running": "live", "finished": "finished", "crashed": "crashed"}.get(st_, st_)
    c = st.columns(4)
    c[0].metric("Status", label)
    c[1].metric("Steps logged", ov.n_steps)
    c[2].metric("Last step", "—" if ov.last_step is None else ov.last_step)
    c[3].metric("Since last step", q.humanize_seconds(ov.seconds_since_last_step))
    if st_ == "crashed":
        st.warning("The writer of this run is gone (crashed or killed); data up to its last flush is shown.")
    for note in ov.notes:
        st.caption(note)


def step_range_control(signals: pd.DataFrame, key: str) -> tuple[int, int] | None:
    """For a run too long to draw every point: a "steps shown" range slider and a caption saying how the chart is
    drawn. Returns the chosen (first, last) step, or None for the whole run (and for runs drawn in full).
    While a live run grows, a range that ends at the last step keeps following it."""
    from lld_monitor.ui import figures

    if not figures.downsampled(signals):
        return None
    steps = pd.to_numeric(signals["step"], errors="coerce").dropna()
    lo, hi = int(steps.min()), int(steps.max())
    end_key = f"{key}__end"
    value = st.session_state.get(key)
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        value = (lo, hi)
    a, b = int(value[0]), int(value[1])
    if b == st.session_state.get(end_key, b) or b > hi:  # it followed the end: keep following
        b = hi
    a = min(max(a, lo), b)
    st.session_state[key] = (a, b)
    st.session_state[end_key] = hi
    chosen = st.slider("Steps shown", lo, hi, key=key, step=1,
                       help="Narrow the range to see every logged step of it; the phases and the smoothing are the "
                            "whole run's.")
    n = int(((steps >= chosen[0]) & (steps <= chosen[1])).sum())
    if figures.downsampled(signals, chosen):
        st.caption(f"{n:,} steps drawn at the chart's resolution: the first, lowest, highest and last point of each "
                   f"pixel column, so spikes and the collapse stay where they are. Narrow *Steps shown* to "
                   f"{figures.MAX_POINTS:,} steps or fewer to see every point.")
    else:
        st.caption(f"Every one of the {n:,} steps in this range is drawn.")
    return None if (chosen[0], chosen[1]) == (lo, hi) else (int(chosen[0]), int(chosen[1]))


def plotly(fig, key: str | None = None) -> None:
    """Every chart: full width, Plotly's modebar always shown, with its PNG download (camera icon, 2x scale)."""
    st.plotly_chart(fig, width="stretch", key=key,
                    config={"displaylogo": False, "displayModeBar": True,
                            "toImageButtonOptions": {"format": "png", "scale": 2}})


def safe_name(name: str) -> str:
    """A file-name-safe version of a run name (downloads)."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name))[:80] or "run"


TOKEN_PAGE = Path(__file__).resolve().parents[2] / "pages" / "token_inspector.py"


def token_link(run_id: str, step: int, sample_idx: int, rank: int, label: str) -> None:
    """A link into the token inspector at (run, step, sample, rank) via query parameters."""
    st.page_link(str(TOKEN_PAGE), label=label, icon=":material/text_fields:",
                 query_params={"run": run_id, "step": str(int(step)), "sample": str(int(sample_idx)), "rank": str(int(rank))})
