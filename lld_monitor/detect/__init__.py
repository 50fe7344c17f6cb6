"""Early-warning detector for the LLD death spiral (numpy/pandas only; never imports torch).

    from lld_monitor.detect import OnlineDetector, detect_run, DetectorConfig
    det = OnlineDetector();  alerts = det.update(step, {"ll_correct_mean": -0.41, "reward_mean": 0.3, ...})
    res = detect_run(reader.signals(run_id))   # same alerts, offline

See docs/detector.md for the phases, the signals, the thresholds and the reward-collapse definition.
"""

from .config import DetectorConfig
from .offline import (
    alerts_frame,
    detect_run,
    iter_signal_rows,
    reward_collapse_step,
    reward_decline_step,
    reward_series,
)
from .online import PHASES, SEVERITIES, Alert, DetectionResult, OnlineDetector
from .signals import SIGNAL_CANDIDATES, SIGNALS, resolve_columns

__all__ = [
    "PHASES",
    "SEVERITIES",
    "SIGNALS",
    "SIGNAL_CANDIDATES",
    "Alert",
    "DetectionResult",
    "DetectorConfig",
    "OnlineDetector",
    "alerts_frame",
    "detect_run",
    "iter_signal_rows",
    "resolve_columns",
    "reward_collapse_step",
    "reward_decline_step",
    "reward_series",
]
