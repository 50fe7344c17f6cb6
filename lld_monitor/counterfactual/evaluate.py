"""Evaluate the LLDS term on a stored run's token rows, step by step, with the trainer's own function.

For each token-logged step, the step's logged samples become one right-padded ``[B, T]`` batch
(columns = the stored response positions) and go through `lld.llds_loss` and `lld.llds_token_flags`:

    logp        = tokens.logp_new    ln π after the step's updates
    logp_old    = tokens.logp_old    ln π of the rollout policy
    advantages  = samples.advantage
    action_mask = role ∈ {action, answer}   (tool tokens excluded)
    answer_mask = role == answer            (used by LLDS-MA only)
    valid_searches_mean = mean samples.n_searches of the step (adaptive LLDS-MA only)

So `llds_raw` is the penalty LLDS would have measured at the end of the step on the logged groups: not a
replay of training (the run's later steps are those of the run as it was trained). torch is imported
inside the functions that need it; the batch builder is numpy / pandas only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from lld_monitor.counterfactual import cache as wc
from lld_monitor.roles import ROLE_ACTION, ROLE_ANSWER, ROLES

log = logging.getLogger(__name__)

SCORED_ROLES = (ROLES[ROLE_ACTION], ROLES[ROLE_ANSWER])  # action, answer: the tokens the model generated


@dataclass
class StepBatch:
    """One step's logged samples as ``[B, T]`` arrays (row i = keys[i]; column = stored position)."""

    step: int
    ranks: np.ndarray  # [B] int32
    sample_idx: np.ndarray  # [B] int32
    logp_old: np.ndarray  # [B, T] float32, 0 off the action mask
    logp_new: np.ndarray  # [B, T] float32, 0 off the action mask
    action_mask: np.ndarray  # [B, T] bool
    answer_mask: np.ndarray  # [B, T] bool
    advantages: np.ndarray  # [B] float64
    valid_searches_mean: float | None
    n_skipped: int  # logged samples left out (no advantage, or a missing log-prob on one of their action tokens)

    @property
    def n_samples(self) -> int:
        return int(len(self.ranks))


def _floats(col: pd.Series) -> np.ndarray:
    """A store column as float64 with NULL as NaN (the reader may hand nullable Float64 / Int64 columns)."""
    return pd.to_numeric(col, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def _keys(rank: pd.Series, sample_idx: pd.Series) -> np.ndarray:
    return (rank.to_numpy(dtype="int64") << 32) | (sample_idx.to_numpy(dtype="int64") & 0xFFFFFFFF)


def step_batch(step: int, tokens: pd.DataFrame, samples: pd.DataFrame) -> StepBatch:
    """The batch of one step from its token rows and its samples rows (store frames)."""
    t = tokens
    key = _keys(t["rank"], t["sample_idx"])
    codes, uniq = pd.factorize(key, sort=True)
    pos = t["position"].to_numpy(dtype="int64")
    if len(pos) and pos.min() < 0:
        raise wc.WhatIfError(f"step {step}: token positions must be ≥ 0, got {int(pos.min())}")
    width = int(pos.max()) + 1 if len(pos) else 0
    role = t["role"].astype(str).to_numpy()
    scored = np.isin(role, SCORED_ROLES)
    lo = _floats(t["logp_old"])
    ln = _floats(t["logp_new"])
    missing = scored & ~(np.isfinite(lo) & np.isfinite(ln))

    adv_by_key = dict(zip(_keys(samples["rank"], samples["sample_idx"]), _floats(samples["advantage"]))) \
        if len(samples) else {}
    adv = np.array([adv_by_key.get(k, np.nan) for k in uniq], dtype="float64")
    bad_row = ~np.isfinite(adv)
    np.logical_or.at(bad_row, codes[missing], True)
    keep = ~bad_row
    new_row = np.cumsum(keep) - 1  # old row -> new row for kept rows
    on = keep[codes]
    r, c = new_row[codes[on]], pos[on]
    nb = int(keep.sum())
    shape = (nb, width)
    action = np.zeros(shape, dtype=bool)
    answer = np.zeros(shape, dtype=bool)
    logp_old = np.zeros(shape, dtype=np.float32)
    logp_new = np.zeros(shape, dtype=np.float32)
    sc = scored[on]
    action[r[sc], c[sc]] = True
    answer[r, c] = role[on] == ROLES[ROLE_ANSWER]
    logp_old[r[sc], c[sc]] = lo[on][sc]
    logp_new[r[sc], c[sc]] = ln[on][sc]

    vs = None
    if len(samples) and "n_searches" in samples and samples["n_searches"].notna().any():
        vs = float(np.nanmean(_floats(samples["n_searches"])))
    if bad_row.any():
        log.debug("step %d: %d logged sample(s) left out (no advantage or a missing log-prob)", step, int(bad_row.sum()))
    return StepBatch(step=int(step), ranks=(uniq[keep] >> 32).astype(np.int32),
                     sample_idx=(uniq[keep] & 0xFFFFFFFF).astype(np.int32), logp_old=logp_old, logp_new=logp_new,
                     action_mask=action, answer_mask=answer, advantages=adv[keep], valid_searches_mean=vs,
                     n_skipped=int(bad_row.sum()))


def llds_config(cfg: dict[str, Any]):
    """The lld.LLDSConfig of a settings dict (validated by lld itself)."""
    from lld_monitor import lld

    return lld.LLDSConfig(**{k: cfg[k] for k in wc.DEFAULT_SETTINGS})


def evaluate_step(batch: StepBatch, cfg: dict[str, Any], n_token_rows: int) -> tuple[dict[str, Any], pd.DataFrame]:
    """One step through lld.llds_loss (the step row) and lld.llds_token_flags (its gated tokens)."""
    import torch

    from lld_monitor import lld

    row: dict[str, Any] = {"step": batch.step, "n_samples": batch.n_samples, "n_samples_skipped": batch.n_skipped,
                           "n_token_rows": int(n_token_rows)}
    if batch.n_samples == 0:
        row.update({"llds_raw": math.nan, "n_preserved": 0, "n_gated_responses": 0, "n_gated_actions": 0,
                    "n_penalized_tokens": 0, "beta": math.nan})
        return row, wc.empty_tokens()
    conf = llds_config(cfg)
    args = (torch.from_numpy(batch.logp_new), torch.from_numpy(batch.logp_old), torch.from_numpy(batch.advantages),
            torch.from_numpy(batch.action_mask))
    kw = {"answer_mask": torch.from_numpy(batch.answer_mask), "valid_searches_mean": batch.valid_searches_mean}
    if conf.adaptive_beta is not None and batch.valid_searches_mean is None:
        raise wc.WhatIfError(f"step {batch.step}: adaptive_beta needs the samples' n_searches, which this run did not log")
    with torch.no_grad():
        loss, stats = lld.llds_loss(*args, conf, **kw)
        flags = lld.llds_token_flags(*args, conf, **kw)
    row["llds_raw"] = float(loss)
    for k in wc.STAT_COLUMNS[1:]:
        row[k] = int(stats[k])
    row["beta"] = float(stats["beta"])
    gated = flags.gated.numpy()
    r, c = np.nonzero(gated)
    toks = pd.DataFrame({
        "step": np.full(len(r), batch.step, dtype="int64"),
        "rank": batch.ranks[r],
        "sample_idx": batch.sample_idx[r],
        "position": c.astype(np.int32),
        "penalized": flags.penalized.numpy()[r, c],
        "penalty": flags.penalty.numpy()[r, c].astype(np.float32),
    })
    return row, toks


def compute_steps(reader, run_id: str, steps: list[int], cfg: dict[str, Any], counts: dict[int, int],
                  progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Step rows and gated-token rows of `steps` (each read from the store, one step at a time)."""
    rows, toks = [], []
    it = steps
    if progress and len(steps) > 1:
        from tqdm import tqdm

        it = tqdm(steps, desc="whatif", unit="step", leave=False)
    for s in it:
        batch = step_batch(s, reader.tokens(run_id, int(s)), reader.samples(run_id, step=int(s)))
        row, tk = evaluate_step(batch, cfg, counts.get(int(s), 0))
        rows.append(row)
        if len(tk):
            toks.append(tk)
    steps_df = pd.DataFrame(rows, columns=list(wc.STEPS_SCHEMA.names)) if rows else wc.empty_steps()
    tokens_df = pd.concat(toks, ignore_index=True) if toks else wc.empty_tokens()
    return steps_df, tokens_df


def run_whatif(reader, store: str, run: dict[str, Any], cfg: dict[str, Any], *, progress: bool = False,
               use_cache: bool = True, write: bool = True) -> wc.WhatIfCache:
    """The counterfactual of a run (a runs() row) under `cfg`: the cached steps still valid plus the steps
    computed now; written back beside the run when `write`. WhatIfError when the run has no token rows."""
    run_id = str(run["run_id"])
    counts = wc.token_row_counts(reader, run_id)
    if not counts:
        raise wc.WhatIfError(wc.no_tokens_message(run.get("source")))
    cached = wc.read_cache(store, run_id, cfg) if use_cache else None
    todo = wc.steps_to_compute(cached.steps if cached is not None else None, counts)
    if cached is not None and not todo and cached.fresh_for(counts):
        return cached
    new_steps, new_tokens = compute_steps(reader, run_id, todo, cfg, counts, progress=progress)
    result = wc.merged(cached, new_steps, new_tokens, counts, cfg)
    if len(result.steps) and int(result.steps["n_samples"].sum()) == 0:
        raise wc.WhatIfError(wc.no_tokens_message(
            run.get("source"), detail=" with both logp_old and logp_new on its action tokens (one of them is missing)"))
    if write:
        try:
            wc.write_cache(store, run_id, result)
        except OSError as exc:  # the numbers are still right; the dashboard just cannot reuse them
            log.warning("%s", exc)
    return result
