"""The collapse forecast: `p_collapse` at step t = the probability that the reward collapses (the written
definition, `detect.reward_collapse_step`) in steps t+1 ... t+H, from the signals logged up to t.

It is a logistic model over what the online detector holds after its update at step t (`detector_features`):
the reward against its running peak, its trend and the steps until that trend reaches the collapse line, the
correct-response likelihood's trend z-score and its drop below its peak, the share and mean of the displacement of
preserved responses, how far entropy, grad norm, the PPO KL and the clip fraction stand above their baselines,
the phase and how long it has lasted. So the forecast is computed online, step by step, inside `OnlineDetector`
(its checkpoints carry it; online == offline), costs a few hundred microseconds a step, and needs numpy only.

A model is a small JSON file (`ForecastModel`): the features, their standardization, the coefficients, the
horizon, which columns it is meant to see (`inputs`: "all", or "scalars" = what verl and TRL log by default
plus the LLDS authors' own metrics, `scalar_columns`), and how and on what it was fitted. Two are shipped
(`forecast_models/`); `lld-monitor forecast fit` fits one on a store of your own runs (`forecast_fit.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lld_monitor import signals as registry

from .phases import ACCELERATION, DECAY, STAGNATION
from .stats import theil_sen

HORIZON = 30
"""Steps ahead the shipped models predict a collapse within."""
THRESHOLD = 0.5
"""p at which the detector raises its forecast alert (once per run, the first time p reaches it)."""
MODELS_DIR = Path(__file__).with_name("forecast_models")
AUTO = "auto"
"""`OnlineDetector(cfg, forecast=AUTO)` (RunLogger's default): the model is chosen at the first row by `model_for`."""
MODEL_ENV = "LLD_MONITOR_FORECAST_MODEL"
"""A model file (`lld-monitor forecast fit --out`) that replaces the shipped ones everywhere: RunLogger, `detect`,
`forecast` and the dashboard (`lld-monitor serve --forecast-model FILE` sets it)."""
INPUTS = ("all", "scalars")
SCALAR_PREFIXES = ("actor/", "critic/", "env/", "response_length/", "prompt_length/", "timing_s/", "train/",
                   "clip_ratio/", "completions/", "rewards/")
"""Key prefixes of what a verl / Search-R1 or TRL run logs by default (the LLDS authors' `actor/...` metrics too)."""
FRAMEWORKS = ("verl", "search-r1", "trl")


def _framework_keys() -> frozenset[str]:
    """Every key verl / Search-R1 / TRL log for a registry signal."""
    return frozenset(k for sig in registry.SIGNALS for src in sig.sources if src.framework in FRAMEWORKS
                     for k in src.parts)


_SCALAR_KEYS = _framework_keys()
_STORE_COLUMNS = frozenset(sig.name for sig in registry.SIGNALS if sig.stored)


FEATURES: tuple[str, ...] = (
    "reward_vs_peak", "reward_z", "ll_z", "ll_drop", "disp_neg_share", "disp_mean",
    "entropy_surge", "grad_norm_surge", "ppo_kl_surge", "clip_frac_surge",
    "phase_stagnation", "phase_decay", "phase_acceleration", "phase_age", "steps_to_line",
)
"""What `detector_features` computes (a model uses all of them or a subset)."""
LINE_WINDOW = 20
"""Reward points whose trend `steps_to_line` extrapolates to the collapse line."""
LINE_MAX_STEPS = 500.0
"""`steps_to_line` when the reward is not falling (log1p of it: the feature's ceiling)."""


def scalar_columns(columns: Iterable[str]) -> list[str]:
    """The columns a scalars model may see: `step` and the keys verl / TRL log by default (and the LLDS authors'
    metrics), as logged. Not the store's own columns, not even those the W&B importer fills from these keys: a run
    of ours carries its own values there (our entropy, our likelihoods), so a run and its W&B import would be two
    views. Through the raw keys they are one (bench/forecast_eval.py checks it)."""
    return [c for c in columns if c == "step" or (c not in _STORE_COLUMNS and (c in _SCALAR_KEYS
                                                                                or str(c).startswith(SCALAR_PREFIXES)))]


def _clip(x: float, lo: float, hi: float) -> float:
    return float(min(max(x, lo), hi))


def detector_features(det: Any) -> dict[str, float]:
    """The forecast's inputs from an `OnlineDetector`'s state after its update at this step (NaN: not known yet).
    (`det` is not annotated with its class: the detector imports this module.)"""
    c = det.cfg
    nan = math.nan
    f: dict[str, float] = dict.fromkeys(FEATURES, nan)
    rc = det._reward
    if math.isfinite(rc.smoothed) and math.isfinite(rc.peak) and rc.peak > 0:
        f["reward_vs_peak"] = _clip(rc.smoothed / rc.peak, 0.0, 2.0)
    rtr = det._tracks["reward"]
    if rtr.source is not None and len(rtr.values) >= c.trend_min_points:
        x, y = rtr.last(int(c.trend_window))
        if x.size >= c.trend_min_points and np.ptp(x) > 0:
            f["reward_z"] = _clip(theil_sen(x, y, sigma_floor=1e-6).z, -10.0, 10.0)
    if (rtr.source is not None and len(rtr.values) >= LINE_WINDOW // 2 and math.isfinite(rc.smoothed)
            and rc.peak >= c.collapse_min_peak):
        # steps until the smoothed reward reaches the collapse line (collapse_frac x its peak) at its recent trend
        x, y = rtr.last(LINE_WINDOW)
        if np.ptp(x) > 0:
            slope = theil_sen(x, y, autocorr=False).slope  # the slope only (autocorr and sigma change z alone)
            gap = rc.smoothed - c.collapse_frac * rc.peak
            f["steps_to_line"] = math.log1p(_clip(gap / -slope if slope < 0 else LINE_MAX_STEPS, 0.0, LINE_MAX_STEPS))
    llt = det._ll_trend()
    if llt is not None:
        _, t, drop, _ = llt
        f["ll_z"] = _clip(t.z, -10.0, 10.0)
        f["ll_drop"] = _clip(drop / max(t.sigma, 1e-12), 0.0, 20.0)
    dtr = det._tracks["displacement"]
    if dtr.source is not None and len(dtr.values) >= c.displacement_window:
        _, d = dtr.last(int(c.displacement_window))
        f["disp_neg_share"] = float(np.mean(d < -c.displacement_eps))
        _, d_long = dtr.last(int(c.trend_window))
        f["disp_mean"] = float(np.mean(d_long))
    for name in ("entropy", "grad_norm", "ppo_kl", "clip_frac"):
        s = det._surge(name, 1.0)
        if s is not None:
            _, _, recent, level, _, med = s
            f[f"{name}_surge"] = _clip((recent - med) / max(level - med, 1e-12), -5.0, 5.0)
    for phase in (STAGNATION, DECAY, ACCELERATION):
        f[f"phase_{phase}"] = float(det.phase == phase)
    start = det.phase_starts.get(det.phase)
    last = det._last_step
    f["phase_age"] = math.log1p(max(last - start, 0)) if start is not None and last is not None else 0.0
    return f


@dataclass(frozen=True)
class ForecastModel:
    """A fitted logistic model: p = 1 / (1 + exp(-(intercept + Σ coef_i · (x_i - mean_i) / scale_i))), a missing
    (NaN) feature standing at its mean."""

    name: str
    horizon: int
    inputs: str  # "all" | "scalars"
    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    fitted: dict[str, Any] = field(default_factory=dict)  # on what, how, by which command

    def __post_init__(self) -> None:
        n = len(self.features)
        if self.inputs not in INPUTS:
            raise ValueError(f"forecast model {self.name!r}: inputs must be one of {INPUTS}, got {self.inputs!r}")
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            raise ValueError(f"forecast model {self.name!r}: unknown features {unknown}; known: {list(FEATURES)}")
        if not (len(self.mean) == len(self.scale) == len(self.coef) == n) or self.horizon < 1:
            raise ValueError(f"forecast model {self.name!r}: {n} features need {n} means, scales and coefficients, "
                             "and the horizon must be >= 1")

    def probability(self, features: Mapping[str, float]) -> float:
        z = self.intercept
        for name, m, s, w in zip(self.features, self.mean, self.scale, self.coef):
            v = features.get(name, math.nan)
            if v == v:  # not NaN
                z += w * (v - m) / s
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    @property
    def fingerprint(self) -> str:
        """A short id of what the model computes (its name and provenance left out)."""
        core = {k: v for k, v in asdict(self).items() if k not in ("name", "fitted")}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({"format": 1, **asdict(self)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "the model") -> "ForecastModel":
        try:
            d = json.loads(text)
            if d.pop("format", None) != 1:
                raise ValueError("not a forecast model file (format 1)")
            return cls(name=str(d["name"]), horizon=int(d["horizon"]), inputs=str(d["inputs"]),
                       features=tuple(d["features"]), mean=tuple(map(float, d["mean"])),
                       scale=tuple(map(float, d["scale"])), coef=tuple(map(float, d["coef"])),
                       intercept=float(d["intercept"]), fitted=dict(d.get("fitted") or {}))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where} is not a forecast model ({exc}); make one with `lld-monitor forecast fit`") from exc

    @classmethod
    def load(cls, path: str | Path) -> "ForecastModel":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"forecast model {p} not found")
        return cls.from_json(p.read_text(encoding="utf-8"), str(p))


def shipped(inputs: str = "all") -> ForecastModel | None:
    """The model shipped in the package for these inputs (None if it is not there)."""
    p = MODELS_DIR / f"{inputs}.json"
    return ForecastModel.load(p) if p.is_file() else None


def model_for(first_row: Mapping[str, object]) -> ForecastModel | None:
    """The model for a run whose first logged row is `first_row`: $LLD_MONITOR_FORECAST_MODEL's file if set, else
    the shipped all-signals model when that row has a displacement of preserved responses (our trainer and hooks
    log it from the first step), else the shipped scalars model. The online detector (`forecast=AUTO`) and every
    offline reader (`detect.offline.run_model`) choose by this same rule, so they forecast with the same model."""
    if os.environ.get(MODEL_ENV):
        return ForecastModel.load(os.environ[MODEL_ENV])
    has_displacement = any(_finite(first_row.get(k)) for src in registry.detector_candidates("displacement")
                           for k in src.parts)
    return shipped("all" if has_displacement else "scalars")


def _finite(v: object) -> bool:
    x = registry.as_number(v)
    return x is not None and math.isfinite(x)
