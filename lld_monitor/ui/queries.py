"""The dashboard's data functions: a StoreReader in, DataFrames out (no Streamlit).

Every page gets its data through these, so tests and `bench/dashboard_queries.py` call exactly what the
pages call. Extra SQL lives here only, always parameterized (`reader.sql(query, params)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pandas as pd

from lld_monitor.ui import phase_bands as ph
from lld_monitor.ui import series as sig

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
    """One short line for the run picker (the sidebar is narrow): name, then the mode when the name does not
    say it, "imported" for a run that did not come from a local trainer, "live" / "crashed" (a finished run
    says nothing), and the phase. The full row is in the caption under the picker."""
    name = str(row.get("name") or row.get("run_id"))
    mode = str(row.get("mode"))
    mode_txt = {"llds_ma": "llds-ma"}.get(mode, mode)
    bits = [name]
    if mode_txt not in name.lower() and mode not in name.lower() and mode not in ("None", "unknown"):
        bits.append(mode_txt)
    if str(row.get("source")) not in ("local", "None"):
        bits.append(str(row.get("source")))
    status = {"running": "live", "crashed": "crashed"}.get(str(row.get("status")))
    if status:
        bits.append(status)
    if phase:
        bits.append(phase)
    return " · ".join(bits)


def default_run(runs: pd.DataFrame, preferred: str | None = None) -> str | None:
    """The run a page opens on when the URL names none: `preferred` (a run id or name) when the store has it,
    else the newest live vanilla run (the one to watch), the newest live run, the newest vanilla run (the
    spiral's story), the newest run. `runs` as from runs_table (newest first)."""
    if runs is None or runs.empty:
        return None
    if preferred:
        hit = runs[(runs["run_id"].astype(str) == preferred) | (runs["name"].astype(str) == preferred)]
        if len(hit):
            return str(hit.iloc[0]["run_id"])
    live = runs["status"].astype(str) == "running"
    vanilla = runs["mode"].astype(str) == "vanilla"
    for m in (live & vanilla, live, vanilla):
        if m.any():
            return str(runs[m].iloc[0]["run_id"])
    return str(runs.iloc[0]["run_id"])


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

    @property
    def phase_ii_step(self) -> int | None:
        """The step where the detector first saw phase II (likelihood decay), None when it never did."""
        return self.detection.phase_starts.get(ph.phase_ii())


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
                 tracker: ph.DetectionTracker | None = None, run: dict | None = None,
                 background: bool = False) -> RunOverview:
    """The run row, its signals, detector result (phases, alerts, forecast) and live status.

    `tracker`: a DetectionTracker kept for this run between refreshes (only new steps are fed to the
    detector); None replays the whole run. `run`: the run's row when the caller already has it (the
    sidebar's runs table), else it is read. `background`: a long run without stored detector state is replayed
    in a thread; until it is done the overview has the signals and stored alerts, `detection.pending` is True."""
    run = dict(run) if run is not None else dict(reader.run(run_id))
    signals = reader.signals(run_id)
    stored = reader.alerts(run_id)
    detection = run_detection(reader, run_id, signals, tracker, background)
    alerts = ph.merge_alerts(stored, detection.alerts)
    notes = []
    if detection.error:
        notes.append(f"Phases: {detection.error}.")
    if detection.pending:
        notes.append(f"Phases, alerts and the collapse forecast are being computed: this run has no stored detector "
                     f"state, so its {len(signals):,} steps are replayed once (then stored beside it); they appear "
                     "here when that is done.")
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


def run_detection(reader, run_id: str, signals: pd.DataFrame, tracker: ph.DetectionTracker | None = None,
                  background: bool = False) -> ph.Detection:
    """The detector over the run's signals: a warm `tracker` feeds only new steps; a cold one restores the
    detector from the run's checkpoints (written online by RunLogger) and replays only the steps after them.
    A run without usable checkpoints (imported, older) is replayed once and the result cached beside it
    (store/detector_cache.py), so the next reader does not replay it. The result is the full replay's."""
    from lld_monitor.store.detector_cache import write_detector_cache

    return (tracker or ph.DetectionTracker()).update(
        signals, checkpoints=lambda: reader.detector_state(run_id),
        cache=lambda row: write_detector_cache(reader.location, run_id, row), background=background)


def run_phase(reader, run_id: str, tracker: ph.DetectionTracker | None = None, background: bool = False) -> str | None:
    """The run's current phase (detector on its signals), None when it has no steps (or, with `background`, while
    a long run without stored detector state is being replayed)."""
    return run_detection(reader, run_id, reader.signals(run_id), tracker, background).phase


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
    samples: pd.DataFrame  # the step's samples, those with stored tokens first (column has_tokens)
    tokens: pd.DataFrame
    step_tokens: pd.DataFrame


def token_view(reader, run_id: str, step: int | None = None, sample_idx: int | None = None, rank: int = 0,
               which: str = "all", sort: str = "delta_asc", steps: list[int] | None = None) -> TokenView:
    """What the token inspector shows: logged steps, the step's samples (filtered, sorted; the ones whose
    tokens were stored first, the others marked has_tokens=False), one sample's tokens and the step's token Δ
    per role. Defaults: the last logged step, the first sample of the sort that has tokens.
    `steps`: the run's token steps when the caller has them (they change only when the run grows)."""
    from lld_monitor.ui.tokens import filter_samples

    steps = token_steps(reader, run_id) if steps is None else list(steps)
    if not steps:
        empty = pd.DataFrame()
        return TokenView([], None, empty, empty, empty)
    if step is None or int(step) not in steps:
        step = steps[-1]
    step_tokens = reader.tokens(run_id, int(step))  # one read: the distribution and the sample both come from it
    keys = set()
    if len(step_tokens):
        keys = set(zip(step_tokens["rank"].astype(int), step_tokens["sample_idx"].astype(int)))
    samples = filter_samples(step_samples(reader, run_id, step), which, sort)
    if len(samples):
        has = [(int(r), int(i)) in keys for r, i in zip(samples["rank"], samples["sample_idx"])]
        samples = samples.assign(has_tokens=has)
        samples = samples.sort_values("has_tokens", ascending=False, kind="stable").reset_index(drop=True)
    else:
        samples = samples.assign(has_tokens=pd.Series([], dtype=bool))
    if sample_idx is None and len(samples):
        sample_idx, rank = int(samples.iloc[0]["sample_idx"]), int(samples.iloc[0]["rank"])
    if sample_idx is not None and len(step_tokens):
        m = (step_tokens["sample_idx"] == int(sample_idx)) & (step_tokens["rank"] == int(rank))
        tokens = step_tokens[m].reset_index(drop=True)
    else:
        tokens = pd.DataFrame(columns=step_tokens.columns)
    cols = ["role", "logp_old", "logp_new"]
    deltas = step_tokens[cols] if len(step_tokens) else pd.DataFrame(columns=cols)
    return TokenView(steps, int(step), samples, tokens, deltas)


@dataclass
class TokenPick:
    step: int
    sample_idx: int
    rank: int
    why: str  # one line for the page: why the inspector opened here


def best_token_pick(reader, run_id: str, steps: list[int] | None = None,
                    phase_ii_step: int | None = None) -> TokenPick | None:
    """Where the token inspector opens: the sample that best shows displacement and has stored tokens.

    The preserved (advantage >= 0) sample with the most negative Δ at the first token-logged step at or after
    the run entered phase II; else (no phase II) the most negative preserved Δ over every token-logged step;
    else any sample with tokens at the last token-logged step. None when the run has no token data."""
    steps = token_steps(reader, run_id) if steps is None else list(steps)
    if not steps:
        return None
    query = (
        "SELECT s.step, s.sample_idx, s.rank, s.delta_sum FROM samples s"
        " WHERE s.run_id = ? AND s.advantage >= 0 AND s.delta_sum IS NOT NULL AND s.step BETWEEN ? AND ?"
        "  AND EXISTS (SELECT 1 FROM tokens t WHERE t.run_id = s.run_id AND t.step = s.step AND t.rank = s.rank"
        "   AND t.sample_idx = s.sample_idx)"
        " ORDER BY s.delta_sum, s.step, s.rank, s.sample_idx LIMIT 1"
    )

    def _pick(lo: int, hi: int):
        df = reader.sql(query, [run_id, int(lo), int(hi)])
        return None if df.empty else df.iloc[0]

    if phase_ii_step is not None:
        at = [s for s in steps if s >= int(phase_ii_step)]
        if at:
            row = _pick(at[0], at[0])
            if row is not None:
                return TokenPick(int(row["step"]), int(row["sample_idx"]), int(row["rank"]),
                                 f"Opened at step {int(row['step'])}, the first token-logged step after the run "
                                 f"entered phase II (step {int(phase_ii_step)}): the preserved sample whose "
                                 f"likelihood fell most (Σ Δ {float(row['delta_sum']):+.3f}).")
    row = _pick(min(steps), max(steps))
    if row is not None:
        return TokenPick(int(row["step"]), int(row["sample_idx"]), int(row["rank"]),
                         f"Opened on the preserved sample whose likelihood fell most over the run's token-logged "
                         f"steps (step {int(row['step'])}, Σ Δ {float(row['delta_sum']):+.3f}).")
    t = reader.tokens(run_id, int(steps[-1]))
    if t.empty:
        return None
    first = t.iloc[0]
    return TokenPick(int(steps[-1]), int(first["sample_idx"]), int(first["rank"]),
                     f"Opened at the last token-logged step ({int(steps[-1])}).")


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
    # min_by(..., k): a k-row heap per band instead of sorting all preserved samples for a row_number (faster
    # on long runs, docs/dashboard.md); the key orders ties by step, rank, sample_idx, as the table shows them
    out = reader.sql(
        "SELECT * FROM ("
        " SELECT phase, lo, unnest(top, recursive := true) FROM ("
        "  SELECT b.phase, b.lo, min_by({'step': s.step, 'rank': s.rank, 'sample_idx': s.sample_idx,"
        "   'reward': s.reward, 'advantage': s.advantage, 'correct': s.correct, 'delta_sum': s.delta_sum,"
        "   'delta_mean': s.delta_mean}, (s.delta_sum, s.step, s.rank, s.sample_idx), ?) AS top"
        "  FROM samples s JOIN (SELECT unnest(?::VARCHAR[]) AS phase, unnest(?::BIGINT[]) AS lo,"
        "                              unnest(?::BIGINT[]) AS hi) b ON s.step >= b.lo AND s.step < b.hi"
        "  WHERE s.run_id = ? AND s.advantage >= 0 AND s.delta_sum IS NOT NULL"
        "   AND (? OR list_contains(?::BIGINT[], s.step))"
        "  GROUP BY b.phase, b.lo)"
        ") ORDER BY lo, delta_sum, step, rank, sample_idx",
        [int(k), [f"{i}:{p}" for i, p in enumerate(bands["phase"])], [int(x) for x in bands["start"]],
         [int(x) for x in bands["end"][:-1]] + [int(bands["end"].iloc[-1]) + 1], run_id,
         not token_step_set, sorted(token_step_set)],
    )
    # a NaN Δ is no displacement; DuckDB sorts NaN last, so dropping them here leaves the top k of the rest
    # (not in SQL: DuckDB 2.0.1 gave isnan() = false on NaN rows of a Parquet scan with a filter on another column)
    out = out[out["delta_sum"].notna()]
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
                run: dict | None = None, with_onsets: bool = True) -> PostMortem:
    """Everything the post-mortem page shows. `with_onsets=False` leaves the onset table empty: it is the slow
    part on a long run (an exact change-point search per signal: ~1 s per 16,000 points), so the page draws the
    rest first and fetches it with `onsets()`."""
    from lld_monitor.detect import post_mortem_reference

    ov = run_overview(reader, run_id, tracker=tracker, run=run)
    if ov.n_steps:
        ref, kind = post_mortem_reference(ov.signals, collapse_step=ov.detection.collapse_step)
        onsets, spikes = onsets_before(ov.signals, ref) if with_onsets else (pd.DataFrame(), pd.DataFrame())
    else:
        ref, kind, onsets, spikes = None, "none", pd.DataFrame(), pd.DataFrame()
    leads = ph.lead_table(ov.alerts, ref)
    top = top_displaced_samples(reader, run_id, ov.bands, k=k)
    return PostMortem(ov, leads, ref, kind, top, onsets, spikes)


def onsets_before(signals: pd.DataFrame, reference_step: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(onsets, isolated spikes) of every detector signal up to `reference_step` (lld_monitor.detect.onset_table)."""
    from lld_monitor.detect import onset_table

    return onset_table(signals, reference_step)


def onsets(reader, run_id: str, reference_step: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The post-mortem's "what moved first" table of a run (see `post_mortem`)."""
    signals = reader.signals(run_id)
    if signals.empty:
        return pd.DataFrame(), pd.DataFrame()
    return onsets_before(signals, reference_step)


def to_csv_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode("utf-8")


def to_parquet_bytes(df: pd.DataFrame) -> bytes:
    import io

    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()
