"""Offline detection over a finished (or running) run: a replay of `OnlineDetector`, so its alerts are
exactly those the online detector raised on the same steps."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pandas as pd

from lld_monitor import signals as registry
from lld_monitor.store.schema import ALERT_COLUMNS

from .config import DetectorConfig
from .forecast_model import AUTO, ForecastModel, model_for, scalar_columns
from .online import Alert, DetectionResult, OnlineDetector
from .signal_sources import KNOWN_COLUMNS, SIGNAL_CANDIDATES

REWARD_COLUMNS: frozenset[str] = frozenset(
    key for src in registry.detector_candidates("reward")
    for key in (*src.parts, *([src.only_if_positive] if src.only_if_positive else [])))
"""Every column a reward candidate reads."""

log = logging.getLogger(__name__)



def _prepare(signals_df: pd.DataFrame) -> pd.DataFrame:
    if not isinstance(signals_df, pd.DataFrame):
        raise TypeError(f"detect_run needs a pandas DataFrame (StoreReader.signals(run_id)), got {type(signals_df).__name__}")
    if "step" not in signals_df.columns:
        raise ValueError(
            "detect_run: the table has no 'step' column; pass StoreReader.signals(run_id) or a DataFrame with "
            f"a 'step' column and signal columns (got columns: {', '.join(map(str, signals_df.columns[:12]))})"
        )
    df = signals_df
    steps = pd.to_numeric(df["step"], errors="coerce")
    if steps.isna().any():
        log.warning("detect_run: %d rows without a numeric step dropped", int(steps.isna().sum()))
    df = df.assign(step=steps).dropna(subset=["step"])
    df = df.sort_values("step", kind="stable")
    dup = df["step"].duplicated(keep="last")
    if dup.any():
        log.warning("detect_run: %d duplicate steps; the last row of each is used", int(dup.sum()))
        df = df[~dup]
    return df


def iter_signal_rows(signals_df: pd.DataFrame):
    """(step, {column: value}) per row, in step order, with only the columns the detector reads."""
    df = _prepare(signals_df)
    cols = [c for c in df.columns if c in KNOWN_COLUMNS]
    vals = {}
    for c in cols:
        vals[c] = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    steps = df["step"].to_numpy(dtype=np.int64)
    for i, s in enumerate(steps):
        yield int(s), {c: vals[c][i] for c in cols}


def one_view(signals_df: pd.DataFrame, forecast: ForecastModel) -> bool:
    """True when one detector can name the phases and make the forecast: the model sees every column, or the
    columns it may not see hold no value. (`detect_run` with an explicit scalars model on a run that logs more runs a
    second detector on `scalar_columns`; AUTO never needs one: it picks the scalars model only for a run without
    lld-monitor's own signals, whose columns are what verl or TRL logged.)"""
    if forecast.inputs == "all":
        return True
    hidden = set(signals_df.columns) - set(scalar_columns(signals_df.columns))
    return not any(signals_df[c].notna().any() for c in hidden)


def run_model(signals_df: pd.DataFrame) -> ForecastModel | None:
    """The model the online detector chose for this run (`forecast=AUTO`): `model_for` its first row."""
    for _, row in iter_signal_rows(signals_df):
        return model_for(row)
    return model_for({})


def detect_run(signals_df: pd.DataFrame, cfg: DetectorConfig | None = None,
               forecast: ForecastModel | str | None = AUTO) -> DetectionResult:
    """Run the detector over a whole run. `signals_df` = StoreReader.signals(run_id): one row per step,
    canonical STEP_SIGNALS columns and/or raw verl / TRL metric keys; whatever is present is used. The result also
    holds p_collapse at every step before the collapse (forecast_model.py) from `forecast`: AUTO (the model RunLogger's
    detector chose, `model_for` the first row: online == offline), a model, or None (no forecast)."""
    if isinstance(forecast, ForecastModel) and not one_view(signals_df, forecast):
        # a scalars model sees only what verl / TRL log: its forecast comes from a detector fed those columns,
        # the phases and alerts from the one that sees everything
        res = detect_run(signals_df, cfg, None)
        scalars = detect_run(signals_df[scalar_columns(signals_df.columns)], cfg, forecast)
        return replace(res, forecast=[(s, p) for s, p in scalars.forecast
                                      if res.collapse_step is None or s < res.collapse_step],
                       forecast_model=scalars.forecast_model,
                       alerts=sorted(res.alerts + [a for a in scalars.alerts if a.signal == "forecast"],
                                     key=lambda a: a.step))
    det = OnlineDetector(cfg, forecast)
    for step, row in iter_signal_rows(signals_df):
        det.update(step, row)
    return det.result()


def alerts_frame(alerts: list[Alert]) -> pd.DataFrame:
    """Alerts as a DataFrame with the columns of schema.ALERTS minus run_id."""
    return pd.DataFrame([a.to_dict() for a in alerts], columns=list(ALERT_COLUMNS))


def reward_collapse_step(signals_df: pd.DataFrame, cfg: DetectorConfig | None = None) -> int | None:
    """The reward-collapse step of a run by the written definition (see lld_monitor.detect.online):
    the first step of `collapse_patience` consecutive reward points whose trailing mean is below
    `collapse_frac` x its running peak. None if the run never collapsed. Same computation as the
    online detector's `collapse_step` (it is the same class)."""
    # the reward source is chosen as the online detector chooses it (highest-priority candidate,
    # upgraded during warm-up); feeding the detector's own signal tracks keeps the two identical.
    det = OnlineDetector(cfg, None)
    # only the reward: the other signals never touch the reward's source or its collapse (10x faster)
    cols = [c for c in signals_df.columns if c == "step" or c in REWARD_COLUMNS]
    for step, row in iter_signal_rows(signals_df[cols]):
        det._ingest(step, row, [], ("reward",))
        if det._reward.collapse_step is not None:
            return det._reward.collapse_step
    return None


REWARD_DECLINE_FRAC = 0.8
"""The reward's 20 % decline: the collapse definition with this fraction instead of `collapse_frac`."""


def reward_decline_step(signals_df: pd.DataFrame, cfg: DetectorConfig | None = None) -> int | None:
    """First step of the reward's 20 % decline: `reward_collapse_step` with `collapse_frac` =
    REWARD_DECLINE_FRAC (the smoothed reward below 0.8 x its running peak for `collapse_patience` points).
    The reference a post-mortem or an evaluation uses when a run declines without collapsing."""
    return reward_collapse_step(signals_df, replace(cfg or DetectorConfig(), collapse_frac=REWARD_DECLINE_FRAC))


def reward_series(signals_df: pd.DataFrame) -> tuple[str | None, pd.Series]:
    """(column, reward by step) using the detector's reward candidates, for plots and evaluation."""
    df = _prepare(signals_df)
    for cand in SIGNAL_CANDIDATES["reward"]:
        if cand.label in df.columns:
            s = pd.to_numeric(df[cand.label], errors="coerce")
            if s.notna().any():
                return cand.label, pd.Series(s.to_numpy(dtype=float), index=df["step"].astype(int).to_numpy())
    return None, pd.Series(dtype=float)
