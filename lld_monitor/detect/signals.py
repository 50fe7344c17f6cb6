"""Which column feeds which detector signal.

A run may carry our canonical step columns (`lld_monitor.store.schema.STEP_SIGNALS`), raw verl /
Search-R1 metric keys (imported W&B runs, see research/paper.md section 5) or TRL GRPOTrainer keys.
Each detector signal has an ordered list of candidates; the first candidate with a finite value is
used, and once a signal has `warmup` points its source is locked for the rest of the run (so one
series never mixes two scales). A higher-priority source that shows up during warm-up replaces a
lower one (its history restarts).

Detector signal    candidates (priority order)
reward             reward_mean, critic/score/mean, critic/rewards/mean, reward, train/reward, rewards/mean,
                   accuracy
ll_correct         ll_correct_mean, actor/pos_avg_old_log_prob, ll_correct_sum
displacement       delta_preserved_mean, delta_preserved          (our runs only; negative = fell)
frac_displaced     frac_actions_displaced, frac_responses_displaced,
                   actor/mean_reduce_chunk / env/number_of_actions/mean (derived)
entropy            entropy, actor/entropy_loss, actor/entropy, train/entropy
grad_norm          grad_norm, actor/grad_norm, train/grad_norm
clip_frac          clip_frac, actor/pg_clipfrac, clip_ratio/region_mean, train/clip_ratio/region_mean,
                   clip_ratio/low_mean + clip_ratio/high_mean (derived), clip_ratio
ppo_kl             actor/ppo_kl   (verl: signed within-step likelihood change, positive = fell)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Getter = Callable[[Mapping[str, object]], float | None]


def to_float(v: object) -> float | None:
    """A value as float, or None when it is missing / not a number (bool counts as number)."""
    if v is None:
        return None
    try:
        f = float(v)  # numpy scalars, 0-d arrays, ints, bools, decimal strings
    except (TypeError, ValueError):
        return None
    return f


def _col(name: str) -> Getter:
    def get(sig: Mapping[str, object]) -> float | None:
        return to_float(sig.get(name))

    return get


def _ratio(num: str, den: str) -> Getter:
    def get(sig: Mapping[str, object]) -> float | None:
        a, b = to_float(sig.get(num)), to_float(sig.get(den))
        if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b <= 0:
            return None
        return a / b

    return get


def _sum(*names: str) -> Getter:
    def get(sig: Mapping[str, object]) -> float | None:
        vals = [to_float(sig.get(n)) for n in names]
        if any(v is None for v in vals):
            return None
        return float(sum(vals))  # type: ignore[arg-type]

    return get


@dataclass(frozen=True)
class Candidate:
    label: str  # what alerts name as the signal (a column name, or "a / b" for derived ones)
    get: Getter


def _c(name: str) -> Candidate:
    return Candidate(name, _col(name))


SIGNAL_CANDIDATES: dict[str, tuple[Candidate, ...]] = {
    "reward": (
        _c("reward_mean"),
        _c("critic/score/mean"),
        _c("critic/rewards/mean"),
        _c("reward"),
        _c("train/reward"),
        _c("rewards/mean"),
        _c("accuracy"),
    ),
    "ll_correct": (
        _c("ll_correct_mean"),
        _c("actor/pos_avg_old_log_prob"),
        _c("ll_correct_sum"),
    ),
    "displacement": (
        _c("delta_preserved_mean"),
        _c("delta_preserved"),
    ),
    "frac_displaced": (
        _c("frac_actions_displaced"),
        _c("frac_responses_displaced"),
        Candidate(
            "actor/mean_reduce_chunk / env/number_of_actions/mean",
            _ratio("actor/mean_reduce_chunk", "env/number_of_actions/mean"),
        ),
    ),
    "entropy": (
        _c("entropy"),
        _c("actor/entropy_loss"),
        _c("actor/entropy"),
        _c("train/entropy"),
    ),
    "grad_norm": (
        _c("grad_norm"),
        _c("actor/grad_norm"),
        _c("train/grad_norm"),
    ),
    "clip_frac": (
        _c("clip_frac"),
        _c("actor/pg_clipfrac"),
        _c("clip_ratio/region_mean"),
        _c("train/clip_ratio/region_mean"),
        Candidate("clip_ratio/low_mean + clip_ratio/high_mean", _sum("clip_ratio/low_mean", "clip_ratio/high_mean")),
        _c("clip_ratio"),
    ),
    "ppo_kl": (_c("actor/ppo_kl"),),
}

SIGNALS: tuple[str, ...] = tuple(SIGNAL_CANDIDATES)

# every raw column some candidate reads (used to trim DataFrames before replay)
def _known_columns() -> frozenset[str]:
    probe: set[str] = set()

    class _Spy(dict):
        def get(self, key, default=None):  # noqa: ANN001
            probe.add(key)
            return 1.0

    for cands in SIGNAL_CANDIDATES.values():
        for cand in cands:
            cand.get(_Spy())
    return frozenset(probe)


KNOWN_COLUMNS: frozenset[str] = _known_columns()


def first_present(signal: str, sig: Mapping[str, object]) -> tuple[int, Candidate, float] | None:
    """The highest-priority candidate of `signal` that has a value (finite or not) in `sig`."""
    for rank, cand in enumerate(SIGNAL_CANDIDATES[signal]):
        v = cand.get(sig)
        if v is not None and not math.isnan(v):
            return rank, cand, v
    return None


def resolve_columns(columns) -> dict[str, str]:
    """Which candidate each signal would use for a table with these columns (highest priority
    present), e.g. to show the user what the detector can see. Signals with no column are left out."""
    cols = set(columns)
    fake = {c: 0.0 for c in cols}
    out: dict[str, str] = {}
    for signal in SIGNALS:
        hit = first_present(signal, fake)
        if hit is not None:
            out[signal] = hit[1].label
    return out
