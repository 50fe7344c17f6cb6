"""Which step signal the dashboard draws, resolved from canonical or imported (verl / TRL) names through
the registry (`lld_monitor.signals`), the live panels, and EMA smoothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lld_monitor import signals as registry

# canonical name -> the exact external keys found in imported runs (first present wins, canonical first).
# Same ranking as the detector's (`signals.candidates`); proxies are not drawn under a canonical name:
# they stay selectable under their own key (docs/signals.md).
ALIASES: dict[str, tuple[str, ...]] = {
    name: tuple(src.key for src in registry.candidates(name, proxies=False) if src.key != name)
    for name in registry.STEP_SIGNALS
}
COLOURS: dict[str, str] = {s.name: s.colour for s in registry.SIGNALS}


@dataclass(frozen=True)
class SignalSpec:
    """One panel of the live-health grid: a title and the signals drawn in it (second axis optional)."""

    title: str
    signals: tuple[str, ...]
    secondary: tuple[str, ...] = ()
    # an early-warning panel: once a run reaches phase III, its y-axis fits the steps before it, so the
    # phase II move stays readable instead of being flattened by the post-collapse values
    early: bool = False


LIVE_PANELS: tuple[SignalSpec, ...] = (
    SignalSpec("Reward: mean reward per step · dotted: accuracy (share of responses rewarded)", ("reward_mean",), ("accuracy",)),
    SignalSpec("Log-likelihood of correct responses (nats per action token): the first to fall in the LLD spiral",
               ("ll_correct_mean",), early=True),
    SignalSpec("Displacement Δ of preserved responses (nats per action token) · dotted, right: share of their actions"
               " displaced", ("delta_preserved_mean",), ("frac_actions_displaced",), early=True),
    SignalSpec("Entropy of the policy (nats per action token)", ("entropy",)),
    SignalSpec("Gradient norm before clipping (L2)", ("grad_norm",)),
    SignalSpec("Log-likelihood of incorrect responses (nats per action token)", ("ll_incorrect_mean",)),
)

LABELS: dict[str, str] = {s.name: s.label for s in registry.SIGNALS if s.stored}

COMPARE_DEFAULT: tuple[str, ...] = (
    "reward_mean", "ll_correct_mean", "delta_preserved_mean", "frac_actions_displaced", "entropy", "grad_norm",
)


label = registry.label


def resolve(signals: pd.DataFrame, name: str) -> pd.Series | None:
    """The column for `name` (canonical, else the first alias present with any value), or None."""
    for key in (name, *ALIASES.get(name, ())):
        parts = registry.Source(key, registry.OURS, True).parts  # "a + b": a key derived from two
        if all(p in signals.columns for p in parts):
            cols = [pd.to_numeric(signals[p], errors="coerce") for p in parts]
            col = cols[0] if len(cols) == 1 else cols[0] + cols[1]
            if col.notna().any():
                return col
    return None


def canonical_frame(signals: pd.DataFrame, names: tuple[str, ...] | list[str] | None = None) -> pd.DataFrame:
    """`step` plus canonical columns (resolved through ALIASES); columns without data are left out."""
    if signals is None or signals.empty or "step" not in signals.columns:
        return pd.DataFrame({"step": pd.Series([], dtype="int64")})
    out = {"step": signals["step"].to_numpy()}
    wanted = names if names is not None else tuple(dict.fromkeys([*LABELS, *ALIASES]))
    for name in wanted:
        col = resolve(signals, name)
        if col is not None:
            out[name] = col.to_numpy(dtype="float64")
    return pd.DataFrame(out)


def available(signals: pd.DataFrame) -> list[str]:
    """Every numeric signal the run has (canonical names first, then other metric keys)."""
    canon = [c for c in canonical_frame(signals).columns if c != "step"]
    skip = {"step", "run_id", "time", "n_samples", *canon}
    for key in list(skip):
        skip.update(ALIASES.get(key, ()))
    rest = [
        c for c in signals.columns
        if c not in skip and pd.api.types.is_numeric_dtype(signals[c]) and signals[c].notna().any()
    ]
    return canon + sorted(rest)


def ema(values: pd.Series | np.ndarray, smoothing: float) -> np.ndarray:
    """Exponential moving average; smoothing in [0, 1): 0 = raw, 0.9 = heavy. NaN gaps are skipped, not filled."""
    s = pd.Series(np.asarray(values, dtype="float64"))
    if smoothing <= 0:
        return s.to_numpy()
    smoothing = min(float(smoothing), 0.999)
    out = s.ewm(alpha=1.0 - smoothing, adjust=True, ignore_na=True).mean()
    out[s.isna()] = np.nan
    return out.to_numpy()
