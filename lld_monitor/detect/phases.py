"""Phase names: the one place that says what each phase is called (the detector, `detect --json`, the
store's alerts, the run picker's badge and the dashboard's bands all use these).

Key (stored, in `detect --json` `phase`)   title (what a person reads)    meaning
healthy                                     healthy                        likelihood still rising / nothing known yet
stagnation                                  phase I (stagnation)           likelihood trend flat
decay                                       phase II (likelihood decay)    likelihood declining with displacement
acceleration                                phase III (acceleration)       decline accelerating, surges; reward may
                                                                           be falling but has NOT collapsed
collapse                                    reward collapsed               the written reward-collapse definition
                                                                           holds (docs/detector.md)
Before this split, the key `collapse` also covered phase III; it now means only a collapsed reward.
Phases are ordered by severity: PHASES.index(a) < PHASES.index(b) means b is the worse state.
"""

from __future__ import annotations

HEALTHY = "healthy"
STAGNATION = "stagnation"
DECAY = "decay"
ACCELERATION = "acceleration"
COLLAPSE = "collapse"

PHASES: tuple[str, ...] = (HEALTHY, STAGNATION, DECAY, ACCELERATION, COLLAPSE)
"""In order of severity."""

PHASE_TITLES: dict[str, str] = {
    HEALTHY: "healthy",
    STAGNATION: "phase I (stagnation)",
    DECAY: "phase II (likelihood decay)",
    ACCELERATION: "phase III (acceleration)",
    COLLAPSE: "reward collapsed",
}
"""What a person reads for each phase key (badges, messages, `detect` text output)."""

PHASE_SEVERITY: dict[str, str] = {
    STAGNATION: "info",
    DECAY: "warning",
    ACCELERATION: "critical",
    COLLAPSE: "critical",
}
"""Severity of the alert raised when a phase is entered."""


def phase_level(phase: str) -> int:
    """Severity rank of a phase key (0 = healthy); unknown keys rank as healthy."""
    return PHASES.index(phase) if phase in PHASES else 0


def phase_title(phase: str | None) -> str:
    """The title of a phase key; an unknown key is returned as it is ("no phase" for None)."""
    if phase is None:
        return "no phase"
    return PHASE_TITLES.get(phase, phase)
