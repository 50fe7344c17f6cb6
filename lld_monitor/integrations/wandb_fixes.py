"""What the W&B importer corrects or adds beyond the plain key mapping (used by `to_store.write_run`).

- **verl loss scale.** Current verl's actor (`dp_actor.update_policy`) accumulates
  ``metrics["actor/pg_loss"] += pg_loss * loss_scale_factor`` (and ``actor/kl_loss`` likewise) over the
  micro-batches of a mini-batch *and* over every mini-batch and PPO epoch of the step, so the logged value is
  the mini-batch mean summed over ``ppo_epochs × train_batch_size / ppo_mini_batch_size`` updates. When the
  run's config gives that count, the `pg_loss` / `kl` step signals are divided by it (the raw values stay in
  `metrics` under their own keys); when it does not, the import says so. Search-R1's fork (an older verl)
  averages with ``append_to_dict`` and is left as is.
- **no fake zero KL.** That verl initialises ``actor/kl_loss = 0.0`` and logs it even with
  ``use_kl_loss=False``: the `kl` signal is then left empty, not 0.
- **verl bypass mode** (``algorithm.rollout_correction.bypass_mode``): ``old_log_probs = rollout_log_probs``,
  so a displacement or ``actor/ppo_kl`` measures the rollout-engine / trainer mismatch, not LLD. Reported.
- **summary-only scalars** (TRL's ``train_loss``, ``train_runtime``, a final eval written to
  ``run.summary``): kept in `metrics` at the run's last step, under their own keys.
- **TRL's ``completions`` table** (offline runs: the table file in the run folder): one `samples` row per
  completion (step, prompt, reward = sum of the reward-function columns, advantage, text).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from lld_monitor.integrations import mapping

log = logging.getLogger(__name__)

SignalFix = Callable[[dict[str, float]], None]

VERL_UPDATE_KEYS = (
    "actor_rollout_ref.actor.ppo_epochs",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
)
COMPLETIONS_KEYS = ("completions", "train/completions")
TABLE_TYPES = ("table-file", "table", "partitioned-table")
_NON_REWARD_COLUMNS = frozenset({"step", "prompt", "completion", "advantage", "image"})


def _is_search_r1(flat: Mapping[str, Any], keys: Iterable[str]) -> bool:
    ks = set(keys)
    return (
        "actor/loss_noreduce" in ks
        or any(k.startswith("env/") for k in ks)
        or mapping._find(dict(flat), "no_reduce_lambda") is not None
        or mapping._find(dict(flat), "state_masking") is not None
    )


def _int(v: Any) -> int | None:
    try:
        i = int(v)
    except (TypeError, ValueError):
        return None
    return i if i > 0 else None


def verl_updates_per_step(config: Mapping[str, Any]) -> int | None:
    """ppo_epochs × (train_batch_size / ppo_mini_batch_size) from a verl config, or None if a value is missing."""
    flat = mapping._walk(dict(config))
    epochs, batch, mini = (_int(flat.get(k)) for k in VERL_UPDATE_KEYS)
    if epochs is None or batch is None or mini is None:
        return None
    return epochs * max(1, batch // mini)


def signal_fix(config: Mapping[str, Any], keys: Iterable[str]) -> tuple[SignalFix | None, list[str], dict[str, Any]]:
    """The correction of mapped step signals for a run, the notes for the import report, and what was done
    (kept in ``config._lld_monitor_import``)."""
    keys = set(keys)
    if not any(k in keys for k in ("actor/pg_loss", "actor/kl_loss")):
        return None, [], {}
    flat = mapping._walk(dict(config))
    notes: list[str] = []
    done: dict[str, Any] = {}
    bypass = flat.get("algorithm.rollout_correction.bypass_mode")
    if mapping._truthy(bypass) if bypass is not None else False:
        notes.append("verl bypass mode (old_log_probs = rollout_log_probs): actor/ppo_kl and any displacement "
                     "measure the rollout / trainer mismatch, not LLD")
        done["bypass_mode"] = True
    if _is_search_r1(flat, keys):
        return None, notes, done
    use_kl = flat.get("actor_rollout_ref.actor.use_kl_loss")
    drop_kl = use_kl is not None and not mapping._truthy(use_kl)
    if drop_kl:
        notes.append("use_kl_loss is off: verl logs actor/kl_loss = 0.0 anyway; the kl signal is left empty")
        done["kl_dropped"] = "use_kl_loss=False"
    n = verl_updates_per_step(config)
    if n is None:
        missing = [k for k in VERL_UPDATE_KEYS if _int(flat.get(k)) is None]
        notes.append("actor/pg_loss and actor/kl_loss are mapped as logged: current verl sums them over the "
                     f"step's mini-batch updates, and the config lacks {missing} to count them")
        done["loss_scale"] = "unknown"
    elif n > 1:
        notes.append(f"actor/pg_loss and actor/kl_loss divided by {n} mini-batch updates per step "
                     "(verl sums them over updates; the raw values stay in metrics)")
        done["loss_scale"] = n

    def fix(sig: dict[str, float]) -> None:
        if drop_kl:
            sig.pop("kl", None)
        if n is not None and n > 1:
            for name in ("pg_loss", "kl"):
                if name in sig:
                    sig[name] = sig[name] / n

    return fix, notes, done


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


__all__ = [
    "completions_samples",
    "reward_function_names",
    "signal_fix",
    "summary_only",
    "table_ref",
    "verl_updates_per_step",
]
