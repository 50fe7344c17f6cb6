"""Step aggregates: the one definition of every step signal that follows from per-sample columns.

Pure numpy (torch tensors are accepted and copied to CPU numpy; torch itself is never imported).
Every path that writes these signals calls `step_aggregates`: RunLogger (so the built-in trainer and
the TRL hook, which log through it), the built-in trainer's progress bar and detector, and the verl
helper `integrations.trainers.verl_metrics.lld_metrics`. Per-sample sums from [N, T] token arrays come from
`sample_sums_from_tokens`, also shared.

A *preserved* response is one with advantage Â >= 0 and at least one action token (docs/lld.md says
why). A signal whose subset is empty is None (NULL, "no such data"), never 0; NaN inputs give NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lld_monitor.roles import ROLE_TOOL

Aggregates = dict[str, float | int | None]


def to_numpy(value: Any) -> np.ndarray:
    """A private CPU numpy copy of a tensor / array / list (torch is duck-typed, not imported)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor
        t = value.detach()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        on_cpu = str(t.device) == "cpu"
        arr = t.cpu().numpy()
        return arr.copy() if on_cpu else arr
    if isinstance(value, np.ndarray):
        return value.copy()
    arr = np.asarray(value)
    return arr.copy() if arr is value else arr


def _mean(x: np.ndarray) -> float | None:
    """Mean of a possibly empty array: None when empty; NaN stays NaN."""
    return float(np.mean(x)) if x.size else None


def _f64(s: Mapping[str, Any], key: str) -> np.ndarray:
    return np.asarray(to_numpy(s[key]), dtype=np.float64)


def sample_sums_from_tokens(tok: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Per-sample action-token sums from [N, T] token arrays (tool tokens and masked positions excluded).

    Reads `mask` (default all), `role` (codes of roles.ROLES; tool tokens excluded), `logp_old`,
    `logp_new`, `action_idx`; gives n_action_tokens, logp_old_sum, logp_new_sum, delta_sum, delta_mean,
    n_actions and n_actions_displaced for what the inputs determine. Sums are float64.
    """
    tok = {k: to_numpy(v) for k, v in tok.items()}
    shape = next(iter(tok.values())).shape
    mask = tok["mask"].astype(bool) if "mask" in tok else np.ones(shape, dtype=bool)
    if "role" in tok:
        mask = mask & (tok["role"] != ROLE_TOOL)
    out: dict[str, np.ndarray] = {"n_action_tokens": mask.sum(axis=1).astype(np.int32)}
    new = old = None
    if "logp_old" in tok:
        old = np.where(mask, tok["logp_old"].astype(np.float64), 0.0)
        out["logp_old_sum"] = old.sum(axis=1)
    if "logp_new" in tok:
        new = np.where(mask, tok["logp_new"].astype(np.float64), 0.0)
        out["logp_new_sum"] = new.sum(axis=1)
    if old is not None and new is not None:
        with np.errstate(invalid="ignore"):  # inf - inf is NaN, as it should be
            diff = new - old
        out["delta_sum"] = diff.sum(axis=1)
    if "action_idx" in tok:
        aidx = np.where(mask, tok["action_idx"].astype(np.int64), -1)
        n = aidx.shape[0]
        n_act = (aidx.max(axis=1, initial=-1) + 1).clip(min=0)
        out["n_actions"] = n_act.astype(np.int32)
        if old is not None and new is not None:
            a = max(int(n_act.max(initial=0)), 1)
            sums = np.zeros((n, a))
            rows = np.broadcast_to(np.arange(n)[:, None], aidx.shape)
            valid = aidx >= 0
            np.add.at(sums, (rows[valid], aidx[valid]), diff[valid])
            has = np.arange(a)[None, :] < n_act[:, None]
            out["n_actions_displaced"] = ((sums < 0) & has).sum(axis=1).astype(np.int32)
    return derive_sample_columns(out) if "delta_sum" in out else out


def derive_sample_columns(s: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Fill delta_sum / delta_mean / correct where their inputs are present and they are not."""
    s = dict(s)
    if "delta_sum" not in s and "logp_old_sum" in s and "logp_new_sum" in s:
        s["delta_sum"] = _f64(s, "logp_new_sum") - _f64(s, "logp_old_sum")
    if "delta_mean" not in s and "delta_sum" in s and "n_action_tokens" in s:
        nt = _f64(s, "n_action_tokens")
        with np.errstate(divide="ignore", invalid="ignore"):
            s["delta_mean"] = np.where(nt > 0, _f64(s, "delta_sum") / np.where(nt > 0, nt, 1), np.nan)
    if "correct" not in s and "reward" in s:
        s["correct"] = _f64(s, "reward") > 0
    return s


def preserved(s: Mapping[str, Any]) -> np.ndarray:
    """The preserved responses: Â >= 0 and at least one action token (when n_action_tokens is known)."""
    pres = _f64(s, "advantage") >= 0
    if "n_action_tokens" in s:
        pres &= _f64(s, "n_action_tokens") > 0
    return pres


def step_aggregates(samples: Mapping[str, Any]) -> Aggregates:
    """The step signals that follow from per-sample columns (numpy or torch, [N] each), as floats.

    reward_mean, reward_std (population, ddof=0), accuracy (the `correct` column, else reward > 0);
    ll_{correct,incorrect}_{sum,mean} over responses with >= 1 action token (sum of ln π_old, and per
    token); delta_preserved(_mean), frac_responses_displaced and frac_actions_displaced (pooled over the
    preserved responses' actions) over the preserved responses; response_length (mean action tokens),
    searches_per_response; n_samples. Only what the columns determine is returned.
    """
    s = derive_sample_columns(samples)
    n = len(to_numpy(next(iter(s.values())))) if s else 0
    out: Aggregates = {"n_samples": int(n)}
    nt = _f64(s, "n_action_tokens") if "n_action_tokens" in s else None
    has_tok = nt > 0 if nt is not None else np.ones(n, dtype=bool)
    if "reward" in s:
        reward = _f64(s, "reward")
        out["reward_mean"] = _mean(reward)
        out["reward_std"] = float(np.std(reward)) if reward.size else None
    if "correct" in s:
        correct = np.asarray(to_numpy(s["correct"]), dtype=bool)
        out["accuracy"] = _mean(correct.astype(np.float64))
        if "logp_old_sum" in s:
            lp = _f64(s, "logp_old_sum")
            for name, sel in (("correct", correct & has_tok), ("incorrect", ~correct & has_tok)):
                out[f"ll_{name}_sum"] = _mean(lp[sel])
                if nt is not None:
                    out[f"ll_{name}_mean"] = _mean(lp[sel] / nt[sel])
    if "advantage" in s and "delta_sum" in s:
        pres = preserved(s)
        d = _f64(s, "delta_sum")[pres]
        out["delta_preserved"] = _mean(d)
        out["frac_responses_displaced"] = _mean((d < 0).astype(np.float64))
        if "delta_mean" in s:
            out["delta_preserved_mean"] = _mean(_f64(s, "delta_mean")[pres])
        if "n_actions_displaced" in s and "n_actions" in s:
            den = float(np.sum(_f64(s, "n_actions")[pres]))
            out["frac_actions_displaced"] = float(np.sum(_f64(s, "n_actions_displaced")[pres])) / den if den > 0 else None
    if nt is not None:
        out["response_length"] = _mean(nt)
    if "n_searches" in s:
        out["searches_per_response"] = _mean(_f64(s, "n_searches"))
    return out
