"""Fitting and judging a collapse forecast (forecast_model.py) on runs: labels, features, the logistic fit, k-fold by
run, and the scores (Brier, reliability and ECE, leads, false alarms). numpy and pandas only.

Labels (docs/results/forecast-preregistration.md): at step t of a run whose reward collapses at c (the written
definition), y_t = 1 when t < c <= t + H, else 0; steps t >= c have no forecast; in a run that never collapses
the last H steps are censored (forecast, but left out of the Brier score and the calibration).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .config import DetectorConfig, load_detector_config
from .forecast_model import FEATURES, THRESHOLD, ForecastModel, detector_features, scalar_columns
from .offline import iter_signal_rows, reward_collapse_step
from .online import OnlineDetector

log = logging.getLogger(__name__)

L2_CHOICES = (0.1, 1.0, 10.0, 100.0, 1000.0)
MIN_FEATURE_COVERAGE = 0.5  # a feature is used when it is known on at least this share of the fit rows


class NotEnoughRuns(ValueError):
    """A store with too few runs, or too few collapses, to fit a forecast."""


@dataclass
class RunSteps:
    """One run's steps as the forecast sees them."""

    name: str
    frame: pd.DataFrame  # step, phase, one column per feature, y (NaN: no label), defined (t < collapse)
    collapse_step: int | None


@contextmanager
def _quiet_detector() -> Iterator[None]:
    """No log line per replayed alert (a fit replays every run several times)."""
    lg = logging.getLogger(OnlineDetector.__module__)
    was = lg.disabled
    lg.disabled = True
    try:
        yield
    finally:
        lg.disabled = was


def restrict(signals: pd.DataFrame, inputs: str) -> pd.DataFrame:
    """The columns a model with these `inputs` may see ("all": all of them)."""
    return signals if inputs == "all" else signals[scalar_columns(signals.columns)]


def run_steps(name: str, signals: pd.DataFrame, horizon: int, inputs: str = "all",
              cfg: DetectorConfig | None = None) -> RunSteps:
    """Replay the detector over a run and collect, after each update, its phase and the forecast's features,
    with the labels."""
    cfg = cfg or load_detector_config(None)
    sig = restrict(signals, inputs)
    collapse = reward_collapse_step(sig, cfg)
    det = OnlineDetector(cfg, None)  # the features only: no forecast of its own
    rows = []
    with _quiet_detector():
        for step, row in iter_signal_rows(sig):
            n = det._n_updates
            det.update(step, row)
            if det._n_updates == n:
                continue  # nothing the detector reads: no update, no forecast
            rows.append({"step": step, "phase": det.phase, **detector_features(det)})
    frame = pd.DataFrame(rows, columns=["step", "phase", *FEATURES])
    steps = frame["step"].to_numpy()
    last = int(steps.max()) if len(steps) else 0
    if collapse is None:
        y = np.where(steps <= last - horizon, 0.0, np.nan)
        defined = np.ones(len(steps), dtype=bool)
    else:
        defined = steps < collapse
        y = np.where(defined, ((collapse - steps) <= horizon).astype(float), np.nan)
    frame["y"] = y
    frame["defined"] = defined
    return RunSteps(name, frame, collapse)


# ------------------------------------------------------------------------------------------------ the fit
def _design(frames: Sequence[pd.DataFrame], features: Sequence[str], mean: np.ndarray, scale: np.ndarray
            ) -> np.ndarray:
    x = np.concatenate([f[list(features)].to_numpy(dtype=float) for f in frames]) if frames else np.zeros((0, 0))
    z = (x - mean) / scale
    return np.where(np.isfinite(z), z, 0.0)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, iters: int = 50) -> tuple[np.ndarray, float]:
    """L2-regularized logistic regression (the intercept not penalized) by Newton's method."""
    n, d = x.shape
    a = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(d + 1)
    pen = np.full(d + 1, l2)
    pen[-1] = 0.0
    for _ in range(iters):
        z = np.clip(a @ w, -30, 30)
        p = 1.0 / (1.0 + np.exp(-z))
        grad = a.T @ (p - y) + pen * w
        h = (a * (p * (1 - p))[:, None]).T @ a + np.diag(pen) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(h, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return w[:-1], float(w[-1])


def fit(runs: Sequence[RunSteps], name: str, inputs: str, horizon: int, l2: float,
        features: Sequence[str] = FEATURES, fitted: dict | None = None) -> ForecastModel:
    """A ForecastModel fitted on the labelled steps of `runs`, on those of `features` known on enough rows."""
    frames = [r.frame[r.frame["y"].notna()] for r in runs]
    table = pd.concat(frames) if frames else pd.DataFrame(columns=[*FEATURES, "y"])
    known = table[list(features)].notna().mean()
    features = [f for f in features if known[f] >= MIN_FEATURE_COVERAGE]
    vals = table[list(features)].to_numpy(dtype=float)
    with np.errstate(all="ignore"):
        mean = np.nan_to_num(np.nanmean(vals, axis=0)) if len(vals) else np.zeros(len(features))
        scale = np.nanstd(vals, axis=0) if len(vals) else np.ones(len(features))
    scale = np.where(np.isfinite(scale) & (scale > 1e-12), scale, 1.0)
    coef, intercept = fit_logistic(_design(frames, features, mean, scale), table["y"].to_numpy(dtype=float), l2)
    return ForecastModel(name=name, horizon=horizon, inputs=inputs, features=tuple(features),
                         mean=tuple(map(float, mean)), scale=tuple(map(float, scale)), coef=tuple(map(float, coef)),
                         intercept=intercept, fitted={"l2": l2, **(fitted or {})})


def predict(model: ForecastModel, steps: RunSteps) -> np.ndarray:
    """p at every step of the run's frame (NaN where the forecast is not defined: at and after the collapse)."""
    f = steps.frame
    p = np.array([model.probability(dict(zip(model.features, row))) for row in f[list(model.features)].to_numpy()])
    return np.where(f["defined"].to_numpy(), p, np.nan)


def kfold_predictions(runs: Sequence[RunSteps], k: int, fit_one) -> list[np.ndarray]:
    """Each run's predictions from a model fitted without it (k folds by run, in order)."""
    k = max(2, min(k, len(runs)))
    out: list[np.ndarray] = [np.array([])] * len(runs)
    for fold in range(k):
        test = [i for i in range(len(runs)) if i % k == fold]
        model = fit_one([r for i, r in enumerate(runs) if i % k != fold])
        for i in test:
            out[i] = predict(model, runs[i])
    return out


def choose_l2(runs: Sequence[RunSteps], inputs: str, horizon: int, k: int = 5, features: Sequence[str] = FEATURES
              ) -> tuple[float, dict[float, float]]:
    """The regularization with the lowest k-fold (by run) Brier score on `runs`, and every choice's score."""
    scores = {}
    for l2 in L2_CHOICES:
        preds = kfold_predictions(runs, k, lambda rs, l2=l2: fit(rs, "cv", inputs, horizon, l2, features))
        scores[l2] = scores_of(runs, preds).brier
    return min(scores, key=lambda v: (scores[v], v)), scores


def check_enough(runs: Sequence[RunSteps], min_runs: int = 6, min_collapses: int = 2) -> None:
    n_collapse = sum(r.collapse_step is not None for r in runs)
    n_healthy = len(runs) - n_collapse
    if len(runs) < min_runs or n_collapse < min_collapses or n_healthy < 1:
        raise NotEnoughRuns(
            f"a forecast needs at least {min_runs} runs, {min_collapses} of them with a reward collapse and one "
            f"without; this store has {len(runs)} run(s) with steps, {n_collapse} collapsed and {n_healthy} did not. "
            "Log more runs (or use the shipped model)")


# ------------------------------------------------------------------------------------------------ scores
@dataclass
class Scores:
    brier: float
    base_rate: float
    n: int
    reliability: pd.DataFrame  # bin, lo, hi, n, mean_p, rate
    ece: float
    leads: dict[str, int | None]  # collapse run -> lead of the first p >= 0.5 before it (None: never)
    median_lead: float | None
    max_p_no_collapse: dict[str, float]  # run that never collapses -> its highest p


def reliability(p: np.ndarray, y: np.ndarray, bins: int = 10) -> tuple[pd.DataFrame, float]:
    """10 equal-width bins of p: count, mean p, observed rate; and the expected calibration error."""
    idx = np.minimum((p * bins).astype(int), bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        m = idx == b
        n = int(m.sum())
        mp, rate = (float(p[m].mean()), float(y[m].mean())) if n else (math.nan, math.nan)
        if n:
            ece += n / len(p) * abs(mp - rate)
        rows.append({"bin": b, "lo": b / bins, "hi": (b + 1) / bins, "n": n, "mean_p": mp, "rate": rate})
    return pd.DataFrame(rows), float(ece) if len(p) else math.nan


def scores_of(runs: Sequence[RunSteps], preds: Sequence[np.ndarray]) -> Scores:
    ps, ys = [], []
    leads: dict[str, int | None] = {}
    max_p: dict[str, float] = {}
    for r, p in zip(runs, preds):
        y = r.frame["y"].to_numpy(dtype=float)
        ok = np.isfinite(y) & np.isfinite(p)
        ps.append(p[ok])
        ys.append(y[ok])
        steps = r.frame["step"].to_numpy()
        if r.collapse_step is not None:
            warned = np.flatnonzero((p >= THRESHOLD) & (steps < r.collapse_step))
            leads[r.name] = int(r.collapse_step - steps[warned[0]]) if warned.size else None
        else:
            max_p[r.name] = float(np.nanmax(p)) if np.isfinite(p).any() else math.nan
    p_all = np.concatenate(ps) if ps else np.array([])
    y_all = np.concatenate(ys) if ys else np.array([])
    table, ece = reliability(p_all, y_all)
    lead_vals = [v if v is not None else 0 for v in leads.values()]
    return Scores(
        brier=float(np.mean((p_all - y_all) ** 2)) if len(p_all) else math.nan,
        base_rate=float(y_all.mean()) if len(y_all) else math.nan, n=len(p_all), reliability=table, ece=ece,
        leads=leads, median_lead=float(np.median(lead_vals)) if lead_vals else None, max_p_no_collapse=max_p)


def constant_baseline(runs: Sequence[RunSteps], rate: float) -> list[np.ndarray]:
    return [np.where(r.frame["defined"].to_numpy(), rate, np.nan) for r in runs]


def phase_rates(runs: Sequence[RunSteps]) -> dict[str, float]:
    """The rate of y = 1 among the labelled steps of each detector phase (the phase rule's p)."""
    t = pd.concat([r.frame[r.frame["y"].notna()][["phase", "y"]] for r in runs])
    return {str(k): float(v) for k, v in t.groupby("phase")["y"].mean().items()}


def phase_baseline(runs: Sequence[RunSteps], rates: dict[str, float], fallback: float) -> list[np.ndarray]:
    return [np.where(r.frame["defined"].to_numpy(), r.frame["phase"].map(rates).fillna(fallback).to_numpy(float),
                     np.nan) for r in runs]
