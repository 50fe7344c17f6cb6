"""The run store's tables: one Arrow schema per table, the single source of truth for column names.

Every writer (RunLogger, the W&B importer, the TRL hook) and every reader (dashboard, detector, CLI)
uses these names. Changing a column means bumping SCHEMA_VERSION and adding a migration in
`lld_monitor/store/migrations.py`.

Conventions
- `run_id` is a filesystem-safe id; `name` is free text (quotes, semicolons, unicode are kept as is).
- log-probs are natural logs; Δ (displacement) = logp_new − logp_old on the same tokens
  (negative = the likelihood fell), as in the paper's Δ_t = ln π_after − ln π_before.
- Step signals that a run does not have are NULL, never 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

import pyarrow as pa

from lld_monitor import signals

SCHEMA_VERSION = 2  # v2: the detector_state table (migrations.py)

MODES = ("vanilla", "llds", "llds_ma", "unknown")  # stored spelling; input may say llds-ma
SOURCES = ("local", "trl", "wandb", "verl")
STATUSES = ("running", "finished", "crashed")
SEVERITIES = ("info", "warning", "critical")
# == lld_monitor.detect.phases.PHASES as a set; "acceleration" (phase III) appended so W&B phase indices stay
# stable (lld/phase); "collapse" now means only a collapsed reward
PHASES = ("healthy", "stagnation", "decay", "collapse", "acceleration")

# runs: one row per run (stored as the run's metadata file, exposed as a table by the reader).
RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("name", pa.string()),
        ("mode", pa.string()),  # one of MODES
        ("source", pa.string()),  # one of SOURCES
        ("status", pa.string()),  # one of STATUSES
        ("config", pa.string()),  # JSON text
        ("model", pa.string()),
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("ended_at", pa.timestamp("us", tz="UTC")),
        ("updated_at", pa.timestamp("us", tz="UTC")),
        ("world_size", pa.int32()),
        ("schema_version", pa.int32()),
    ]
)

# steps: one row per optimizer step (written by rank 0 only in a distributed run, from all ranks' samples).
# The step signals, their meanings and units are the registry's (lld_monitor/signals.py, docs/signals.md).
STEP_SIGNALS: tuple[str, ...] = signals.STEP_SIGNALS
STEPS = pa.schema(
    [("run_id", pa.string()), ("step", pa.int64()), ("time", pa.timestamp("us", tz="UTC")), ("n_samples", pa.int32())]
    + [(name, pa.float64()) for name in STEP_SIGNALS]
)

# metrics: long form for every scalar that is not a STEP_SIGNAL (imports lose nothing).
METRICS = pa.schema(
    [("run_id", pa.string()), ("step", pa.int64()), ("key", pa.string()), ("value", pa.float64())]
)

# samples: one row per rollout.
SAMPLES = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("sample_idx", pa.int32()),  # unique within (step, rank)
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("correct", pa.bool_()),
        ("n_actions", pa.int32()),
        ("n_searches", pa.int32()),
        ("n_action_tokens", pa.int32()),
        ("logp_old_sum", pa.float64()),  # Σ over action tokens of ln π_old
        ("logp_new_sum", pa.float64()),  # Σ over the same tokens of ln π after the step's last update
        ("delta_sum", pa.float64()),  # logp_new_sum − logp_old_sum
        ("delta_mean", pa.float64()),  # delta_sum / n_action_tokens
        ("n_actions_displaced", pa.int32()),  # actions whose Σ Δ < 0
        ("question", pa.string()),
        ("gold", pa.string()),
        ("text", pa.string()),  # the decoded response (actions and observations)
    ]
)

# tokens: one row per response token of logged (sampled) samples; Δ is derived (logp_new − logp_old).
TOKENS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("sample_idx", pa.int32()),
        ("position", pa.int32()),
        ("token_id", pa.int32()),
        ("token_text", pa.string()),
        ("role", pa.string()),  # one of lld_monitor.roles.ROLES; tool tokens carry NULL log-probs
        ("action_idx", pa.int32()),  # -1 for tool tokens
        ("logp_old", pa.float32()),
        ("logp_new", pa.float32()),
        ("logp_ref", pa.float32()),
        ("entropy", pa.float32()),
    ]
)

# alerts: raised by the detector (online in the writer, or offline).
ALERTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("phase", pa.string()),  # one of PHASES
        ("severity", pa.string()),  # one of SEVERITIES
        ("signal", pa.string()),
        ("value", pa.float64()),
        ("threshold", pa.float64()),
        ("message", pa.string()),
    ]
)

ALERT_COLUMNS: tuple[str, ...] = tuple(c for c in ALERTS.names if c != "run_id")

# detector_state: checkpoints of the online detector (rank 0; lld_monitor/detect/checkpoint.py), so a reader replays
# only the steps after the last one it can trust. Never read by anything but the detector's resume; JSON is opaque here.
DETECTOR_STATE = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),  # the last step the detector had consumed
        ("lineage", pa.string()),  # one detector's life (a RunLogger, or a dashboard's full replay: "cache-...")
        ("seq", pa.int64()),  # 0, 1, 2, ... within the lineage
        ("config", pa.string()),  # fingerprint of the DetectorConfig it ran with
        ("digest", pa.string()),  # chained SHA-256 of the rows it consumed (hex)
        ("rows", pa.int64()),  # rows consumed so far
        ("state", pa.string()),  # JSON: OnlineDetector.to_state()
        ("alerts", pa.string()),  # JSON: alerts raised since the lineage's previous checkpoint
        ("phase_changes", pa.string()),  # JSON: [step, phase] changes since the previous checkpoint
        ("forecast", pa.string()),  # JSON: [step, p_collapse] since the previous checkpoint (NULL: written before)
    ]
)


def alert_record(alert: Any) -> dict[str, Any]:
    """An alert (detector dataclass, mapping or object with the fields) as {column: value} over ALERT_COLUMNS."""
    if is_dataclass(alert) and not isinstance(alert, type):
        d = asdict(alert)
    elif isinstance(alert, Mapping):
        d = dict(alert)
    else:
        d = {c: getattr(alert, c, None) for c in ALERT_COLUMNS}
    return {c: d.get(c) for c in ALERT_COLUMNS}


def normalize_mode(mode: str | None) -> str:
    """The stored spelling of a training mode: `llds-ma` and `LLDS_MA` become `llds_ma`; None is unknown."""
    m = "unknown" if mode is None else str(mode).strip().lower().replace("-", "_")
    if m not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)} (llds-ma is accepted too)")
    return m


TABLES: dict[str, pa.Schema] = {
    "runs": RUNS,
    "steps": STEPS,
    "metrics": METRICS,
    "samples": SAMPLES,
    "tokens": TOKENS,
    "alerts": ALERTS,
    "detector_state": DETECTOR_STATE,
}
