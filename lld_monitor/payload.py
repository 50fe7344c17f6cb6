"""One training step, as `RunLogger.log_step` takes it: what any trainer has at the end of a step, turned into
the per-sample columns (`samples`) and the per-token arrays (`tokens`).

Every trainer that logs through lld-monitor calls this module: the built-in trainer (`backend/grpo.py`), the
TRL hook, the verl driver hook and verl's `lld_metrics`. What a trainer has, response-side and right-padded,
[N, T] each:

- `token_ids`, `valid_mask` (every real response token: model and tool), `model_mask` (the tokens the policy
  generated: valid and not a tool observation), optionally `answer_mask` (the final answer span);
- `logp_old` (ln π at the start of the step), `logp_new` (after its last update), optionally `logp_ref`
  (frozen reference) and `entropy`;
- per response: `advantages` ([N], or [N, T] tiled as verl does: read at the first model token), `rewards`,
  `group_ids` (the GRPO group), optionally `prompt_ids`, `n_searches` (default: tool-result blocks) and texts.

Token roles come from the masks (`roles.py`): action where the model generated, tool elsewhere inside the
response, answer on the answer span. Log-probs and entropy are NaN off the model's tokens; the logger stores
tool tokens with NULL log-probs either way. Per-sample sums (`aggregates.sample_sums_from_tokens`) count the
model's tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lld_monitor import lld
from lld_monitor.aggregates import sample_sums_from_tokens, to_numpy
from lld_monitor.roles import ROLE_ACTION, ROLE_ANSWER, ROLE_TOOL

__all__ = ["StepPayload", "authors_scalars", "step_payload", "step_samples", "step_tokens", "token_roles", "tool_runs"]


@dataclass
class StepPayload:
    """The arguments of `RunLogger.log_step` for one step (`logger.log_step(step, **payload.as_kwargs())`)."""

    scalars: dict[str, float] = field(default_factory=dict)
    samples: dict[str, np.ndarray] | None = None
    tokens: dict[str, np.ndarray] | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {"scalars": self.scalars, "samples": self.samples, "tokens": self.tokens}


def _bool(mask: Any) -> Tensor:
    return torch.as_tensor(mask).bool()


def token_roles(valid_mask: Any, model_mask: Any, answer_mask: Any = None) -> Tensor:
    """Role codes [N, T] (`roles.ROLES`): action on the model's tokens, answer on those of the answer span,
    tool on every other token (outside `valid_mask` the code is tool too; the logger stores valid tokens only)."""
    model = _bool(model_mask) & _bool(valid_mask)
    role = torch.where(model, ROLE_ACTION, ROLE_TOOL).to(torch.int8)
    if answer_mask is not None:
        role = torch.where(_bool(answer_mask) & model, ROLE_ANSWER, role).to(torch.int8)
    return role


def tool_runs(valid_mask: Any, model_mask: Any) -> Tensor:
    """Tool-result blocks per response [N]: maximal runs of valid tokens the model did not generate (one per
    executed search or tool call, the invalid-action messages included)."""
    tool = _bool(valid_mask) & ~_bool(model_mask)
    if tool.shape[1] == 0:
        return torch.zeros(tool.shape[0], dtype=torch.long)
    return lld.action_index(tool).amax(dim=1) + 1  # run indices are 0, 1, ...; -1 everywhere on a row without


def _column(values: Any, dtype: Any) -> np.ndarray:
    return np.asarray(to_numpy(values), dtype=dtype)


def _strings(values: Sequence[Any] | Any) -> np.ndarray:
    return np.array([str(v) for v in (to_numpy(values).tolist() if hasattr(values, "detach") else values)], dtype=object)


def step_samples(
    *,
    model_mask: Any,
    logp_old: Any,
    logp_new: Any,
    advantages: Any,
    rewards: Any = None,
    group_ids: Sequence[Any] | Any = None,
    prompt_ids: Sequence[Any] | Any = None,
    n_searches: Any = None,
    valid_mask: Any = None,
    texts: Sequence[str | None] | None = None,
    **columns: Any,
) -> dict[str, np.ndarray]:
    """Per-sample columns [N]: reward, advantage (per response), group_id and prompt_id (prompt_id defaults to
    the group), sample_idx, n_searches (given, else tool-result blocks when `valid_mask` is given), the sums
    over the model's tokens (`sample_sums_from_tokens`), `text`, and any further sample column by name."""
    model = _bool(model_mask)
    n = model.shape[0]
    out: dict[str, np.ndarray] = {"advantage": _column(lld.response_advantages(advantages, n, model), np.float64)}
    if rewards is not None:
        out["reward"] = _column(rewards, np.float64)
    if group_ids is not None:
        out["group_id"] = _strings(group_ids)
        out["prompt_id"] = _strings(group_ids if prompt_ids is None else prompt_ids)
    out["sample_idx"] = np.arange(n, dtype=np.int32)
    if n_searches is None and valid_mask is not None:
        n_searches = tool_runs(valid_mask, model)
    if n_searches is not None:
        out["n_searches"] = _column(n_searches, np.int32)
    out.update(sample_sums_from_tokens({"mask": model, "logp_old": logp_old, "logp_new": logp_new,
                                        "action_idx": lld.action_index(model)}))
    if texts is not None:
        out["text"] = np.array(list(texts), dtype=object)
    out.update({k: to_numpy(v) if not isinstance(v, list) else np.array(v, dtype=object) for k, v in columns.items()})
    return out


def step_tokens(
    *,
    token_ids: Any,
    valid_mask: Any,
    model_mask: Any,
    logp_old: Any,
    logp_new: Any,
    answer_mask: Any = None,
    logp_ref: Any = None,
    entropy: Any = None,
) -> dict[str, np.ndarray]:
    """Per-token arrays [N, T]: token_id, mask (= valid), role, action_idx, and the log-probs and entropy, NaN
    off the model's tokens."""
    valid = _bool(valid_mask)
    model = _bool(model_mask) & valid
    out = {
        "token_id": to_numpy(token_ids),
        "mask": to_numpy(valid),
        "role": to_numpy(token_roles(valid, model, answer_mask)),
        "action_idx": to_numpy(lld.action_index(model)),
    }
    nan = torch.tensor(float("nan"))
    for name, values in (("logp_old", logp_old), ("logp_new", logp_new), ("logp_ref", logp_ref),
                         ("entropy", entropy)):
        if values is not None:
            out[name] = to_numpy(torch.where(model, torch.as_tensor(values).float(), nan))
    return out


def step_payload(
    *,
    token_ids: Any,
    valid_mask: Any,
    model_mask: Any,
    logp_old: Any,
    logp_new: Any,
    advantages: Any,
    rewards: Any,
    group_ids: Sequence[Any] | Any,
    answer_mask: Any = None,
    logp_ref: Any = None,
    entropy: Any = None,
    scalars: dict[str, float] | None = None,
    with_tokens: bool = True,
    **sample_columns: Any,
) -> StepPayload:
    """`step_samples` and (with `with_tokens`) `step_tokens` of one step (their arguments; `sample_columns` go to
    `step_samples`)."""
    model = _bool(model_mask) & _bool(valid_mask)
    samples = step_samples(model_mask=model, logp_old=logp_old, logp_new=logp_new, advantages=advantages,
                           rewards=rewards, group_ids=group_ids, valid_mask=valid_mask, **sample_columns)
    tokens = step_tokens(token_ids=token_ids, valid_mask=valid_mask, model_mask=model, logp_old=logp_old,
                         logp_new=logp_new, answer_mask=answer_mask, logp_ref=logp_ref,
                         entropy=entropy) if with_tokens else None
    return StepPayload(dict(scalars or {}), samples, tokens)


def authors_scalars(
    *,
    model_mask: Any,
    logp_old: Any,
    advantages: Any,
    logp_ref: Any = None,
    answer_mask: Any = None,
    logp_now: Any = None,
) -> dict[str, float]:
    """The LLDS authors' own step metrics (their `dp_actor.py`; research/paper.md §5), under their names, so that
    a W&B run of their code and one of ours meet on the same scalars. Theirs are measured on the last micro-batch
    of the step's last mini-batch; these on every model token of the step:

    - `actor/pos_avg_old_log_prob` / `actor/neg_avg_old_log_prob`: Σ ln π_old over the model tokens of responses
      with Â ≥ 0 / Â < 0, divided by all model tokens (their definition, dilution included);
    - `actor/pos_avg_ref_log_prob` / `actor/neg_avg_ref_log_prob`: the same with the frozen reference's ln π;
    - `actor/lowest_prob_avg_mean`: the mean probability of the answer span's tokens under `logp_now` (theirs: the
      current policy inside the update; NaN where no response has a span, theirs 0.0);
    - `actor/lowest_prob_avg_min`: each response's lowest answer-token probability, averaged over the responses
      that have a span (theirs counts a response without one as +inf).
    """
    model = _bool(model_mask)
    n_tok = model.float().sum().clamp(min=1)
    positive = (torch.as_tensor(advantages).reshape(-1) >= 0).to(model.device).unsqueeze(1)
    out: dict[str, float] = {}
    for name, values in (("old", logp_old), ("ref", logp_ref)):
        if values is None:
            continue
        v = torch.as_tensor(values)
        masked = torch.where(model, v, torch.zeros_like(v))
        out[f"actor/pos_avg_{name}_log_prob"] = float((masked * positive).sum() / n_tok)
        out[f"actor/neg_avg_{name}_log_prob"] = float((masked * ~positive).sum() / n_tok)
    if answer_mask is not None and logp_now is not None:
        span = _bool(answer_mask) & model
        prob = torch.exp(torch.as_tensor(logp_now).double())
        has = span.any(dim=1)
        out["actor/lowest_prob_avg_mean"] = float(prob[span].mean()) if bool(has.any()) else math.nan
        lowest = torch.where(span, prob, torch.full_like(prob, math.inf)).amin(dim=1)
        out["actor/lowest_prob_avg_min"] = float(lowest[has].mean()) if bool(has.any()) else math.nan
    return out
