"""What a W&B run holds beside its history: summary-only scalars, and TRL's `completions` tables as samples.

- **summary-only scalars** (TRL's ``train_loss``, ``train_runtime``, a final eval written to ``run.summary``):
  kept in `metrics` at the run's last step, under their own keys;
- **TRL's ``completions`` table** (offline runs: the table file in the run folder): one `samples` row per
  completion (step, prompt, reward = sum of the reward-function columns, advantage, text).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

COMPLETIONS_KEYS = ("completions", "train/completions")
TABLE_TYPES = ("table-file", "table", "partitioned-table")
_NON_REWARD_COLUMNS = frozenset({"step", "prompt", "completion", "advantage", "image"})


def summary_only(summary: Mapping[str, Any], logged: set[str]) -> dict[str, float]:
    """Numeric summary values whose key never appeared in the history (W&B-internal `_...` keys left out)."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if k.startswith("_") or k in logged or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k] = float(v)
    return out


def table_ref(key: str, value: Any) -> str | None:
    """The file of a TRL completions table value in a history row (offline runs), else None."""
    if key not in COMPLETIONS_KEYS or not isinstance(value, dict) or value.get("_type") not in TABLE_TYPES:
        return None
    f = value.get("_file")
    return f if isinstance(f, str) else None


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # conversational: [{"role": ..., "content": ...}, ...]
        parts = [m.get("content") if isinstance(m, dict) else m for m in v]
        return "\n".join(str(p) for p in parts if p is not None)
    return json.dumps(v, default=str)


def completions_samples(
    refs: list[tuple[int, str]], reward_names: set[str]
) -> tuple[dict[str, list[Any]] | None, list[str]]:
    """`samples` columns from TRL completions tables ``[(step of the row, table file)]``.

    Reward columns are those named by the run's ``rewards/<name>/mean`` keys; without them every numeric
    column other than step / advantage counts. The table's own `step` column wins over the row's step."""
    cols: dict[str, list[Any]] = {k: [] for k in ("step", "sample_idx", "prompt_id", "group_id", "reward",
                                                 "advantage", "question", "text")}
    problems: list[str] = []
    per_step: dict[int, int] = {}  # sample_idx is unique within a step, across tables
    for row_step, file in refs:
        try:
            tbl = json.loads(Path(file).read_text())
            columns, data = list(tbl["columns"]), list(tbl["data"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"completions table {Path(file).name} unreadable ({type(exc).__name__}); skipped")
            continue
        idx = {c: i for i, c in enumerate(columns)}
        rcols = [c for c in columns if c in reward_names] or [
            c for c in columns if c not in _NON_REWARD_COLUMNS and data and isinstance(data[0][idx[c]], (int, float))
        ]
        prompts: dict[str, int] = {}
        for j, rec in enumerate(data):
            step = rec[idx["step"]] if "step" in idx and isinstance(rec[idx["step"]], (int, float)) else row_step
            prompt = _text(rec[idx["prompt"]]) if "prompt" in idx else None
            pid = str(prompts.setdefault(prompt or f"row{j}", len(prompts)))
            rewards = [_num(rec[idx[c]]) for c in rcols]
            step = int(step)
            cols["step"].append(step)
            cols["sample_idx"].append(per_step.get(step, 0))
            per_step[step] = per_step.get(step, 0) + 1
            cols["prompt_id"].append(pid)
            cols["group_id"].append(pid)
            cols["reward"].append(math.fsum(r for r in rewards if not math.isnan(r)) if rewards else math.nan)
            cols["advantage"].append(_num(rec[idx["advantage"]]) if "advantage" in idx else math.nan)
            cols["question"].append(prompt)
            cols["text"].append(_text(rec[idx["completion"]]) if "completion" in idx else None)
    if not cols["step"]:
        return None, problems
    return cols, problems


def reward_function_names(keys: Iterable[str]) -> set[str]:
    """TRL reward function names from ``[train/]rewards/<name>/mean`` keys."""
    out: set[str] = set()
    for k in keys:
        k = k.removeprefix("train/")
        if k.startswith("rewards/") and k.endswith("/mean"):
            out.add(k[len("rewards/") : -len("/mean")])
    return out
