"""Detector checkpoints: the online detector's state, saved as a run is written, so a reader replays only the tail.

A **checkpoint** is one row of the store's `detector_state` table (columns: `store.schema.DETECTOR_STATE`):
the detector's whole state after `step` (`OnlineDetector.to_state()`, JSON), the alerts and phase changes it
raised since the previous checkpoint of the same detector (its *lineage*), the fingerprint of its config, and a
**digest** of every row it consumed. RunLogger writes one every `CHECKPOINT_EVERY` steps and one at the end
(`CheckpointRecorder`); the dashboard writes one beside a run it had to replay in full (a cache, see
`lld_monitor.store.detector_cache`).

A reader (`resume`) trusts a checkpoint only when what it would replay is exactly what the detector saw: the
same config fingerprint, and the digest of the stored rows up to the checkpoint's step (as `detect_run` reads
them: sorted, duplicate steps keep the last row, the detector's columns only) equals the checkpoint's. The
detector is deterministic, so restoring the state and replaying the rows after it gives the full replay's
alerts and phases, bit for bit. Anything else (a resumed run whose second detector started mid-run, rows
logged twice, another config, a damaged checkpoint) fails the check and that checkpoint is not used: the
reader falls back to an earlier checkpoint or to a full replay. Being faster never changes what is shown.

Digest: chained SHA-256 over the consumed rows, each row the float64 vector [step, value of every column in
`DIGEST_COLUMNS`] (a missing value is NaN, the detector treats both alike); checkpoint k's digest =
sha256(digest of checkpoint k-1 as bytes + the rows consumed since).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from lld_monitor.signals import as_number

from .config import DetectorConfig, load_detector_config
from .forecast_model import AUTO, ForecastModel
from .offline import _prepare, iter_signal_rows, run_model
from .online import Alert, OnlineDetector
from .signal_sources import KNOWN_COLUMNS

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 500
"""RunLogger saves the detector's state every this many steps (and at the end): a reader of a live run replays
at most this many steps (about 0.1-0.2 s on a 2-core CPU)."""
STATE_FORMAT = 1
"""Version of the JSON in `state`; a checkpoint of another format is ignored (full replay instead)."""
DIGEST_COLUMNS: tuple[str, ...] = tuple(sorted(KNOWN_COLUMNS))
"""The columns a digest covers, in this order: every column any detector signal reads."""
CACHE_LINEAGE = "cache"
"""Lineage prefix of a checkpoint the dashboard computed from a full replay (one row, seq 0, everything)."""


def config_fingerprint(cfg: DetectorConfig, forecast: ForecastModel | None = None) -> str:
    """A short stable id of a detector config and its forecast model: checkpoints are only valid for what they ran
    with."""
    text = json.dumps(asdict(cfg), sort_keys=True, allow_nan=True)
    if forecast is not None:
        text += "|forecast:" + forecast.fingerprint
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _json(obj: object) -> str:
    return json.dumps(obj, allow_nan=True, separators=(",", ":"))


def _alert_row(a: Alert) -> list:
    return [a.step, a.phase, a.severity, a.signal, a.value, a.threshold, a.message]


def _alert_from_row(r: list) -> Alert:
    return Alert(step=int(r[0]), phase=str(r[1]), severity=str(r[2]), signal=str(r[3]), value=float(r[4]),
                 threshold=float(r[5]), message=str(r[6]))


def row_vector(step: int, signals: Mapping[str, object]) -> np.ndarray:
    """The digest's vector of one row as the online detector is fed it (missing or non-numeric = NaN)."""
    out = np.full(len(DIGEST_COLUMNS) + 1, np.nan)
    out[0] = float(step)
    for i, c in enumerate(DIGEST_COLUMNS, start=1):
        v = as_number(signals.get(c))  # what the detector's sources read (signals.Source.read)
        if v is not None and not math.isnan(v):
            out[i] = v
    return out


def signal_matrix(signals_df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(steps, rows) of a run's signals as `detect_run` replays them: sorted, duplicate steps keep the last row;
    rows[i] = the digest vector of step i (C order, so a slice of rows hashes like the same rows fed online)."""
    df = _prepare(signals_df)
    steps = df["step"].to_numpy(dtype=np.int64)
    mat = np.full((len(df), len(DIGEST_COLUMNS) + 1), np.nan)
    mat[:, 0] = steps
    for i, c in enumerate(DIGEST_COLUMNS, start=1):
        if c in df.columns:  # the conversion iter_signal_rows makes
            mat[:, i] = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    mat[np.isnan(mat)] = np.nan  # one NaN bit pattern
    return steps, mat


def _chain(prev_digest: str, rows: np.ndarray) -> str:
    h = hashlib.sha256(bytes.fromhex(prev_digest))
    h.update(np.ascontiguousarray(rows, dtype=np.float64).tobytes())
    return h.hexdigest()


class CheckpointRecorder:
    """Feeds an OnlineDetector and keeps what a checkpoint needs: the digest of the rows fed, and the alerts and
    phase changes since the last checkpoint. Used on RunLogger's writer thread (one per run, rank 0).

        rec = CheckpointRecorder(OnlineDetector(cfg))
        alerts = rec.update(step, signals)          # instead of detector.update(step, signals)
        if rec.due: writer.append("detector_state", rec.checkpoint())
    """

    def __init__(self, detector: OnlineDetector, every: int = CHECKPOINT_EVERY, lineage: str | None = None) -> None:
        if every < 1:
            raise ValueError("checkpoint every >= 1 steps")
        self.detector = detector
        self.every = int(every)
        self.lineage = lineage or secrets.token_hex(8)
        self.seq = 0
        self.rows = 0
        self._digest = ""
        self._hash = hashlib.sha256()
        self._since = 0
        self._alerts_at = len(detector.alerts)
        self._changes_at = len(detector.phase_changes)
        self._forecast_at = len(detector.forecast)
        self._last_step: int | None = None

    def update(self, step: int, signals: Mapping[str, object]) -> list[Alert]:
        out = self.detector.update(step, signals)
        self._hash.update(row_vector(step, signals).tobytes())
        self.rows += 1
        self._since += 1
        self._last_step = int(step)
        return out

    @property
    def due(self) -> bool:
        """True when `every` rows were fed since the last checkpoint."""
        return self._since >= self.every

    @property
    def pending(self) -> bool:
        """True when rows were fed since the last checkpoint (the final one at close)."""
        return self._since > 0

    def checkpoint(self) -> dict[str, list]:
        """The `detector_state` row (without run_id, as one-row columns for `RunWriter.append`) for everything
        fed so far; starts the next chunk."""
        det = self.detector
        self._digest = self._hash.hexdigest()
        self._hash = hashlib.sha256(bytes.fromhex(self._digest))
        row = {
            "step": self._last_step, "lineage": self.lineage, "seq": self.seq,
            "config": config_fingerprint(det.cfg, det.forecast_model),  # the model is known after the first row
            "digest": self._digest, "rows": self.rows,
            "state": _json({"format": STATE_FORMAT, **det.to_state()}),
            "alerts": _json([_alert_row(a) for a in det.alerts[self._alerts_at:]]),
            "phase_changes": _json([[int(s), p] for s, p in det.phase_changes[self._changes_at:]]),
            "forecast": _json([[int(s), p] for s, p in det.forecast[self._forecast_at:]]),
        }
        self.seq += 1
        self._since = 0
        self._alerts_at = len(det.alerts)
        self._changes_at = len(det.phase_changes)
        self._forecast_at = len(det.forecast)
        return {k: [v] for k, v in row.items()}


def replay_checkpoint(detector: OnlineDetector, signals_df: pd.DataFrame) -> dict[str, list]:
    """The one-row checkpoint (as columns) of a detector that was fed exactly `signals_df` from a fresh start (a
    full replay): the dashboard stores it beside an imported or old run so the next reader skips the replay."""
    steps, mat = signal_matrix(signals_df)
    cfg = config_fingerprint(detector.cfg, detector.forecast_model)
    row = {
        "step": int(steps[-1]) if len(steps) else None, "lineage": f"{CACHE_LINEAGE}-{cfg}", "seq": 0, "config": cfg,
        "digest": _chain("", mat), "rows": int(len(steps)),
        "state": _json({"format": STATE_FORMAT, **detector.to_state()}),
        "alerts": _json([_alert_row(a) for a in detector.alerts]),
        "phase_changes": _json([[int(s), p] for s, p in detector.phase_changes]),
        "forecast": _json([[int(s), p] for s, p in detector.forecast]),
    }
    return {k: [v] for k, v in row.items()}


@dataclass
class Resumed:
    """A detector restored from the latest trustworthy checkpoint, and where the replay has to go on."""

    detector: OnlineDetector
    step: int  # the last step the checkpoint covers
    rows: int  # rows of the prepared signals it covers (replay from this index)
    lineage: str


def _valid_prefix(group: pd.DataFrame, steps: np.ndarray, mat: np.ndarray) -> list[Mapping]:
    """The checkpoints of one lineage, in order, whose chained digests match the stored rows."""
    out: list[Mapping] = []
    prev_digest, prev_i = "", 0
    for expect, row in enumerate(group.sort_values("seq", kind="stable").to_dict("records")):
        if int(row["seq"]) != expect or row["step"] is None or pd.isna(row["step"]):
            break
        i = int(np.searchsorted(steps, int(row["step"]), side="right"))
        if i != int(row["rows"]) or i <= prev_i or i == 0 or int(steps[i - 1]) != int(row["step"]):
            break
        digest = _chain(prev_digest, mat[prev_i:i])
        if digest != row["digest"]:
            break
        out.append(row)
        prev_digest, prev_i = digest, i
    return out


def resume(signals_df: pd.DataFrame, checkpoints: pd.DataFrame | None,
           cfg: DetectorConfig | None = None, forecast: ForecastModel | str | None = AUTO) -> Resumed | None:
    """Restore the detector from the furthest checkpoint that matches `signals_df` (see the module docstring);
    None when none does. Never raises on a bad checkpoint: it is skipped with a log line. `forecast`: AUTO (the
    model RunLogger's detector chose for this run), a model, or None."""
    if checkpoints is None or len(checkpoints) == 0 or signals_df is None or signals_df.empty:
        return None
    cfg = cfg or load_detector_config(None)
    forecast = run_model(signals_df) if forecast == AUTO else forecast
    fp = config_fingerprint(cfg, forecast)
    ck = checkpoints[checkpoints["config"].astype(str) == fp]
    if ck.empty:
        log.info("detector checkpoints were made with another config; full replay")
        return None
    steps, mat = signal_matrix(signals_df)
    best: list[Mapping] = []
    for _, group in ck.groupby("lineage", sort=False):
        try:
            valid = _valid_prefix(group, steps, mat)
        except (TypeError, ValueError, KeyError) as exc:
            log.warning("a detector checkpoint could not be read (%s); skipped", exc)
            continue
        if valid and (not best or int(valid[-1]["rows"]) > int(best[-1]["rows"])):
            best = valid
    if not best:
        return None
    try:
        state = json.loads(best[-1]["state"])
        if state.get("format") != STATE_FORMAT:
            log.info("detector checkpoint of format %r (this code reads %d); full replay", state.get("format"),
                     STATE_FORMAT)
            return None
        alerts = [_alert_from_row(r) for row in best for r in json.loads(row["alerts"])]
        changes = [(int(s), str(p)) for row in best for s, p in json.loads(row["phase_changes"])]
        if forecast is not None and any(not isinstance(row.get("forecast"), str) for row in best):
            log.info("detector checkpoints without a forecast; full replay")
            return None
        history = [(int(s), float(p)) for row in best for s, p in json.loads(row["forecast"])] if forecast else []
        det = OnlineDetector.from_state(state, cfg, alerts, changes, forecast, history)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        log.warning("detector checkpoint at step %s could not be restored (%s); full replay", best[-1]["step"], exc)
        return None
    return Resumed(detector=det, step=int(best[-1]["step"]), rows=int(best[-1]["rows"]),
                   lineage=str(best[-1]["lineage"]))


def detect_resumed(signals_df: pd.DataFrame, checkpoints: pd.DataFrame | None | Callable[[], pd.DataFrame],
                   cfg: DetectorConfig | None = None, forecast: ForecastModel | str | None = AUTO
                   ) -> tuple[OnlineDetector, int]:
    """The detector (with `forecast`) after every row of `signals_df`: restored from a checkpoint where one
    matches, the rest replayed. Returns (detector, rows replayed). Same result as `detect_run(signals_df, cfg,
    forecast)`."""
    ck = checkpoints() if callable(checkpoints) else checkpoints
    if forecast == AUTO and signals_df is not None and not signals_df.empty:
        forecast = run_model(signals_df)
    res = resume(signals_df, ck, cfg, forecast)
    if res is None:
        det, start = OnlineDetector(cfg, forecast), 0
    else:
        det, start = res.detector, res.rows
    df = _prepare(signals_df)
    tail = df.iloc[start:]
    for step, row in iter_signal_rows(tail):
        det.update(step, row)
    return det, len(tail)
