"""The counterfactual LLDS term, cached beside the run it was computed from (no torch: the dashboard reads it).

```
<store>/runs/<run_id>/derived/whatif-<key>/steps.parquet    one row per token-logged step (STEP_COLUMNS)
<store>/runs/<run_id>/derived/whatif-<key>/tokens.parquet   one row per gated token (TOKEN_COLUMNS)
```
`<key>` hashes the LLDS settings the numbers depend on (`gate`, `norm`, `answer_weight`, `adaptive_beta`,
`v_base`: the `lld.LLDSConfig` fields apart from `lam`); λ is applied on read (`penalty = lam · llds_raw`),
so every λ shares one cache. Each step row keeps the number of token rows it was computed from
(`n_token_rows`): a step whose count in the store differs (a live run that logged more, a run written
again) is computed again, a new step is added, a step gone from the store is dropped.

The store's own files are never touched: the run's writer lists its segments in its manifests and never
looks into `derived/`, readers only open what a manifest lists, and a run written again with
`overwrite=True` moves its whole folder (this cache included) aside. Files are written to a temp name and
`os.replace`d (tokens first, then steps), so a reader sees an old or a new file, never half of one. When
the run folder is not writable (a read-only store), the cache goes to the user's cache folder instead
(`$XDG_CACHE_HOME` or `~/.cache`, `lld-monitor/whatif/<hash of the store path>/<run_id>/`); readers look
in both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from lld_monitor.files import atomic_write
from lld_monitor.store.location import canonical, is_bucket

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the files' meaning changes: older caches are then recomputed
DERIVED_DIR = "derived"
STEPS_FILE = "steps.parquet"
TOKENS_FILE = "tokens.parquet"

# The lld.LLDSConfig fields and their defaults; lld.py imports torch, so they are repeated here and
# tests/test_whatif.py pins them to lld.LLDSConfig(), lld.GATES and lld.NORMS.
DEFAULT_SETTINGS: dict[str, Any] = {"lam": 0.2, "gate": "action", "norm": "response", "answer_weight": None,
                                    "adaptive_beta": None, "v_base": 2.0}
GATES = ("action", "response", "token")
NORMS = ("response", "token_mean", "seq_mean")
BETA_RULES = ("paper", "code")
KEY_FIELDS = ("gate", "norm", "answer_weight", "adaptive_beta", "v_base")  # what llds_raw depends on (not lam)

# llds_loss's stats, in the order of the `whatif --json` contract
STAT_COLUMNS = ("llds_raw", "n_preserved", "n_gated_responses", "n_gated_actions", "n_penalized_tokens")
STEPS_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("llds_raw", pa.float64()),  # L_LLDS on the step's logged samples, λ not included (null: nothing to score)
    ("n_preserved", pa.int64()),
    ("n_gated_responses", pa.int64()),
    ("n_gated_actions", pa.int64()),
    ("n_penalized_tokens", pa.int64()),
    ("n_samples", pa.int64()),  # logged samples scored at this step
    ("n_samples_skipped", pa.int64()),  # logged samples left out: no advantage, or a missing log-prob on an action token
    ("beta", pa.float64()),  # LLDS-MA answer weight used (1.0 for plain LLDS)
    ("n_token_rows", pa.int64()),  # the step's token rows in the store when computed (the freshness check)
])
TOKENS_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("rank", pa.int32()),
    ("sample_idx", pa.int32()),
    ("position", pa.int32()),
    ("penalized", pa.bool_()),  # gate open, weight > 0 and the likelihood fell: LLDS would have penalised it
    ("penalty", pa.float32()),  # its per-token penalty gate · w · max(0, ln π_old − ln π_new), before normalization
])

NO_TOKENS_HELP = (
    "LLDS works on per-token log-probabilities, and this run has no token rows{why}. Log them with the run: "
    "`RunLogger.log_step(step, samples={{'advantage': ..., 'group_id': ...}}, tokens={{'token_id': ..., "
    "'mask': ..., 'role': ..., 'logp_old': ..., 'logp_new': ...}})` (logp_old = ln π of the rollout policy, "
    "logp_new = ln π after the step's updates, on the same tokens; role 0 action, 1 tool, 2 answer; "
    "`RunLogger(token_every=k, token_groups=m)` samples them), or train through `LLDGRPOTrainer(..., "
    "lld_store=...)` (TRL) or `LLDRayPPOTrainer` (verl, `trainer.lld_store=...`), which log them for you. "
    "See docs/integrations.md."
)


class WhatIfError(ValueError):
    """Input the counterfactual cannot be computed from; the message says what to do."""


def no_tokens_message(source: str | None = None, detail: str = "") -> str:
    """Why there is no counterfactual for a run without token rows, and which columns to log and how."""
    why = " (runs imported from W&B carry step signals only)" if source == "wandb" else ""
    return NO_TOKENS_HELP.format(why=why + detail)


def settings(lam: float | None = None, gate: str | None = None, norm: str | None = None, **more: Any) -> dict[str, Any]:
    """The LLDS settings (lld.LLDSConfig fields), defaults filled in; WhatIfError names a bad value."""
    unknown = set(more) - set(DEFAULT_SETTINGS)
    if unknown:
        raise WhatIfError(f"unknown LLDS setting(s) {sorted(unknown)}; known: {sorted(DEFAULT_SETTINGS)}")
    out = dict(DEFAULT_SETTINGS)
    out.update({k: v for k, v in dict(lam=lam, gate=gate, norm=norm, **more).items() if v is not None})
    try:
        lam_f = float(out["lam"])
    except (TypeError, ValueError):
        raise WhatIfError(f"λ (--lam) must be a number > 0, got {out['lam']!r}") from None
    if not (math.isfinite(lam_f) and lam_f > 0):
        raise WhatIfError(f"λ (--lam) must be a finite number > 0 (the paper uses 0.2), got {out['lam']}; "
                          "with λ ≤ 0 LLDS does nothing")
    out["lam"] = lam_f
    if out["gate"] not in GATES:
        raise WhatIfError(f"gate must be one of {', '.join(GATES)}, got {out['gate']!r}")
    if out["norm"] not in NORMS:
        raise WhatIfError(f"norm must be one of {', '.join(NORMS)}, got {out['norm']!r}")
    if out["adaptive_beta"] is not None and out["adaptive_beta"] not in BETA_RULES:
        raise WhatIfError(f"adaptive_beta must be None or one of {', '.join(BETA_RULES)}, got {out['adaptive_beta']!r}")
    return out


def setting_key(cfg: dict[str, Any]) -> str:
    """A short stable id of the settings llds_raw depends on (λ excluded)."""
    text = json.dumps({k: cfg.get(k, DEFAULT_SETTINGS[k]) for k in KEY_FIELDS}, sort_keys=True)
    return hashlib.sha1(f"{FORMAT}:{text}".encode()).hexdigest()[:12]


def cache_dirs(store: str | os.PathLike, run_id: str, cfg: dict[str, Any]) -> list[Path]:
    """Where the cache of (run, settings) may be: in the run's folder, else in the user's cache folder (the only place
    for a store in a bucket)."""
    name = f"whatif-{setting_key(cfg)}"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    if is_bucket(store):
        store_hash = hashlib.sha1(canonical(store).encode()).hexdigest()[:16]
        return [base / "lld-monitor" / "whatif" / store_hash / run_id / name]
    store_p = Path(store).expanduser().resolve()
    store_hash = hashlib.sha1(str(store_p).encode()).hexdigest()[:16]
    return [store_p / "runs" / run_id / DERIVED_DIR / name, base / "lld-monitor" / "whatif" / store_hash / run_id / name]


def token_row_counts(reader, run_id: str) -> dict[int, int]:
    """step -> number of token rows the store holds for the run now (all ranks)."""
    df = reader.token_counts(run_id)
    return {int(s): int(n) for s, n in zip(df["step"], df["n"])}


@dataclass
class WhatIfCache:
    """A cached counterfactual: per-step rows (STEPS_SCHEMA) and the gated tokens (TOKENS_SCHEMA)."""

    settings: dict[str, Any]
    steps: pd.DataFrame
    tokens: pd.DataFrame
    path: Path | None = None

    def fresh_for(self, counts: dict[int, int]) -> bool:
        """True when every token-logged step of the store is here, from the same token rows."""
        return not steps_to_compute(self.steps, counts) and set(self.steps["step"].astype(int)) <= set(counts)


def empty_steps() -> pd.DataFrame:
    return STEPS_SCHEMA.empty_table().to_pandas()


def empty_tokens() -> pd.DataFrame:
    return TOKENS_SCHEMA.empty_table().to_pandas()


def steps_to_compute(cached: pd.DataFrame | None, counts: dict[int, int]) -> list[int]:
    """The token-logged steps that have no cached row, or whose token row count changed since."""
    have = {} if cached is None or cached.empty else dict(zip(cached["step"].astype(int), cached["n_token_rows"].astype(int)))
    return [s for s, n in sorted(counts.items()) if have.get(s) != n]


def merged(cached: WhatIfCache | None, new_steps: pd.DataFrame, new_tokens: pd.DataFrame,
           counts: dict[int, int], cfg: dict[str, Any]) -> WhatIfCache:
    """The cached rows still valid (their step is in the store with the same token rows) plus the new ones."""
    keep_steps = set(counts) - set(new_steps["step"].astype(int))
    parts_s, parts_t = [new_steps], [new_tokens]
    if cached is not None:
        parts_s.insert(0, cached.steps[cached.steps["step"].astype(int).isin(keep_steps)])
        parts_t.insert(0, cached.tokens[cached.tokens["step"].astype(int).isin(keep_steps)])
    steps = pd.concat([p for p in parts_s if len(p)] or [empty_steps()], ignore_index=True)
    tokens = pd.concat([p for p in parts_t if len(p)] or [empty_tokens()], ignore_index=True)
    steps = steps.sort_values("step", kind="stable").reset_index(drop=True)
    tokens = tokens.sort_values(["step", "rank", "sample_idx", "position"], kind="stable").reset_index(drop=True)
    return WhatIfCache(dict(cfg), steps, tokens)


def _meta(cfg: dict[str, Any], run_id: str) -> dict[bytes, bytes]:
    doc = {"format": FORMAT, "run_id": run_id, "settings": {k: cfg.get(k, DEFAULT_SETTINGS[k]) for k in KEY_FIELDS}}
    return {b"lld_monitor_whatif": json.dumps(doc, sort_keys=True).encode()}


def _write_atomic(table: pa.Table, path: Path) -> None:
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _table(df: pd.DataFrame, schema: pa.Schema, meta: dict[bytes, bytes]) -> pa.Table:
    cols = {f.name: pa.array(df[f.name].tolist() if len(df) else [], type=f.type) for f in schema}
    return pa.table(cols, schema=schema).replace_schema_metadata(meta)


def write_cache(store: str | os.PathLike, run_id: str, result: WhatIfCache) -> Path:
    """Write (tokens first, then steps) into the run's folder, else the user's cache folder; the folder used."""
    meta = _meta(result.settings, run_id)
    steps, tokens = _table(result.steps, STEPS_SCHEMA, meta), _table(result.tokens, TOKENS_SCHEMA, meta)
    errors = []
    for d in cache_dirs(store, run_id, result.settings):
        try:
            _write_atomic(tokens, d / TOKENS_FILE)
            _write_atomic(steps, d / STEPS_FILE)
            result.path = d
            return d
        except OSError as exc:
            log.warning("could not write the what-if cache to %s (%s)", d, exc)
            errors.append(f"{d}: {exc}")
    raise OSError("could not write the what-if cache anywhere: " + "; ".join(errors))


def _read_dir(d: Path, run_id: str, cfg: dict[str, Any]) -> WhatIfCache | None:
    sp, tp = d / STEPS_FILE, d / TOKENS_FILE
    if not (sp.is_file() and tp.is_file()):
        return None
    try:
        steps_t, tokens_t = pq.read_table(sp), pq.read_table(tp)
        meta = json.loads((steps_t.schema.metadata or {}).get(b"lld_monitor_whatif", b"{}"))
    except (OSError, ValueError, pa.ArrowException) as exc:
        log.warning("ignoring an unreadable what-if cache at %s (%s)", d, exc)
        return None
    want = _meta(cfg, run_id)[b"lld_monitor_whatif"]
    if json.dumps(meta, sort_keys=True).encode() != want or set(steps_t.column_names) != set(STEPS_SCHEMA.names) \
            or set(tokens_t.column_names) != set(TOKENS_SCHEMA.names):
        log.info("what-if cache at %s is for other settings or an older format; it will be recomputed", d)
        return None
    return WhatIfCache(dict(cfg), steps_t.to_pandas(), tokens_t.to_pandas(), d)


def read_cache(store: str | os.PathLike, run_id: str, cfg: dict[str, Any]) -> WhatIfCache | None:
    """The cached counterfactual of (run, settings), or None (never computed, other format, unreadable)."""
    for d in cache_dirs(store, run_id, cfg):
        hit = _read_dir(d, run_id, cfg)
        if hit is not None:
            return hit
    return None


def with_penalty(steps: pd.DataFrame, lam: float) -> pd.DataFrame:
    """The step rows with `penalty` = λ · llds_raw (the term LLDS would have added to the loss)."""
    out = steps.copy()
    out.insert(out.columns.get_loc("llds_raw") + 1, "penalty", float(lam) * out["llds_raw"].astype("float64"))
    return out
