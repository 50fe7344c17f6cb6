"""Early-warning detector for the LLD death spiral (numpy/pandas only; never imports torch).

    from lld_monitor.detect import OnlineDetector, detect_run, DetectorConfig
    det = OnlineDetector();  alerts = det.update(step, {"ll_correct_mean": -0.41, "reward_mean": 0.3, ...})
    res = detect_run(reader.signals(run_id))   # same alerts, offline

See docs/detector.md for the phases, the signals, the thresholds and the reward-collapse definition.
"""

from .config import CONFIG_ENV, DetectorConfig, load_detector_config
from .offline import (
    alerts_frame,
    detect_run,
    iter_signal_rows,
    reward_collapse_step,
    reward_decline_step,
    reward_series,
)
from .online import (
    PROXY_DECLINE_MESSAGE,
    SEVERITIES,
    Alert,
    DetectionResult,
    OnlineDetector,
)
from .onset import OnsetConfig, find_onset, onset_table, post_mortem_reference
from .phases import (
    ACCELERATION,
    COLLAPSE,
    DECAY,
    HEALTHY,
    PHASE_SEVERITY,
    PHASE_TITLES,
    PHASES,
    STAGNATION,
    phase_level,
    phase_title,
)
from .signal_sources import SIGNAL_CANDIDATES, SIGNALS, resolve_columns

__all__ = [
    "CONFIG_ENV",
    "load_detector_config",
    "ACCELERATION",
    "COLLAPSE",
    "DECAY",
    "HEALTHY",
    "OnsetConfig",
    "PHASES",
    "PHASE_SEVERITY",
    "PHASE_TITLES",
    "PROXY_DECLINE_MESSAGE",
    "SEVERITIES",
    "SIGNALS",
    "SIGNAL_CANDIDATES",
    "STAGNATION",
    "Alert",
    "DetectionResult",
    "DetectorConfig",
    "OnlineDetector",
    "alerts_frame",
    "detect_run",
    "find_onset",
    "onset_table",
    "iter_signal_rows",
    "phase_level",
    "phase_title",
    "post_mortem_reference",
    "resolve_columns",
    "reward_collapse_step",
    "reward_decline_step",
    "reward_series",
]
