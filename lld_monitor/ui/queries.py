"""The dashboard's data functions: a StoreReader in, DataFrames out (no Streamlit).

Every page gets its data through these, so tests and `bench/dashboard_queries.py` call exactly what the
pages call. Extra SQL lives here only, always parameterized (`reader.sql(query, params)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pandas as pd

from lld_monitor.ui import phases as ph
from lld_monitor.ui import signals as sig

# ------------------------------------------------------------------ runs / sidebar


def runs_table(reader) -> pd.DataFrame:
    """All runs, newest first (the reader's runs() columns)."""
    runs = reader.runs()
    if runs is None or runs.empty:
        return pd.DataFrame(columns=["run_id", "name", "mode", "source", "status", "steps", "last_step"])
    if "started_at" in runs.columns:
        runs = runs.sort_values("started_at", ascending=False, na_position="last", kind="stable")
    return runs.reset_index(drop=True)


def run_label(row: dict | pd.Series, phase: str | None = None) -> str:
    """One line for the run picker: name · mode · source · status · phase."""
    bits = [str(row.get("name") or row.get("run_id")), str(row.get("mode")), str(row.get("source")), str(row.get("status"))]
    if phase:
        bits.append(phase)
    return " · ".join(bits)


# ------------------------------------------------------------------ live health / overview


@dataclass
class RunOverview:
    """Everything the Live-health page draws for one run."""

    run: dict
    signals: pd.DataFrame
    detection: ph.Detection
    alerts: pd.DataFrame  # stored (online) + offline detector alerts
    bands: pd.DataFrame
    status: str
    last_step: int | None
    n_steps: int
    seconds_since_last_step: float | None
    notes: list[str] = field(default_factory=list)


def _as_utc(ts) -> datetime | None:
    if ts is None or (isinstance(ts, float) and math.isnan(ts)):
        return None
    try:
        t = pd.Timestamp(ts)
    except (TypeError, ValueError):
        return None
    if pd.isna(t):
        return None
    if t.tzinfo is None:
        t = t.tz_localize("UTC")
    return t.to_pydatetime()


def run_overview(reader, run_id: str, now: datetime | None = None,
                 tracker: ph.DetectionTracker | None = None, run: dict | None = None) -> RunOverview:
    """The run row, its signals, detector result (phases, alerts) and live status.

    `tracker`: a DetectionTracker kept for this run between refreshes (only new steps are fed to the
    detector); None replays the whole run. `run`: the run's row when the caller already has it (the
    sidebar's runs table), else it is read."""
    run = dict(run) if run is not None else dict(reader.run(run_id))
    signals = reader.signals(run_id)
    stored = reader.alerts(run_id)
    detection = (tracker or ph.DetectionTracker()).update(signals)
    alerts = ph.merge_alerts(stored, detection.alerts)
    notes = []
    if detection.error:
        notes.append(f"Phases: {detection.error}.")
    n = int(len(signals))
    last = int(signals["step"].iloc[-1]) if n else None
    bands = ph.bands_from_series(detection.phase_by_step)
    # time since the last step: the step's own timestamp, else the run's heartbeat
    last_time = None
    if n and "time" in signals.columns:
        last_time = _as_utc(signals["time"].dropna().max() if signals["time"].notna().any() else None)
    if last_time is None:
        last_time = _as_utc(run.get("updated_at"))
    now = now or datetime.now(timezone.utc)
    since = None if last_time is None else max(0.0, (now - last_time).total_seconds())
    return RunOverview(run=run, signals=signals, detection=detection, alerts=alerts, bands=bands,
                       status=str(run.get("status")), last_step=last, n_steps=n,
                       seconds_since_last_step=since, notes=notes)


def run_phase(reader, run_id: str, tracker: ph.DetectionTracker | None = None) -> str | None:
    """The run's current phase (detector on its signals), None when it has no steps."""
    return (tracker or ph.DetectionTracker()).update(reader.signals(run_id)).phase


def stored_phases(reader) -> dict[str, str]:
    """run_id -> the phase of its latest stored alert (the online detector stores one at every phase change)."""
    df = reader.sql("SELECT run_id, arg_max(phase, step) AS phase FROM alerts GROUP BY run_id")
    return {str(a): str(b) for a, b in zip(df["run_id"], df["phase"]) if b is not None}


def humanize_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.0f} days"


# ------------------------------------------------------------------ compare


def compare_frames(reader, run_ids: list[str], names: list[str]) -> dict[str, pd.DataFrame]:
    """run_id -> canonical frame (step + the asked signals that the run has)."""
    out = {}
    for rid in run_ids:
        s = reader.signals(rid)
        f = sig.canonical_frame(s, names)
        for n in names:  # raw metric keys picked by the user
            if n not in f.columns and n in s.columns:
                f[n] = pd.to_numeric(s[n], errors="coerce").to_numpy()
        out[rid] = f
    return out


# ------------------------------------------------------------------ token inspector


def token_steps(reader, run_id: str) -> list[int]:
    return [int(s) for s in reader.token_steps(run_id)]


def step_samples(reader, run_id: str, step: int) -> pd.DataFrame:
    return reader.samples(run_id, step=int(step))


def sample_tokens(reader, run_id: str, step: int, sample_idx: int, rank: int = 0) -> pd.DataFrame:
    return reader.tokens(run_id, int(step), sample_idx=int(sample_idx), rank=int(rank))


def step_token_deltas(reader, run_id: str, step: int) -> pd.DataFrame:
    """role, logp_old, logp_new of every token at the step (only the columns the distribution needs)."""
    t = reader.tokens(run_id, int(step))
    return t[["role", "logp_old", "logp_new"]] if len(t) else pd.DataFrame(columns=["role", "logp_old", "logp_new"])


@dataclass
class TokenView:
    steps: list[int]
    step: int | None
    samples: pd.DataFrame
    tokens: pd.DataFrame
    step_tokens: pd.DataFrame


def token_view(reader, run_id: str, step: int | None = None, sample_idx: int | None = None, rank: int = 0,
               which: str = "all", sort: str = "delta_asc", steps: list[int] | None = None) -> TokenView:
    """What the token inspector shows: logged steps, the step's samples (filtered, sorted), one sample's
    tokens and the step's token Δ per role. Defaults: the last logged step, the first sample of the sort.
    `steps`: the run's token steps when the caller has them (they change only when the run grows)."""
    from lld_monitor.ui.tokens import filter_samples

    steps = token_steps(reader, run_id) if steps is None else list(steps)
    if not steps:
        empty = pd.DataFrame()
        return TokenView([], None, empty, empty, empty)
    if step is None or int(step) not in steps:
        step = steps[-1]
    samples = filter_samples(step_samples(reader, run_id, step), which, sort)
    if sample_idx is None and len(samples):
        sample_idx, rank = int(samples.iloc[0]["sample_idx"]), int(samples.iloc[0]["rank"])
    step_tokens = reader.tokens(run_id, int(step))  # one read: the distribution and the sample both come from it
    if sample_idx is not None and len(step_tokens):
        m = (step_tokens["sample_idx"] == int(sample_idx)) & (step_tokens["rank"] == int(rank))
        tokens = step_tokens[m].reset_index(drop=True)
    else:
        tokens = pd.DataFrame(columns=step_tokens.columns)
    cols = ["role", "logp_old", "logp_new"]
    deltas = step_tokens[cols] if len(step_tokens) else pd.DataFrame(columns=cols)
    return TokenView(steps, int(step), samples, tokens, deltas)


# ------------------------------------------------------------------ post-mortem


def top_displaced_samples(reader, run_id: str, bands: pd.DataFrame, k: int = 5) -> pd.DataFrame:
    """Per phase band: the k preserved (advantage ≥ 0) samples whose summed log-likelihood fell most.

    When the run has token data, only samples at token-logged steps are ranked (each row then links into
    the token inspector); otherwise all samples are (has_tokens False).
    Columns: phase, step, rank, sample_idx, reward, advantage, correct, delta_sum, delta_mean, has_tokens.
    """
    cols = ["phase", "step", "rank", "sample_idx", "reward", "advantage", "correct", "delta_sum", "delta_mean", "has_tokens"]
    if bands is None or bands.empty:
        return pd.DataFrame(columns=cols)
    token_step_set = set(token_steps(reader, run_id))
    out = reader.sql(
        "SELECT * FROM ("
        " SELECT b.phase, s.step, s.rank, s.sample_idx, s.reward, s.advantage, s.correct, s.delta_sum, s.delta_mean,"
        "  row_number() OVER (PARTITION BY b.phase ORDER BY s.delta_sum, s.step, s.rank, s.sample_idx) AS rn,"
        "  b.lo"
        " FROM samples s JOIN (SELECT unnest(?::VARCHAR[]) AS phase, unnest(?::BIGINT[]) AS lo,"
        "                             unnest(?::BIGINT[]) AS hi) b ON s.step >= b.lo AND s.step < b.hi"
        " WHERE s.run_id = ? AND s.advantage >= 0 AND s.delta_sum IS NOT NULL"
        "  AND (? OR list_contains(?::BIGINT[], s.step))"
        ") WHERE rn <= ? ORDER BY lo, rn",
        [[f"{i}:{p}" for i, p in enumerate(bands["phase"])], [int(x) for x in bands["start"]],
         [int(x) for x in bands["end"][:-1]] + [int(bands["end"].iloc[-1]) + 1], run_id,
         not token_step_set, sorted(token_step_set), int(k)],
    )
    if out.empty:
        return pd.DataFrame(columns=cols)
    out["phase"] = out["phase"].str.split(":", n=1).str[1]  # band index kept a recurring phase's bands apart
    out["has_tokens"] = out["step"].astype(int).isin(token_step_set)
    return out[cols].reset_index(drop=True)


def run_export_tables(reader, run_id: str) -> dict[str, pd.DataFrame]:
    """The run's tables for download: signals (steps + metrics wide), samples, alerts."""
    return {
        "signals": reader.signals(run_id),
        "samples": reader.samples(run_id),
        "alerts": reader.alerts(run_id),
    }


@dataclass
class PostMortem:
    overview: RunOverview
    leads: pd.DataFrame  # first alert per signal (ph.lead_table)
    reference_step: int | None
    reference_kind: str  # "reward collapse", "reward 20 % decline" or "none" (detect.post_mortem_reference)
    top: pd.DataFrame
    # what moved first, by onset of each signal's sustained change (lld_monitor.detect.onset_table)
    onsets: pd.DataFrame = field(default_factory=pd.DataFrame)
    spikes: pd.DataFrame = field(default_factory=pd.DataFrame)  # isolated spikes, listed apart


def post_mortem(reader, run_id: str, k: int = 5, tracker: ph.DetectionTracker | None = None,
                run: dict | None = None) -> PostMortem:
    from lld_monitor.detect import onset_table, post_mortem_reference

    ov = run_overview(reader, run_id, tracker=tracker, run=run)
    if ov.n_steps:
        ref, kind = post_mortem_reference(ov.signals)
        onsets, spikes = onset_table(ov.signals, ref)
    else:
        ref, kind, onsets, spikes = None, "none", pd.DataFrame(), pd.DataFrame()
    leads = ph.lead_table(ov.alerts, ref)
    top = top_displaced_samples(reader, run_id, ov.bands, k=k)
    return PostMortem(ov, leads, ref, kind, top, onsets, spikes)


def to_csv_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode("utf-8")


def to_parquet_bytes(df: pd.DataFrame) -> bytes:
    import io

    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()
