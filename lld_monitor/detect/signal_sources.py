"""Which column feeds which detector signal: derived from the registry (`lld_monitor.signals`).

A run may carry our step columns, raw verl / Search-R1 metric keys (imported W&B runs) or TRL keys.
Each detector signal has ranked candidates (`signals.detector_candidates`: the feeding columns and
their exact keys first, proxies last); the first candidate with a finite value is used, and once a
signal has `warmup` points its source is locked for the rest of the run (so one series never mixes
two scales). A higher-priority source that shows up during warm-up replaces a lower one (its history
restarts). The table is in docs/signals.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lld_monitor import signals as registry

Getter = Callable[[Mapping[str, object]], float | None]


@dataclass(frozen=True)
class Candidate:
    label: str  # what alerts name as the signal (a column name, or "a / b" for derived ones)
    get: Getter
    exact: bool = True  # False: a proxy of the registry column (see docs/signals.md)


SIGNAL_CANDIDATES: dict[str, tuple[Candidate, ...]] = {
    name: tuple(Candidate(src.key, src.read, src.exact) for src in registry.detector_candidates(name))
    for name in registry.DETECTOR_SIGNALS
}
SIGNALS: tuple[str, ...] = tuple(SIGNAL_CANDIDATES)
# every raw column some candidate reads (used to trim DataFrames before replay)
KNOWN_COLUMNS: frozenset[str] = frozenset(
    key
    for name in SIGNALS
    for src in registry.detector_candidates(name)
    for key in (*src.parts, *([src.only_if_positive] if src.only_if_positive else []))
)


def first_present(signal: str, sig: Mapping[str, object]) -> tuple[int, Candidate, float] | None:
    """The highest-priority candidate of `signal` with a non-NaN value in `sig` (inf counts: it is reported)."""
    for rank, cand in enumerate(SIGNAL_CANDIDATES[signal]):
        v = cand.get(sig)
        if v is not None and not math.isnan(v):
            return rank, cand, v
    return None


def resolve_columns(columns) -> dict[str, str]:
    """Which candidate each signal would use for a table with these columns (highest priority
    present), e.g. to show the user what the detector can see. Signals with no column are left out."""
    fake = {c: 1.0 for c in set(columns)}
    out: dict[str, str] = {}
    for signal in SIGNALS:
        hit = first_present(signal, fake)
        if hit is not None:
            out[signal] = hit[1].label
    return out
