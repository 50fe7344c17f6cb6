"""LLD step signals from verl-style batch tensors, to drop into a verl actor's metrics dict.

In verl / Search-R1 (`verl/workers/actor/dp_actor.py::update_policy`) every tensor is response-side,
right-padded, shape ``[B, R]`` (R = max response length):

- ``old_log_probs``  ln π_old, recomputed by the actor right after rollout (start of the step);
- ``log_prob``       ln π_θ of the current parameters (inside the update loop: after the earlier
                     mini-batch updates of this step; for the step's final displacement, recompute it
                     once after the last update, under ``torch.no_grad()``);
- ``advantages``     GRPO Â tiled over the response tokens (``[B, R]``; ``[B]`` also accepted);
- ``response_mask`` or ``loss_mask``  1 on model-generated tokens, 0 on ``<information>`` observations,
                     the invalid-action messages and padding (Search-R1's ``state_masking=true``);
- optional ``answer_mask``: Search-R1's convention is **0 on the answer span** (tags included) and 1
  elsewhere (`_build_answer_mask`); pass ``answer_mask_zero_on_span=False`` for a mask that is 1 on the span;
- optional ``ref_log_prob`` (frozen reference), ``entropys`` / ``entropy`` (per-token entropy),
  ``token_level_scores`` (``[B, R]``, summed per row) or ``scores`` (``[B]``) for reward-based signals,
  and ``valid_search_stats`` (``[B]``, valid searches per trajectory).

Usage inside ``update_policy`` (or after it, on the step's batch)::

    from lld_monitor.integrations.trainers.verl_metrics import lld_metrics
    metrics.update(lld_metrics(data.batch, llds=LLDSConfig(lam=0.2)))  # keys "lld/<signal>"

The keys are ``lld/<signal>`` for every signal of ``schema.STEP_SIGNALS`` that the batch determines;
``import-wandb`` maps them straight back onto the store's step signals.
Sign convention: Δ = ln π_new − ln π_old (negative = likelihood fell), as in the store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lld_monitor import lld
from lld_monitor.aggregates import step_aggregates
from lld_monitor.payload import authors_scalars, step_samples

PREFIX = "lld/"


def _get(batch: Any, *names: str) -> Tensor | None:
    src = getattr(batch, "batch", batch)  # verl DataProto -> its TensorDict
    for n in names:
        try:
            v = src[n]
        except (KeyError, TypeError, IndexError):
            v = None
        if v is None and isinstance(src, Mapping):
            v = src.get(n)
        if v is not None:
            return v if isinstance(v, Tensor) else torch.as_tensor(v)
    return None


def _f(x: Tensor | float) -> float:
    return float(x.detach().double().item()) if isinstance(x, Tensor) else float(x)


def lld_metrics(
    batch: Any,
    *,
    llds: lld.LLDSConfig | None = None,
    answer_mask_zero_on_span: bool = True,
    prefix: str = PREFIX,
    log_prob: Tensor | None = None,
) -> dict[str, float]:
    """Our step signals for one verl batch, as ``{prefix + signal: float}``.

    Always: delta_preserved, delta_preserved_mean, frac_actions_displaced, frac_responses_displaced,
    response_length (mean model tokens per response), n_samples. With scores: reward_mean, reward_std,
    accuracy (score > 0), ll_correct_sum/mean and ll_incorrect_sum/mean (on ln π_old). With a
    reference: kl (k3, token mean). With entropies: entropy. With an answer mask: answer_prob_mean.
    With ``llds``: llds_loss = λ·L_LLDS (and ``lld/llds_raw``). With valid_search_stats:
    searches_per_response. A value that cannot be computed (nothing to average) is NaN, never 0.

    What verl really has: inside ``update_policy`` the current log-prob is a local of
    ``_forward_micro_batch`` (pass it as ``log_prob=``; it is never in the batch); without
    ``response_mask`` / ``loss_mask`` (Search-R1 with ``state_masking=false``) the mask is
    ``attention_mask[:, -R:]``; ``valid_search_stats`` is read from ``meta_info`` as well as the batch.
    In the micro-batch loop, collect with verl's ``append_to_dict(metrics, lld_metrics(...))`` (the step
    value is then the mean over micro-batches), not ``metrics.update`` (which keeps the last one only).
    """
    old = _get(batch, "old_log_probs")
    new = log_prob if log_prob is not None else _get(batch, "log_prob", "log_probs")
    adv = _get(batch, "advantages")
    mask = _get(batch, "response_mask", "loss_mask")
    if mask is None and old is not None:
        attn = _get(batch, "attention_mask")
        if attn is not None and attn.dim() == 2 and attn.shape[1] >= old.shape[-1]:
            mask = attn[:, -old.shape[-1]:]  # response side of the attention mask
    missing = [n for n, v in (("old_log_probs", old), ("log_prob", new), ("advantages", adv),
                              ("response_mask/loss_mask", mask)) if v is None]
    if missing:
        raise KeyError(
            f"lld_metrics needs verl batch tensors {missing} (shapes [B, R]); inside update_policy pass the "
            "micro-batch's current log-prob as log_prob= (it is a local of _forward_micro_batch)"
        )
    if old.dim() != 2 or new.shape != old.shape or mask.shape != old.shape:
        raise ValueError(
            f"old_log_probs, log_prob and the mask must all be [B, R]; got {tuple(old.shape)}, "
            f"{tuple(new.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        old = old.detach().float()
        new = new.detach().float()
        m = mask.bool()
        adv_r = lld.response_advantages(adv.detach().float(), old.shape[0], m)  # [B, R]: at the first model token
        scores = _get(batch, "scores")
        tls = _get(batch, "token_level_scores", "token_level_rewards")
        if scores is None and tls is not None:
            scores = tls.float().sum(dim=-1)
        # per-sample sums, then the same step aggregates as RunLogger (payload.py, aggregates.py)
        samples = step_samples(model_mask=m, logp_old=old, logp_new=new, advantages=adv_r,
                               rewards=None if scores is None else scores.detach().double().reshape(-1))
        out: dict[str, float] = {k: math.nan if v is None else float(v) for k, v in step_aggregates(samples).items()}
        ref_lp = _get(batch, "ref_log_prob")
        authors = authors_scalars(model_mask=m, logp_old=old, advantages=adv_r, logp_ref=ref_lp)

        ref = _get(batch, "ref_log_prob")
        if ref is not None:
            log_r = torch.where(m, ref.detach().float() - new, torch.zeros(()))
            k3 = (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)
            out["kl"] = _f(torch.where(m, k3, torch.zeros(())).sum() / m.sum().clamp(min=1))

        ent = _get(batch, "entropys", "entropy")
        if ent is not None:
            out["entropy"] = _f(torch.where(m, ent.detach().float(), torch.zeros(())).sum() / m.sum().clamp(min=1))

        am = _get(batch, "answer_mask")
        span = None
        if am is not None:
            span = (am == 0) if answer_mask_zero_on_span else am.bool()
            span = span & m
            out["answer_prob_mean"] = (
                _f(torch.exp(new[span]).double().mean()) if bool(span.any()) else math.nan
            )

        vs = _get(batch, "valid_search_stats")
        meta = getattr(batch, "meta_info", None)
        if vs is None and isinstance(meta, Mapping) and meta.get("valid_search_stats") is not None:
            vs = torch.as_tensor(meta["valid_search_stats"])
        v_mean = None
        if vs is not None:
            v_mean = _f(vs.double().mean())
            out["searches_per_response"] = v_mean

    if llds is not None:
        with torch.no_grad():
            loss, st = lld.llds_loss(
                new, old, adv_r, m, llds,
                answer_mask=span if llds.masks_answer else None,
                valid_searches_mean=v_mean,
            )
        out["llds_loss"] = llds.lam * _f(loss)
        out["llds_raw"] = _f(loss)
    # the LLDS authors' own metrics keep their names (`actor/...`), so a run of their code and this one meet
    return {**{f"{prefix}{k}": v for k, v in out.items()}, **authors}


__all__ = ["lld_metrics", "PREFIX"]
