"""Pair a vanilla run with its LLDS / LLDS-MA twin: same config except the mode / regularizer keys."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

# config keys that may differ between a vanilla run and its regularized twin (matched on the last
# dotted component, case-insensitive), plus keys that name or place a run rather than configure it
PAIR_KEYS = {
    "mode", "regularizer", "lam", "lambda", "llds_lambda", "llds_lam", "answer_weight", "adaptive_beta", "beta",
    "v_base", "gate", "llds_gate", "llds_norm", "use_llds", "llds", "llds_ma",
}
IDENTITY_KEYS = {"name", "run_name", "run_id", "store", "store_path", "output_dir", "out_dir", "log_dir", "wandb_run"}
# how long / where a run ran, not how it learns: a 200-step run is still the twin of a 300-step one
EXECUTION_KEYS = {"steps", "max_steps", "total_steps", "total_training_steps", "device", "threads", "num_threads"}


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj} if prefix else {}


def comparable_config(config: str | dict | None) -> dict[str, Any]:
    """The flattened config without pairing, identity and execution keys (and without any `llds*` sub-tree)."""
    if config is None or (isinstance(config, float) and pd.isna(config)):
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config) if config.strip() else {}
        except json.JSONDecodeError:
            return {}
    if not isinstance(config, dict):
        return {}
    out = {}
    for key, value in _flatten(config).items():
        parts = [p.lower() for p in key.split(".")]
        if (parts[-1] in PAIR_KEYS or parts[-1] in IDENTITY_KEYS or parts[-1] in EXECUTION_KEYS
                or any(p.startswith("llds") for p in parts)):
            continue
        out[key] = value
    return out


def config_distance(a: dict, b: dict) -> int:
    """Number of keys whose value differs (a key missing on one side counts as a difference)."""
    return sum(1 for k in set(a) | set(b) if a.get(k, object()) != b.get(k, object()))


def twin_candidates(runs: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Other-mode runs ranked as twins of `run_id`: config distance ascending, LLDS before LLDS-MA, newest first.

    Columns: run_id, name, mode, distance, exact (distance == 0).
    """
    cols = ["run_id", "name", "mode", "distance", "exact"]
    if runs is None or runs.empty or run_id not in set(runs["run_id"]):
        return pd.DataFrame(columns=cols)
    me = runs[runs["run_id"] == run_id].iloc[0]
    mine = comparable_config(me.get("config"))
    my_mode = str(me.get("mode"))
    others = runs[(runs["run_id"] != run_id) & (runs["mode"].astype(str) != my_mode)]
    rows = []
    # a vanilla run's twin is LLDS, then LLDS-MA; a regularized run's twin is its vanilla run first
    mode_rank = {"vanilla": 0, "llds": 1, "llds_ma": 2, "unknown": 3} if my_mode != "vanilla" else {"llds": 0, "llds_ma": 1, "unknown": 3}
    for _, r in others.iterrows():
        d = config_distance(mine, comparable_config(r.get("config")))
        started = r.get("started_at")
        rows.append({
            "run_id": r["run_id"], "name": r.get("name"), "mode": r.get("mode"), "distance": d, "exact": d == 0,
            "_mode_rank": mode_rank.get(str(r.get("mode")), 4),
            "_started": pd.Timestamp(started).value if started is not None and not pd.isna(started) else 0,
        })
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows).sort_values(["distance", "_mode_rank", "_started"], ascending=[True, True, False], kind="stable")
    return df[cols].reset_index(drop=True)


def best_twin(runs: pd.DataFrame, run_id: str) -> str | None:
    c = twin_candidates(runs, run_id)
    return None if c.empty else str(c.iloc[0]["run_id"])


def differences_table(
    frames: dict[str, pd.DataFrame], steps: list[int], names: list[str]
) -> pd.DataFrame:
    """Values of `names` at `steps` for each run (the latest stored step ≤ the asked one), plus B − A for two runs.

    `frames`: label -> canonical signals frame (column "step" + signal columns). Long rows: step, signal, per-run values.
    """
    labels = list(frames)
    rows = []
    for step in steps:
        for name in names:
            row: dict[str, Any] = {"step": int(step), "signal": name}
            vals = []
            for lab in labels:
                f = frames[lab]
                v = None
                if f is not None and len(f) and name in f.columns:
                    sub = f[f["step"] <= step]
                    if len(sub):
                        x = sub[name].iloc[-1]
                        v = None if pd.isna(x) else float(x)
                row[lab] = v
                vals.append(v)
            if len(labels) == 2:
                a, b = vals
                row[f"{labels[1]} − {labels[0]}"] = None if a is None or b is None else b - a
            rows.append(row)
    return pd.DataFrame(rows)
