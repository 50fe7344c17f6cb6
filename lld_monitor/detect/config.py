"""The detector's thresholds: one dataclass, every field documented, defaults that work on our runs.

Units: *points* are finite observations of one signal (NaN steps are skipped, so a window of 30 points
may span more than 30 steps); *sigma* is a robust standard deviation, 1.4826 x the median absolute
deviation (MAD), so a threshold of 4 sigma means the same on any signal scale.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

CONFIG_ENV = "LLD_MONITOR_DETECTOR_CONFIG"
"""Path of a JSON file of DetectorConfig overrides used wherever no config is passed: the detector inside
RunLogger, the dashboard's detector and `lld-monitor detect` without --config all read it."""


@dataclass
class DetectorConfig:
    # --- warm-up -------------------------------------------------------------------------------
    warmup_steps: int = 20
    """Updates before any phase other than healthy can be entered (also the minimum number of points
    a signal needs before it is used)."""

    # --- correct-response likelihood: trend (phase I stagnation, phase II decay) -------------------
    trend_window: int = 45
    """Points in the Theil-Sen window of the likelihood trend."""
    trend_min_points: int = 15
    """Fewer finite points in the window than this: no trend is computed."""
    rise_z: float = 2.0
    """Trend z (slope / its robust standard error) above this = the likelihood is still rising."""
    decay_z: float = -3.5
    """Trend z below this = the likelihood is declining."""
    smooth_window: int = 9
    """Trailing median window (points) for the smoothed likelihood and its running peak."""
    decay_drop_sigma: float = 2.0
    """Declining also needs the smoothed likelihood this many residual sigmas below its running peak
    (so a short wiggle of a rising curve is not a decay)."""
    decay_min_decline_sigma: float = 2.0
    """... and the fitted decline over the trend window (-slope x span) to be at least this many
    residual sigmas (a material decline, not only a statistically detectable one)."""

    # --- token-level displacement (our own runs; paper Def. A.3 'persistent decay') ---------------
    displacement_window: int = 20
    """Points over which persistent negative displacement (delta_preserved < 0) is judged."""
    displacement_neg_frac: float = 0.75
    """Share of the window with delta_preserved < -displacement_eps that counts as persistent displacement."""
    net_displacement_frac: float = 0.5
    """Where delta_preserved is measured, the step's updates count as *net displacing* when at least this
    share of the last `displacement_window` steps had delta_preserved < -displacement_eps and its median is
    negative, OR when the mean of delta_preserved over the last `trend_window` steps (those the likelihood
    trend is fitted on) is < -displacement_eps: displacement is heavy-tailed, a few strongly displacing steps
    can outweigh many small gains. A likelihood decline without net displacement is only 'suspected' (info):
    the updates raise the preserved responses, so the decline of the fresh samples' likelihood is a
    distribution shift."""
    corroborated_decay_z: float = -2.5
    """With net displacement, a likelihood trend z below this (and a smoothed likelihood below its peak) is
    enough for decay: two independent signals agree, so each may be weaker than `decay_z` alone."""
    displacement_eps: float = 1e-4
    """Dead zone: |delta| below this (nats per token) is numerical noise (e.g. a step with no gradient),
    neither displaced nor gained."""

    # --- surges (phase III: entropy, grad norm, likelihood ratios) --------------------------------
    baseline_window: int = 40
    """Points in the rolling baseline (median and MAD) that a surge is measured against; the baseline
    ends `surge_window` points before the current one, so a surge does not raise its own baseline."""
    baseline_min_points: int = 15
    """A surge test needs at least this many baseline points."""
    surge_window: int = 5
    """Recent points examined for a sustained surge."""
    surge_min_count: int = 4
    """A surge needs at least this many of the last `surge_window` points above the spike level
    (a single spike is reported as `info`, never as collapse)."""
    spike_sigma: float = 5.0
    """A point is a spike when it is this many baseline sigmas above the baseline median ..."""
    spike_rel: float = 0.3
    """... and at least this fraction above the baseline median (guards near-constant baselines)."""
    sigma_floor_rel: float = 0.02
    """Robust sigmas are floored at this fraction of |median| (a perfectly flat signal has MAD 0)."""
    accel_window: int = 10
    """Short Theil-Sen window for likelihood acceleration (phase III)."""
    accel_factor: float = 2.0
    """Acceleration: the short-window slope is this many times steeper than the long-window slope."""

    # --- reward ----------------------------------------------------------------------------------
    reward_smooth_window: int = 10
    """Trailing mean window (points) of the smoothed training reward (10 points: a step's reward over a
    few prompts is noisy, and the running peak of a shorter smoothing is biased upward by that noise)."""
    collapse_frac: float = 0.5
    """REWARD COLLAPSE: smoothed reward below collapse_frac x its running peak ..."""
    collapse_patience: int = 5
    """... for this many consecutive reward points; the collapse step is the first of them."""
    collapse_min_peak: float = 0.05
    """A run whose smoothed reward never reached this cannot collapse (it never learned)."""
    reward_degrade_frac: float = 0.8
    """Phase III evidence (only while the likelihood is already decaying): smoothed reward below this
    fraction of its running peak."""

    # --- hysteresis ------------------------------------------------------------------------------
    enter_patience: int = 5
    """A phase is entered after its condition held on this many consecutive updates."""
    exit_patience: int = 20
    """A phase is left after its condition failed on this many consecutive updates."""

    # --- misc ------------------------------------------------------------------------------------
    spike_info_cooldown: int = 20
    """At most one `info` spike/non-finite alert per signal per this many updates."""
    extra: dict[str, float] = field(default_factory=dict)
    """Free-form overrides kept with the config (not used by the detector itself)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"DetectorConfig.{f.name} must be a number, got {v!r}")  # noqa: TRY004 - callers catch bad configs as ValueError
        for name in (
            "trend_window",
            "trend_min_points",
            "smooth_window",
            "displacement_window",
            "baseline_window",
            "baseline_min_points",
            "surge_window",
            "surge_min_count",
            "accel_window",
            "reward_smooth_window",
            "collapse_patience",
            "enter_patience",
            "exit_patience",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DetectorConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.surge_min_count > self.surge_window:
            raise ValueError("DetectorConfig.surge_min_count must be <= surge_window")
        if self.trend_min_points > self.trend_window:
            raise ValueError("DetectorConfig.trend_min_points must be <= trend_window")
        if not 0.0 < self.collapse_frac < 1.0:
            raise ValueError("DetectorConfig.collapse_frac must be in (0, 1)")
        if self.accel_window < 3:
            raise ValueError("DetectorConfig.accel_window must be >= 3")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DetectorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown DetectorConfig field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)


def load_detector_config(source: DetectorConfig | Mapping | str | os.PathLike | None = None) -> DetectorConfig:
    """A DetectorConfig from what a caller has: a DetectorConfig (returned as is), a mapping of overrides,
    or the path of a JSON file of overrides (`lld-monitor detect --config FILE`'s format). None: the file
    named by $LLD_MONITOR_DETECTOR_CONFIG when set, else the defaults. Raises ValueError with the reason
    (unreadable file, not a JSON object, unknown field, bad value)."""
    if isinstance(source, DetectorConfig):
        return source
    if source is None:
        env = os.environ.get(CONFIG_ENV)
        if not env:
            return DetectorConfig()
        source = env
    if isinstance(source, Mapping):
        data = dict(source)
        where = "detector config"
    else:
        where = f"detector config {os.fspath(source)}"
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {where}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{where} must hold a JSON object of DetectorConfig fields")  # noqa: TRY004
    try:
        return DetectorConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad {where}: {e}") from e
