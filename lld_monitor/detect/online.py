"""The online detector: sees one step at a time (as inside RunLogger's writer thread) and returns the
alerts raised at that step. `detect_run` (offline) replays a finished run through this same class,
so online and offline alerts cannot diverge.

Phases (names and titles: lld_monitor.detect.phases), after the paper's trajectory (the LLD paper,
arXiv 2512.04220, section 2):
  healthy       the correct-response likelihood is still rising (or nothing is known yet)
  stagnation    phase I: the likelihood trend is flat                                   -> info
  decay         phase II: the likelihood declines with displacement, or token displacement
                of preserved (A >= 0) responses is persistently negative                -> warning
  acceleration  phase III: likelihood decline accelerating, entropy / grad norm / ratio
                surges together with the decay, or the reward falling during it         -> critical
  collapse      the reward has collapsed (the definition below)                         -> critical
A likelihood decline with NO displacement signal at all (step scalars only, e.g. a verl import) is
never a warning: an `info` says the proxy is declining and that LLD cannot be told from drift.
Each phase is latched with hysteresis: entered after its condition held `enter_patience`
consecutive updates (the reward collapse: as soon as it is confirmed), left after it failed
`exit_patience` consecutive updates, with an `info` alert saying the run recovered from it; the
reported phase is the highest latched one.

REWARD COLLAPSE (the definition the evaluation uses): let r~ be the trailing mean of the last
`reward_smooth_window` reward points and P its running maximum. The reward has collapsed at step s
when P >= `collapse_min_peak` and r~ < `collapse_frac` x P on `collapse_patience` consecutive reward
points starting at s; `collapse_step` = s (known `collapse_patience - 1` points later).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from .config import DetectorConfig, load_detector_config
from .forecast_model import AUTO, THRESHOLD, ForecastModel, detector_features, model_for
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
)
from .signal_sources import SIGNAL_CANDIDATES, SIGNALS, Candidate, first_present
from .stats import fast_median, robust_sigma, theil_sen

log = logging.getLogger(__name__)

SEVERITIES = ("info", "warning", "critical")  # == schema.SEVERITIES
_LATCHED = (STAGNATION, DECAY, ACCELERATION, COLLAPSE)
PROXY_DECLINE_MESSAGE = ("likelihood proxy declining, no displacement signal: cannot tell LLD from drift; "
                         "log `lld_metrics` to know")
__all__ = ["PHASES", "PROXY_DECLINE_MESSAGE", "SEVERITIES", "Alert", "DetectionResult", "OnlineDetector"]


@dataclass
class Alert:
    """One alert; the fields are schema.ALERTS minus run_id."""

    step: int
    phase: str
    severity: str
    signal: str
    value: float
    threshold: float
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DetectionResult:
    phase: str
    phase_starts: dict[str, int]
    collapse_step: int | None
    alerts: list[Alert]
    signal_sources: dict[str, str] = field(default_factory=dict)  # detector signal -> column used
    phase_changes: list[tuple[int, str]] = field(default_factory=list)  # (step, phase entered), in order
    # (step, p_collapse) for every step before the collapse (forecast_model.py); empty without a forecast model
    forecast: list[tuple[int, float]] = field(default_factory=list)
    forecast_model: str | None = None  # the model's name


@dataclass
class _Evidence:
    signal: str
    value: float
    threshold: float
    message: str
    suspected: bool = True  # an info alert about it reads "suspected <phase>: <message>"


class _Track:
    """History of one detector signal (finite points only) and its source column."""

    def __init__(self, maxlen: int, smooth_window: int, track_peak: bool = False, peak_after: int = 0) -> None:
        self.steps: deque[int] = deque(maxlen=maxlen)
        self.values: deque[float] = deque(maxlen=maxlen)
        self.source: Candidate | None = None
        self.rank = 10**9
        self.n = 0
        self.smooth_window = smooth_window
        self.track_peak = track_peak
        self.peak_after = peak_after  # the running peak ignores the first points (warm-up transient)
        self.smooth_peak = -math.inf
        self.last_step: int | None = None

    def reset(self) -> None:
        self.steps.clear()
        self.values.clear()
        self.n = 0
        self.smooth_peak = -math.inf

    def add(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)
        self.n += 1
        self.last_step = step
        if self.track_peak and self.n >= max(self.smooth_window, self.peak_after):
            self.smooth_peak = max(self.smooth_peak, self.smoothed())

    def to_state(self) -> dict:
        """What this track knows, as JSON-safe values (the source as its rank among the signal's candidates)."""
        return {"steps": list(self.steps), "values": list(self.values), "rank": self.rank if self.source else None,
                "n": self.n, "smooth_peak": self.smooth_peak, "last_step": self.last_step}

    def load_state(self, state: Mapping, candidates: tuple[Candidate, ...]) -> None:
        self.steps.clear()
        self.values.clear()
        self.steps.extend(int(x) for x in state["steps"])
        self.values.extend(float(x) for x in state["values"])
        rank = state["rank"]
        self.source, self.rank = (None, 10**9) if rank is None else (candidates[int(rank)], int(rank))
        self.n = int(state["n"])
        self.smooth_peak = float(state["smooth_peak"])
        self.last_step = None if state["last_step"] is None else int(state["last_step"])

    def smoothed(self) -> float:
        k = min(self.smooth_window, len(self.values))
        return fast_median(list(self.values)[-k:])

    def last(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, len(self.values))
        s = list(self.steps)[-k:]
        v = list(self.values)[-k:]
        return np.asarray(s, dtype=float), np.asarray(v, dtype=float)


class _RewardCollapse:
    """The reward-collapse definition (module docstring), one reward point at a time."""

    def __init__(self, cfg: DetectorConfig) -> None:
        self.cfg = cfg
        self.window: deque[float] = deque(maxlen=int(cfg.reward_smooth_window))
        self.smoothed = math.nan
        self.peak = -math.inf
        self.streak_start: int | None = None
        self.streak = 0
        self.collapse_step: int | None = None
        self.below = False

    _STATE = ("smoothed", "peak", "streak_start", "streak", "collapse_step", "below")

    def to_state(self) -> dict:
        return {"window": list(self.window), **{k: getattr(self, k) for k in self._STATE}}

    def load_state(self, state: Mapping) -> None:
        self.window.clear()
        self.window.extend(float(x) for x in state["window"])
        for k in self._STATE:
            setattr(self, k, state[k])

    def add(self, step: int, r: float) -> bool:
        """Feed one finite reward; True when the collapse is confirmed at this point."""
        self.window.append(r)
        if len(self.window) < self.window.maxlen:  # type: ignore[operator]
            return False
        self.smoothed = float(sum(self.window) / len(self.window))
        self.peak = max(self.peak, self.smoothed)
        self.below = self.peak >= self.cfg.collapse_min_peak and self.smoothed < self.cfg.collapse_frac * self.peak
        if self.below:
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
        else:
            self.streak = 0
            self.streak_start = None
        if self.collapse_step is None and self.streak >= self.cfg.collapse_patience:
            self.collapse_step = self.streak_start
            return True
        return False


class _Latch:
    def __init__(self, enter: int, exit_: int) -> None:
        self.enter, self.exit = enter, exit_
        self.on = 0
        self.off = 0
        self.active = False
        self.episode_open = False  # a 'suspected' info alert was sent for the current run of evidence
        self.quiet = 0  # consecutive updates without any (suspected or confirmed) evidence

    _STATE = ("on", "off", "active", "episode_open", "quiet")

    def to_state(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state(self, state: Mapping) -> None:
        for k in self._STATE:
            setattr(self, k, state[k])

    def feed(self, cond: bool) -> tuple[bool, bool]:
        """Returns (entered, left) for this update."""
        if cond:
            self.on += 1
            self.off = 0
        else:
            self.off += 1
            self.on = 0
        entered = left = False
        if not self.active and self.on >= self.enter:
            self.active, entered = True, True
        elif self.active and self.off >= self.exit:
            self.active, left = False, True
        return entered, left


def _fmt(x: float) -> str:
    return f"{x:.4g}"


class OnlineDetector:
    """Early-warning detector over a run's step signals, one step at a time.

    `update(step, signals)` takes a mapping of column name -> value (canonical STEP_SIGNALS names,
    verl or TRL metric keys; NaN / None = missing) and returns the alerts raised at that step.
    Steps must increase; a step not greater than the last one is ignored (logged).
    """

    def __init__(self, cfg: DetectorConfig | None = None, forecast: ForecastModel | str | None = AUTO) -> None:
        # no config given: $LLD_MONITOR_DETECTOR_CONFIG's file if set (RunLogger, the dashboard), else defaults
        self.cfg = cfg or load_detector_config(None)
        # p_collapse after every update (forecast_model.py); None: no forecast; AUTO: `model_for` the first row
        self._choose_model = forecast == AUTO
        self.forecast_model: ForecastModel | None = None if forecast == AUTO else forecast  # type: ignore[assignment]
        c = self.cfg
        maxlen = int(max(c.trend_window, c.baseline_window + c.surge_window, c.displacement_window, c.smooth_window)) + 1
        self._tracks: dict[str, _Track] = {
            s: _Track(maxlen, int(c.smooth_window), track_peak=(s == "ll_correct"), peak_after=int(c.warmup_steps))
            for s in SIGNALS
        }
        self._reward = _RewardCollapse(c)
        self._latches = {lvl: _Latch(int(c.enter_patience), int(c.exit_patience)) for lvl in _LATCHED}
        self._n_updates = 0
        self._last_step: int | None = None
        self._cooldown: dict[str, int] = {}
        self.phase: str = HEALTHY
        self.phase_starts: dict[str, int] = {}
        self.phase_changes: list[tuple[int, str]] = []
        self.collapse_step: int | None = None
        self.alerts: list[Alert] = []
        self.forecast: list[tuple[int, float]] = []  # (step, p_collapse), every update before the collapse
        self._forecast_alerted = False

    # ------------------------------------------------------------------ public
    @property
    def signal_sources(self) -> dict[str, str]:
        return {s: t.source.label for s, t in self._tracks.items() if t.source is not None}

    def result(self) -> DetectionResult:
        return DetectionResult(
            phase=self.phase,
            phase_starts=dict(self.phase_starts),
            collapse_step=self.collapse_step,
            alerts=list(self.alerts),
            signal_sources=self.signal_sources,
            phase_changes=list(self.phase_changes),
            forecast=[(s, p) for s, p in self.forecast if self.collapse_step is None or s < self.collapse_step],
            forecast_model=self.forecast_model.name if self.forecast_model is not None else None,
        )

    @property
    def p_collapse(self) -> float | None:
        """The latest forecast (None: no model, nothing forecast yet, or the reward has collapsed)."""
        if self.forecast_model is None or not self.forecast or self.collapse_step is not None:
            return None
        return self.forecast[-1][1]

    def to_state(self) -> dict:
        """Everything needed to carry on exactly where this detector is, as JSON-safe values (floats kept
        exactly; NaN and +/-inf need JSON's NaN / Infinity extension). `alerts` and `phase_changes` grow with
        the run and are left out: a checkpoint stores them as deltas (lld_monitor.detect.checkpoint)."""
        return {
            "tracks": {name: tr.to_state() for name, tr in self._tracks.items()},
            "reward": self._reward.to_state(),
            "latches": {lvl: latch.to_state() for lvl, latch in self._latches.items()},
            "n_updates": self._n_updates, "last_step": self._last_step, "cooldown": dict(self._cooldown),
            "phase": self.phase, "phase_starts": dict(self.phase_starts), "collapse_step": self.collapse_step,
            "forecast_alerted": self._forecast_alerted,
        }

    @classmethod
    def from_state(cls, state: Mapping, cfg: DetectorConfig | None = None, alerts: list[Alert] | None = None,
                   phase_changes: list[tuple[int, str]] | None = None, forecast_model: ForecastModel | None = None,
                   forecast: list[tuple[int, float]] | None = None) -> "OnlineDetector":
        """A detector in the state `to_state()` returned (with the config and forecast model it ran with), its past
        `alerts`, `phase_changes` and `forecast` put back; updating it gives what the original would have given."""
        det = cls(cfg, forecast_model)
        for name, tr in det._tracks.items():
            tr.load_state(state["tracks"][name], SIGNAL_CANDIDATES[name])
        det._reward.load_state(state["reward"])
        for lvl, latch in det._latches.items():
            latch.load_state(state["latches"][lvl])
        det._n_updates = int(state["n_updates"])
        det._last_step = None if state["last_step"] is None else int(state["last_step"])
        det._cooldown = {str(k): int(v) for k, v in state["cooldown"].items()}
        det.phase = str(state["phase"])
        det.phase_starts = {str(k): int(v) for k, v in state["phase_starts"].items()}
        det.collapse_step = None if state["collapse_step"] is None else int(state["collapse_step"])
        det.alerts = list(alerts or [])
        det.phase_changes = [(int(s), str(p)) for s, p in (phase_changes or [])]
        det.forecast = [(int(s), float(p)) for s, p in (forecast or [])]
        det._forecast_alerted = bool(state.get("forecast_alerted", False))
        return det

    def update(self, step: int, signals: Mapping[str, object]) -> list[Alert]:
        if self._choose_model:
            self._choose_model = False
            try:
                self.forecast_model = model_for(signals)
            except (OSError, ValueError) as exc:  # a bad $LLD_MONITOR_FORECAST_MODEL must not stop the detector
                log.warning("no collapse forecast: %s", exc)
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            log.debug("detector: step %d ignored (not after step %d)", step, self._last_step)
            return []
        if not any(first_present(name, signals) is not None for name in SIGNALS):
            return []  # nothing the detector reads (e.g. a row of NaNs): not an update at all
        self._last_step = step
        self._n_updates += 1
        out: list[Alert] = []
        if not self.phase_starts:
            self.phase_starts[HEALTHY] = step
            self.phase_changes.append((step, HEALTHY))

        confirmed = self._ingest(step, signals, out)
        if confirmed:
            self.collapse_step = self._reward.collapse_step
            rc = self._reward
            self._emit(
                out, step, "critical", self._tracks["reward"].source.label,  # type: ignore[union-attr]
                rc.smoothed, self.cfg.collapse_frac * rc.peak,
                f"reward collapse since step {rc.collapse_step}: smoothed reward {_fmt(rc.smoothed)} has stayed "
                f"below {self.cfg.collapse_frac:g} x its peak {_fmt(rc.peak)} for {self.cfg.collapse_patience} points",
                phase=COLLAPSE,
            )

        warm = self._n_updates >= self.cfg.warmup_steps
        stag_ev, decay_ev, accel_ev, suspect_ev, suspect_decay = (
            self._evaluate(step, out) if warm else (None, [], [], [], []))

        collapsed_now = self.collapse_step is not None and self._reward.below
        conds = {STAGNATION: stag_ev is not None, DECAY: bool(decay_ev), ACCELERATION: bool(accel_ev),
                 COLLAPSE: collapsed_now}
        if confirmed:  # the collapse definition already waited `collapse_patience` points
            self._latches[COLLAPSE].on = self._latches[COLLAPSE].enter - 1
        for lvl, latch in self._latches.items():
            entered, _ = latch.feed(conds[lvl])
            if entered and lvl == DECAY and phase_level(self.phase) > phase_level(DECAY) and decay_ev:
                # the phase stays where it is, but a post-mortem needs to see the displacement evidence too
                e = decay_ev[0]
                self._emit(out, step, "warning", e.signal, e.value, e.threshold,
                           f"{PHASE_TITLES[DECAY]} condition now also holds: {e.message}")
        # 'suspected' info alerts: first update of a new run of evidence, before the latch confirms
        for lvl, evs in ((DECAY, decay_ev or suspect_decay), (ACCELERATION, accel_ev or suspect_ev)):
            latch = self._latches[lvl]
            # an episode of evidence ends after `exit_patience` updates with none at all (suspected evidence
            # alone never feeds the latch, so the latch's own failure count cannot end it)
            latch.quiet = 0 if evs else latch.quiet + 1
            if latch.quiet >= latch.exit:
                latch.episode_open = False
            if evs and not latch.active and not latch.episode_open and phase_level(self.phase) < phase_level(lvl):
                latch.episode_open = True
                e = evs[0]
                msg = f"suspected {PHASE_TITLES[lvl]}: {e.message}" if e.suspected else e.message
                self._emit(out, step, "info", e.signal, e.value, e.threshold, msg)

        new_phase = HEALTHY
        for lvl in _LATCHED:
            if self._latches[lvl].active:
                new_phase = lvl
        if new_phase != self.phase:
            self._change_phase(step, new_phase, out, confirmed,
                               {STAGNATION: [stag_ev] if stag_ev else [], DECAY: decay_ev, ACCELERATION: accel_ev})
        if self.forecast_model is not None and self.collapse_step is None:
            self._forecast_step(step, out)
        self.alerts.extend(out)
        return out

    def _forecast_step(self, step: int, out: list[Alert]) -> None:
        m = self.forecast_model
        p = m.probability(detector_features(self))  # type: ignore[union-attr]
        self.forecast.append((step, p))
        if p >= THRESHOLD and not self._forecast_alerted:
            self._forecast_alerted = True
            self._emit(out, step, "warning", "forecast", p, THRESHOLD,
                       f"collapse forecast: p = {p:.2f} that the reward collapses within the next {m.horizon} steps "
                       f"(model {m.name}); the detector's phase is {PHASE_TITLES[self.phase]}")

    def _change_phase(self, step: int, new_phase: str, out: list[Alert], confirmed: bool,
                      evidence: dict[str, list[_Evidence]]) -> None:
        old = self.phase
        self.phase = new_phase
        self.phase_starts.setdefault(new_phase, step)
        self.phase_changes.append((step, new_phase))
        if phase_level(new_phase) > phase_level(old):
            if new_phase == COLLAPSE:
                if confirmed:
                    return  # the reward-collapse alert of this step is the entry alert
                rc = self._reward
                evs = [_Evidence(self._tracks["reward"].source.label, rc.smoothed,  # type: ignore[union-attr]
                                 self.cfg.collapse_frac * rc.peak,
                                 f"the smoothed reward {_fmt(rc.smoothed)} is again below "
                                 f"{self.cfg.collapse_frac:g} x its peak {_fmt(rc.peak)}")]
            else:
                evs = evidence[new_phase]
            e = evs[0] if evs else _Evidence("phase", math.nan, math.nan, "")
            extra = "; also: " + "; ".join(x.message for x in evs[1:3]) if len(evs) > 1 else ""
            self._emit(out, step, PHASE_SEVERITY[new_phase], e.signal, e.value, e.threshold,
                       f"{self._title(new_phase)}: {e.message}{extra}")
            return
        off = self._latches[old].off
        why = (f"the smoothed reward has been back above {self.cfg.collapse_frac:g} x its peak"
               if old == COLLAPSE else f"the {PHASE_TITLES[old]} condition has failed")
        recovered = " — the run recovered from it" if phase_level(old) >= phase_level(DECAY) else ""
        self._emit(out, step, "info", "phase", float(off), float(self.cfg.exit_patience),
                   f"left {PHASE_TITLES[old]}{recovered}: {why} on {off} consecutive updates; "
                   f"phase back to {PHASE_TITLES[new_phase]}")

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _title(phase: str) -> str:
        if phase == DECAY:
            return f"{PHASE_TITLES[DECAY]} — the LLD death spiral has likely begun"
        return PHASE_TITLES[phase]

    def _emit(self, out: list[Alert], step: int, severity: str, signal: str, value: float, threshold: float,
              message: str, phase: str | None = None) -> None:
        a = Alert(step=step, phase=phase or self.phase, severity=severity, signal=signal,
                  value=float(value), threshold=float(threshold), message=message)
        out.append(a)
        (log.warning if severity != "info" else log.info)("step %d [%s] %s", step, severity, message)

    def _cooled(self, key: str) -> bool:
        last = self._cooldown.get(key)
        if last is not None and self._n_updates - last < self.cfg.spike_info_cooldown:
            return False
        self._cooldown[key] = self._n_updates
        return True

    def _ingest(self, step: int, signals: Mapping[str, object], out: list[Alert],
                names: tuple[str, ...] = SIGNALS) -> bool:
        """Feed the tracks of `names` (all signals by default) with this step's values; True when the reward
        collapse is confirmed at this step."""
        warm_pts = int(self.cfg.warmup_steps)
        confirmed = False
        for name in names:
            hit = first_present(name, signals)
            if hit is None:
                continue
            rank, cand, v = hit
            tr = self._tracks[name]
            if tr.source is None or (rank < tr.rank and tr.n < warm_pts):
                if tr.source is not None:
                    log.info("detector: %s now read from %s (was %s)", name, cand.label, tr.source.label)
                tr.reset()
                if name == "reward":
                    self._reward = _RewardCollapse(self.cfg)
                tr.source, tr.rank = cand, rank
            elif cand is not tr.source:
                # the locked source is missing this step; a lower-priority one is not mixed in
                v2 = tr.source.get(signals)
                if v2 is None or math.isnan(v2):
                    continue
                v = v2
            if not math.isfinite(v):
                if self._cooled("nonfinite:" + name):
                    self._emit(out, step, "info", tr.source.label, v, math.nan,
                               f"non-finite {tr.source.label} ({v}) — ignored by the detector")
                continue
            tr.add(step, v)
            if name == "reward":
                confirmed = self._reward.add(step, v) or confirmed
        return confirmed

    # evidence -----------------------------------------------------------------
    def _ll_trend(self):
        c = self.cfg
        tr = self._tracks["ll_correct"]
        if tr.source is None or len(tr.values) < c.trend_min_points or tr.n < c.warmup_steps:
            return None
        x, y = tr.last(int(c.trend_window))
        if x.size < c.trend_min_points:
            return None
        floor = c.sigma_floor_rel * abs(fast_median(y))
        t = theil_sen(x, y, sigma_floor=floor)
        drop = tr.smooth_peak - tr.smoothed() if math.isfinite(tr.smooth_peak) else 0.0
        return tr, t, drop, float(x[-1] - x[0])

    def _surge(self, name: str, sign: float = 1.0):
        """(surge?, spike-now?, recent median, level, hits, baseline median) for a sustained move of `name`
        away from its baseline, upward (sign=+1) or downward (sign=-1, a plunge), or None."""
        c = self.cfg
        tr = self._tracks[name]
        need = int(c.baseline_min_points + c.surge_window)
        if tr.source is None or len(tr.values) < need:
            return None
        _, v = tr.last(int(c.baseline_window + c.surge_window))
        base, recent = v[: -int(c.surge_window)], v[-int(c.surge_window):]
        med = fast_median(base)
        sig = robust_sigma(base, floor=c.sigma_floor_rel * abs(med))
        level = med + sign * max(c.spike_sigma * sig, c.spike_rel * abs(med))
        beyond = (recent > level) if sign > 0 else (recent < level)
        hits = int(np.sum(beyond))
        return hits >= c.surge_min_count, bool(beyond[-1]), fast_median(recent), level, hits, med

    def _evaluate(self, step: int, out: list[Alert]):
        c = self.cfg
        stag_ev: _Evidence | None = None
        decay_ev: list[_Evidence] = []
        accel_ev: list[_Evidence] = []
        suspect_ev: list[_Evidence] = []
        suspect_decay: list[_Evidence] = []

        llt = self._ll_trend()
        if llt is not None:
            tr, t, drop, span = llt
            lab = tr.source.label  # type: ignore[union-attr]
            decline = -t.slope * span
            declining = (t.z < c.decay_z and drop > c.decay_drop_sigma * t.sigma
                         and decline >= c.decay_min_decline_sigma * t.sigma)
            dtr0 = self._tracks["displacement"]
            net_displaced: bool | None = None  # None: no same-token displacement measured (e.g. a verl run)
            if dtr0.source is not None and len(dtr0.values) >= c.displacement_window:
                # the likelihood is measured on fresh samples each step, so a cross-step decline can be a
                # shift of the sampled responses; the same-token displacement says whether the step's
                # updates on balance LOWER the preserved responses (the decline is displacement) or not
                # net = most of the last `displacement_window` steps are negative with a negative median, or the
                # same-token changes sum to less than zero over the steps the likelihood trend is measured on
                # (displacement is heavy-tailed: a few steps that displace a lot outweigh many small gains,
                # which a median or a count of negative steps does not see; the longer window keeps one
                # outlying step from deciding it)
                _, d0 = dtr0.last(int(c.displacement_window))
                by_count = (float(np.mean(d0 < -c.displacement_eps)) >= c.net_displacement_frac
                            and fast_median(d0) < 0)
                _, d_long = dtr0.last(int(c.trend_window))
                d_mean = float(np.mean(d_long))
                net_displaced = by_count or d_mean < -c.displacement_eps
            corroborated = bool(net_displaced) and t.z < c.corroborated_decay_z and drop > 0
            if declining and net_displaced is None:
                # step scalars only: a fresh-sample likelihood (proxy) declines and nothing says whether the
                # updates displace it; drift of the sampled responses looks the same, so this is no warning
                suspect_decay.append(_Evidence(
                    lab, t.z, c.decay_z,
                    f"{PROXY_DECLINE_MESSAGE} ({lab} trend z={t.z:.2f} over the last {t.n} points, "
                    f"{drop / max(t.sigma, 1e-12):.1f} sigma below its peak)", suspected=False))
            elif declining and net_displaced is False:
                suspect_decay.append(_Evidence(
                    lab, t.z, c.decay_z,
                    f"{lab} declining (trend z={t.z:.2f} over the last {t.n} points) but "
                    f"{dtr0.source.label} is not net negative: a shift of the sampled responses, not displacement"))
            elif declining or corroborated:
                zt = c.decay_z if declining else c.corroborated_decay_z
                also = "" if declining else (
                    f", and {dtr0.source.label} < 0 on most of the last {c.displacement_window} steps" if by_count else
                    f", and {dtr0.source.label} net negative over the last {d_long.size} steps "
                    f"(mean {_fmt(d_mean)})")
                decay_ev.append(_Evidence(
                    lab, t.z, zt,
                    f"{lab} declining: trend z={t.z:.2f} over the last {t.n} points (threshold {zt:g}), "
                    f"slope {_fmt(t.slope)}/step, {drop / max(t.sigma, 1e-12):.1f} sigma below its peak{also}"))
            elif t.z <= c.rise_z:
                stag_ev = _Evidence(
                    lab, t.z, c.rise_z,
                    f"{lab} has stopped rising: trend z={t.z:.2f} over the last {t.n} points "
                    f"(rising needs > {c.rise_z:g})")
            # acceleration of an ongoing decline (phase III)
            if t.slope < 0 and self._latches[DECAY].active:
                xs, ys = tr.last(int(c.accel_window))
                if xs.size >= 3 and np.ptp(xs) > 0:
                    ts = theil_sen(xs, ys, sigma_floor=c.sigma_floor_rel * abs(fast_median(ys)))
                    if ts.slope < c.accel_factor * t.slope and ts.z < c.decay_z:
                        accel_ev.append(_Evidence(
                            lab, ts.slope / t.slope, c.accel_factor,
                            f"{lab} decline accelerating: last {ts.n} points fall {ts.slope / t.slope:.1f}x as fast as "
                            f"the last {t.n} (threshold {c.accel_factor:g}x)"))

        dtr = self._tracks["displacement"]
        if dtr.source is not None and len(dtr.values) >= c.displacement_window:
            _, d = dtr.last(int(c.displacement_window))
            neg = float(np.mean(d < -c.displacement_eps))
            if neg >= c.displacement_neg_frac and fast_median(d) < -c.displacement_eps:
                lab = dtr.source.label
                decay_ev.append(_Evidence(
                    lab, neg, c.displacement_neg_frac,
                    f"{lab} < 0 on {neg:.0%} of the last {d.size} steps (threshold {c.displacement_neg_frac:.0%}): "
                    f"the step's updates keep lowering the likelihood of preserved (A >= 0) responses"))

        decaying = self._latches[DECAY].active  # phase III evidence counts only after a confirmed decay
        surges: list[_Evidence] = []
        for name, sign in (("ll_correct", -1.0), ("entropy", 1.0), ("grad_norm", 1.0), ("clip_frac", 1.0),
                           ("ppo_kl", 1.0)):
            s = self._surge(name, sign)
            if s is None:
                continue
            surge, spike_now, recent_med, level, hits, med = s
            lab = self._tracks[name].source.label  # type: ignore[union-attr]
            if surge:
                what, rel = ("plunge", "below") if sign < 0 else ("surge", "above")
                surges.append(_Evidence(
                    lab, recent_med, level,
                    f"{lab} {what}: {hits} of the last {c.surge_window} points {rel} {_fmt(level)} "
                    f"(baseline median {_fmt(med)}), recent median {_fmt(recent_med)}"))
            elif sign > 0 and spike_now and hits == 1 and self._cooled("spike:" + name):
                v = self._tracks[name].values[-1]
                self._emit(out, step, "info", lab, v, level,
                           f"isolated {lab} spike {_fmt(v)} (level {_fmt(level)}, baseline median {_fmt(med)}); "
                           f"not sustained, not a collapse")
        if surges and (decaying or len(surges) >= 2):
            accel_ev.extend(surges)
        elif surges:
            suspect_ev.extend(surges)

        rc = self._reward
        if decaying and math.isfinite(rc.smoothed) and rc.peak >= c.collapse_min_peak \
                and rc.smoothed < c.reward_degrade_frac * rc.peak:
            lab = self._tracks["reward"].source.label  # type: ignore[union-attr]
            accel_ev.append(_Evidence(
                lab, rc.smoothed, c.reward_degrade_frac * rc.peak,
                f"reward falling during the likelihood decay: smoothed {_fmt(rc.smoothed)} < "
                f"{c.reward_degrade_frac:g} x peak {_fmt(rc.peak)}"))
        return stag_ev, decay_ev, accel_ev, suspect_ev, suspect_decay
