"""Phase bands, alert tables and lead times, from the detector's result (lld_monitor.detect) and stored alerts."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lld_monitor.detect import OnlineDetector, iter_signal_rows
from lld_monitor.detect.checkpoint import replay_checkpoint, resume
from lld_monitor.detect.forecast_model import THRESHOLD
from lld_monitor.detect.offline import run_model
from lld_monitor.detect.phases import HEALTHY
from lld_monitor.store import schema

log = logging.getLogger(__name__)

# ---- the dashboard's colours: one home (pages, figures and the sidebar import them from here)
# Runs are coloured by mode, the same on every page (Okabe-Ito, colour-blind safe); a second run of the same
# mode in one chart keeps the colour and gets another dash (figures.run_styles).
MODE_COLORS: dict[str, str] = {"vanilla": "#0072B2", "llds": "#009E73", "llds_ma": "#CC79A7", "unknown": "#6b6b6b"}
MODE_LABELS: dict[str, str] = {"vanilla": "vanilla", "llds": "LLDS", "llds_ma": "LLDS-MA", "unknown": "unknown mode"}
# phases, in the detector's order of severity (lld_monitor.detect.PHASES); keys not listed fall back to grey
PHASE_SOLID: dict[str, str] = {
    "healthy": "#2ea043",
    "stagnation": "#c9a100",
    "decay": "#e67800",
    "acceleration": "#d62728",
    "collapse": "#7a0019",
}
PHASE_COLORS: dict[str, str] = {  # the bands: the same hues, faint
    "healthy": "rgba(46, 160, 67, 0.08)",
    "stagnation": "rgba(201, 161, 0, 0.13)",
    "decay": "rgba(230, 120, 0, 0.16)",
    "acceleration": "rgba(214, 39, 40, 0.16)",
    "collapse": "rgba(122, 0, 25, 0.20)",
}
PHASE_BADGE: dict[str, str] = {"healthy": "green", "stagnation": "yellow", "decay": "orange", "acceleration": "red",
                               "collapse": "red"}
FORECAST_THRESHOLD = THRESHOLD  # p at which the detector raises its forecast alert (the pages draw it)
SEVERITY_COLORS: dict[str, str] = {"info": "#8c8c8c", "warning": "#f28e00", "critical": "#c4001a"}
SEVERITY_MEANING: dict[str, str] = {  # what an alert marker of each severity means (legends, captions)
    "info": "isolated spike",
    "warning": "phase II began",
    "critical": "accelerating / collapsed",
}


def mode_color(mode: str | None) -> str:
    return MODE_COLORS.get(str(mode), MODE_COLORS["unknown"])


def mode_label(mode: str | None) -> str:
    return MODE_LABELS.get(str(mode), str(mode))


def detector_phases() -> tuple[str, ...]:
    """The detector's phase keys in order of severity (read from the detector, never hard-coded here)."""
    from lld_monitor import detect

    return tuple(detect.PHASES)


def phase_ii() -> str:
    """The key of phase II (likelihood decay: the LLD spiral has begun): the detector's third phase."""
    return detector_phases()[2]


def phase_title(phase: str | None) -> str:
    """What a person reads for a phase key: the detector's title when it has one (e.g. "phase II (likelihood
    decay)"), else the key."""
    if phase is None:
        return "no phase"
    try:
        from lld_monitor.detect import phases as dp  # the detector's name table, where it exists
    except ImportError:
        return str(phase)
    return str(getattr(dp, "PHASE_TITLES", {}).get(phase, phase))


def phase_short(phase: str) -> str:
    """A band label: "II · likelihood decay" for "phase II (likelihood decay)"; other titles as they are."""
    title = phase_title(phase)
    if title.startswith("phase ") and "(" in title and title.endswith(")"):
        num, name = title[len("phase "):].split("(", 1)
        return f"{num.strip()} · {name[:-1]}"
    return title


def filter_alerts(alerts: pd.DataFrame | None, severities: tuple[str, ...] | list[str] = ("warning", "critical")) -> pd.DataFrame:
    """The alerts of the given severities (the pages hide `info` by default: isolated spikes)."""
    if alerts is None or len(alerts) == 0:
        return _alerts_frame(None)
    return alerts[alerts["severity"].astype(str).isin(list(severities))].reset_index(drop=True)


SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(schema.SEVERITIES)}
ALERT_COLUMNS = list(schema.ALERT_COLUMNS)


def _alerts_frame(alerts) -> pd.DataFrame:
    if alerts is None:
        return pd.DataFrame(columns=ALERT_COLUMNS)
    if isinstance(alerts, pd.DataFrame):
        df = alerts.copy()
    else:
        rows = [schema.alert_record(a) for a in alerts]
        df = pd.DataFrame(rows, columns=ALERT_COLUMNS)
    for c in ALERT_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df[ALERT_COLUMNS]


@dataclass
class Detection:
    """What the pages need from the detector, with a readable `error` instead of an exception.

    `phase_by_step` (columns step, phase) is the detector's phase after each step; phases can recur
    (e.g. collapse -> decay -> collapse), which the bands keep. `resumed_step`: the step of the detector
    checkpoint the result was restored from (None: replayed from the first step); `replayed`: steps fed to the
    detector for this result.
    """

    phase: str | None = None
    phase_starts: dict[str, int] = field(default_factory=dict)
    collapse_step: int | None = None
    alerts: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ALERT_COLUMNS))
    phase_by_step: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["step", "phase"]))
    error: str | None = None
    resumed_step: int | None = None
    replayed: int = 0
    # (step, p_collapse) before the collapse (lld_monitor.detect.forecast_model); empty without a model
    forecast: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["step", "p_collapse"]))
    forecast_model: str | None = None
    horizon: int | None = None
    pending: bool = False  # the detector is still replaying the run in the background: nothing above is known yet

    @property
    def p_collapse(self) -> float | None:
        """The latest forecast (None: no model, nothing yet, or the reward has collapsed)."""
        if self.collapse_step is not None or self.forecast.empty:
            return None
        return float(self.forecast["p_collapse"].iloc[-1])


def detect(signals: pd.DataFrame) -> Detection:
    """Replay `lld_monitor.detect.OnlineDetector` over a run's signals (what `detect_run` does), recording the
    phase after every step; never raises (the error text is returned)."""
    return DetectionTracker().update(signals)


CACHE_MIN_ROWS = 2000
"""A full replay of at least this many steps is cached beside the run (shorter ones replay in well under a second)."""
BACKGROUND_MIN_ROWS = 1000
"""A run without stored detector state and more rows than this is replayed in a thread (`update(background=True)`)."""


def phase_series(steps: np.ndarray, phase_changes: list[tuple[int, str]], initial: str = "healthy") -> np.ndarray:
    """The phase after each of `steps` (sorted) from the detector's (step, phase entered) changes: the phase of
    the last change at or before the step, `initial` before the first."""
    if not phase_changes:
        return np.full(len(steps), initial, dtype=object)
    at = np.asarray([s for s, _ in phase_changes], dtype="int64")
    names = np.asarray([initial] + [p for _, p in phase_changes], dtype=object)
    return names[np.searchsorted(at, steps, side="right")]


class DetectionTracker:
    """The detector kept warm for one run: each `update(signals)` feeds only the steps after the last one it saw
    (the detector is online), so a refresh costs O(new steps), not a replay of the whole run.

    Its first update restores the detector from the run's checkpoints when one matches the stored rows
    (`checkpoints`: the reader's `detector_state(run_id)` frame, or a function returning it;
    lld_monitor.detect.checkpoint) and replays only the steps after it; without one it replays the run and hands
    the result to `cache` (e.g. to store it beside the run). With `background=True` a replay of more than
    `BACKGROUND_MIN_ROWS` rows runs in a thread instead: `update` returns `Detection(pending=True)` until it is
    done, so a page can draw the run's charts first. The result is always the full replay's. The forecast model is
    the one for the run's columns (`detect.forecast_model.model_for`). Thread-safe; resets itself when the run's rows no
    longer extend what it saw (e.g. a re-import)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._job: threading.Thread | None = None
        self.generation = 0  # counts finished background replays: part of a page's cache key
        self._reset()

    @property
    def replaying(self) -> bool:
        """True while a background replay runs (a page polls on a timer until it ends)."""
        job = self._job
        return job is not None and job.is_alive()

    @property
    def warm(self) -> bool:
        """True once it has seen steps (an update then only costs the new ones)."""
        return self._last is not None

    def _reset(self) -> None:
        self._det = None
        self._last: int | None = None  # the last step fed to the detector
        self._first: int | None = None
        self._rows = 0
        self._resumed: int | None = None
        self._alerts_df: pd.DataFrame | None = None
        self._alerts_n = -1
        self._error: str | None = None

    def update(self, signals: pd.DataFrame, checkpoints=None, cache=None, background: bool = False) -> Detection:
        if signals is None or signals.empty:
            return Detection(error="no steps yet")
        logging.getLogger("lld_monitor.detect").setLevel(logging.ERROR)
        with self._lock:
            if self._job is not None:
                if self._job.is_alive():
                    if background:
                        return Detection(pending=True)
                    self._job.join()  # a caller that cannot draw without the phases waits for the replay
                self._job = None
                if self._error is not None:
                    err, self._error = self._error, None
                    self._reset()
                    return Detection(error=err)
            first = int(signals["step"].min())
            cold = self._det is None or first != self._first or len(signals) < self._rows
            if cold:
                self._reset()
                self._first = first
                try:
                    restored = resume(signals, _load(checkpoints), forecast=_model(signals))
                except Exception:  # noqa: BLE001 - a bad checkpoint must not take the page down: replay instead
                    log.exception("detector checkpoints could not be used")
                    restored = None
                if restored is not None:
                    self._det, self._last, self._resumed = restored.detector, restored.step, restored.step
                else:
                    self._det = OnlineDetector(forecast=_model(signals))
                    if background and len(signals) > BACKGROUND_MIN_ROWS:
                        self._job = threading.Thread(target=self._replay, args=(signals, cache), daemon=True,
                                                     name="detector-replay")
                        self._job.start()
                        return Detection(pending=True)
            try:
                fed = self._feed(signals)
            except Exception as exc:  # a detector bug must not take the page down
                log.exception("detector failed")
                self._reset()
                return Detection(error=f"detector failed: {exc}")
            if cold and self._resumed is None and cache is not None and fed >= CACHE_MIN_ROWS:
                self._write_cache(cache, signals)
            return self._detection(signals, cold, fed)

    def _feed(self, signals: pd.DataFrame) -> int:
        new = signals if self._last is None else signals[signals["step"] > self._last]
        fed = 0
        for step, row in iter_signal_rows(new):
            self._det.update(step, row)
            self._last = step
            fed += 1
        self._rows = len(signals)
        return fed

    def _replay(self, signals: pd.DataFrame, cache) -> None:
        """The background replay of a run without stored detector state; `update` sees the job alive and returns
        pending meanwhile, so nothing else touches the detector."""
        try:
            self._feed(signals)
            if cache is not None:
                self._write_cache(cache, signals)
        except Exception as exc:  # noqa: BLE001
            log.exception("detector replay failed")
            self._error = f"detector failed: {exc}"
        finally:
            self.generation += 1

    def _write_cache(self, cache, signals: pd.DataFrame) -> None:
        try:  # compute once: the next reader of this run restores it instead of replaying
            cache(replay_checkpoint(self._det, signals))
        except Exception:  # noqa: BLE001 - a cache is an optimisation, never an error on the page
            log.exception("detector cache not written")

    def _detection(self, signals: pd.DataFrame, cold: bool, fed: int) -> Detection:
        res = self._det.result()
        if len(res.alerts) != self._alerts_n:
            self._alerts_df, self._alerts_n = _alerts_frame(res.alerts), len(res.alerts)
        steps = np.unique(pd.to_numeric(signals["step"], errors="coerce").dropna().to_numpy(dtype="int64"))
        model = self._det.forecast_model
        return Detection(
            phase=res.phase,
            phase_starts={str(k): int(v) for k, v in (res.phase_starts or {}).items() if v is not None},
            collapse_step=None if res.collapse_step is None else int(res.collapse_step),
            alerts=self._alerts_df.copy(),
            phase_by_step=pd.DataFrame({"step": steps, "phase": phase_series(steps, res.phase_changes, HEALTHY)}),
            resumed_step=self._resumed if cold else None,
            replayed=fed,
            forecast=pd.DataFrame(res.forecast, columns=["step", "p_collapse"]),
            forecast_model=res.forecast_model,
            horizon=model.horizon if model is not None else None,
        )


def _model(signals: pd.DataFrame):
    """The forecast model for this run (`detect.offline.run_model`; none if its file cannot be read: the page
    still draws)."""
    try:
        return run_model(signals)
    except (OSError, ValueError) as exc:
        log.warning("forecast model unavailable (%s); no forecast", exc)
        return None


def _load(checkpoints) -> pd.DataFrame | None:
    """The checkpoints frame (calling the loader if given one); a store that cannot give them means none."""
    if checkpoints is None:
        return None
    try:
        return checkpoints() if callable(checkpoints) else checkpoints
    except Exception as exc:  # noqa: BLE001 - without checkpoints the detector replays: slower, same result
        log.warning("detector checkpoints could not be read (%s); replaying the run", exc)
        return None


def bands_from_series(phase_by_step: pd.DataFrame) -> pd.DataFrame:
    """Run-length bands (phase, start, end) of a per-step phase series. A band covers start <= step < end,
    where end is the next band's start; the last band covers start <= step <= end (the last step)."""
    cols = ["phase", "start", "end"]
    if phase_by_step is None or phase_by_step.empty:
        return pd.DataFrame(columns=cols)
    steps = phase_by_step["step"].to_numpy(dtype="int64")
    ph = phase_by_step["phase"].astype(str).to_numpy()
    change = np.nonzero(np.r_[True, ph[1:] != ph[:-1]])[0]
    rows = []
    for j, i in enumerate(change):
        nxt = change[j + 1] if j + 1 < len(change) else None
        end = int(steps[nxt]) if nxt is not None else int(steps[-1])
        rows.append({"phase": ph[i], "start": int(steps[i]), "end": end})
    return pd.DataFrame(rows, columns=cols)


def merge_alerts(stored: pd.DataFrame | None, detected: pd.DataFrame | None) -> pd.DataFrame:
    """Stored (online) alerts plus offline ones, one row per (step, signal, severity), sorted by step."""
    frames = [_alerts_frame(a) for a in (stored, detected) if a is not None and len(a)]
    if not frames:
        return pd.DataFrame(columns=ALERT_COLUMNS)
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(subset=["step", "signal", "severity"], keep="first")
    return df.sort_values(["step", "signal"], kind="stable").reset_index(drop=True)


def phase_at(bands: pd.DataFrame, step: int) -> str | None:
    if bands is None or bands.empty:
        return None
    hit = bands[(bands["start"] <= step)]
    return None if hit.empty else str(hit.iloc[-1]["phase"])


def lead_table(alerts: pd.DataFrame, collapse_step: int | None) -> pd.DataFrame:
    """Per signal: first alert step, its severity and how many steps it led the reward collapse
    (the detector's collapse_step; positive = earlier). Sorted so the signal that moved first is row 0.
    Phase-transition bookkeeping alerts (signal "phase") are left out.
    """
    cols = ["signal", "first_alert_step", "severity", "phase", "lead_steps", "message"]
    if alerts is None or len(alerts) == 0:
        return pd.DataFrame(columns=cols)
    ref = collapse_step
    df = _alerts_frame(alerts)
    df = df[df["signal"].astype(str) != "phase"].sort_values("step", kind="stable")
    if df.empty:
        return pd.DataFrame(columns=cols)
    first = df.groupby("signal", sort=False).head(1)
    out = pd.DataFrame({
        "signal": first["signal"].astype(str),
        "first_alert_step": first["step"].astype("int64"),
        "severity": first["severity"],
        "phase": first["phase"],
        "lead_steps": (ref - first["step"]).astype("Int64") if ref is not None else pd.array([pd.NA] * len(first), dtype="Int64"),
        "message": first["message"],
    })
    return out.sort_values(["first_alert_step", "signal"], kind="stable").reset_index(drop=True)
