"""LLDS as a verl policy loss, registered with verl's own registry (verl 0.9.1).

Loaded on the workers by verl itself, selected by config — verl is not edited::

    actor_rollout_ref.model.external_lib=lld_monitor.integrations.trainers.verl_loss
    actor_rollout_ref.actor.policy_loss.loss_mode=llds

λ = 0.2, A-gate, ``token_mean`` norm by default. To set them, point the policy-loss config at
:class:`LLDSPolicyLossConfig` (verl builds it with Hydra)::

    actor_rollout_ref.actor.policy_loss._target_=lld_monitor.integrations.trainers.verl_loss.LLDSPolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.llds_lambda=0.1
    +actor_rollout_ref.actor.policy_loss.llds_norm=seq_mean

The loss is ``L = L_base + λ · L_LLDS`` where ``L_base`` is the registered verl loss named by
``llds_base_loss_mode`` (``vanilla``: verl's PPO-clip) and ``L_LLDS`` is :func:`lld_monitor.lld.llds_loss` on the
micro-batch (``log_prob`` carries the gradient; tool / observation tokens are 0 in verl's ``response_mask``).

Micro-batches and ranks: verl calls the policy loss once per micro-batch and sums the micro-batch losses; FSDP
averages the gradients over the data-parallel ranks. The LLDS term is divided by the *mini-batch's* denominator
from verl's ``config.global_batch_info`` (``batch_num_tokens`` for ``token_mean``, ``global_batch_size`` for
``seq_mean``) and multiplied by ``dp_size``, as verl's own ``agg_loss`` does, so the micro-batch terms add up to
λ·L_LLDS of the whole mini-batch whatever the micro-batch size. The paper's ``response`` norm (divide by the
number of *preserved* responses) is refused: the policy loss sees one micro-batch and cannot know that count for
the mini-batch.

Noise floor: on an on-policy mini-batch (the first of each step, or every one with one mini-batch and one epoch)
``old_log_prob`` and ``log_prob`` come from the same parameters and Δ is recomputation noise; the LLDS gradient
does not shrink with |Δ|, so it would push up whichever tokens the noise lowered, at full λ. A micro-batch whose
max |Δ| is at or below ``llds_noise_floor`` (default :data:`lld_monitor.lld.NOISE_FLOOR`; 0 turns the gate off)
gets no LLDS term, ``lld/llds_noise_gated = 1`` and a warning (once per worker). bf16 recomputation noise can
be above the default: read ``lld/delta_abs_max`` on an on-policy step and set the floor above it.

Metrics: every micro-batch returns the same keys, all finite — verl appends them per micro-batch and
``Metric.aggregate_dp`` needs the same count on every rank — and verl logs their mean over micro-batches:
``lld/llds_loss`` (λ·L_LLDS added, the micro-batch's own value, 0 where gated), ``lld/llds_raw`` (L_LLDS of the
micro-batch), ``lld/llds_noise_gated`` (1 if gated), ``lld/delta_abs_max`` (max |Δ| over its action tokens),
``lld/frac_preserved`` (responses with Â ≥ 0), ``lld/frac_penalized_tokens`` (action tokens with a positive
penalty). The per-step Δ signals (delta_preserved, ...) come exact from the driver hook
(:mod:`lld_monitor.integrations.trainers.verl_hook`), not from here.

This module imports torch, verl and :mod:`lld_monitor.lld` only (no store, no DuckDB / Arrow on the workers).
LLDS-MA is not offered: verl 0.9.1's ``ppo_loss`` hands the policy loss no token ids (no answer span).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss
from verl.workers.config import PolicyLossConfig

from lld_monitor import lld

log = logging.getLogger(__name__)

LOSS_MODE = "llds"
VERL_NORMS = ("token_mean", "seq_mean")
METRIC_KEYS = ("lld/llds_loss", "lld/llds_raw", "lld/llds_noise_gated", "lld/delta_abs_max", "lld/frac_preserved",
               "lld/frac_penalized_tokens")
_warned_noise = False


@dataclass
class LLDSPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus the LLDS settings (see lld.LLDSConfig)."""

    llds_lambda: float = lld.LLDSConfig.lam
    llds_gate: str = lld.LLDSConfig.gate
    llds_norm: str = "token_mean"
    llds_base_loss_mode: str = "vanilla"
    llds_noise_floor: float = lld.NOISE_FLOOR


@dataclass(frozen=True)
class VerlLLDS:
    """The LLDS settings read from an actor config."""

    cfg: lld.LLDSConfig
    base_loss_mode: str
    noise_floor: float


def llds_config(config: Any) -> VerlLLDS:
    """The LLDS settings from an actor config whose policy_loss may carry the llds_* fields."""
    pl = config.policy_loss if config is not None and "policy_loss" in config else {}

    def get(name: str, default: Any) -> Any:
        v = pl.get(name, default) if hasattr(pl, "get") else getattr(pl, name, default)
        return default if v is None else v

    norm = str(get("llds_norm", "token_mean"))
    if norm not in VERL_NORMS:
        raise ValueError(
            f"llds_norm={norm!r} is not available in verl: the policy loss sees one micro-batch, so it cannot divide "
            f"by the mini-batch's number of preserved responses ('response'). Use one of {VERL_NORMS}: token_mean "
            "(the official code's) or seq_mean (per-response means over all responses of the mini-batch)."
        )
    cfg = lld.LLDSConfig(lam=float(get("llds_lambda", lld.LLDSConfig.lam)), gate=str(get("llds_gate", "action")),
                         norm=norm)
    base = str(get("llds_base_loss_mode", "vanilla"))
    if base == LOSS_MODE:
        raise ValueError("llds_base_loss_mode cannot be 'llds' itself; use 'vanilla' or another registered verl loss")
    floor = float(get("llds_noise_floor", lld.NOISE_FLOOR))
    if not floor >= 0:
        raise ValueError(f"llds_noise_floor must be >= 0 (0 = no noise gate), got {floor}")
    return VerlLLDS(cfg, base, floor)


def global_normalizer(norm: str, config: Any) -> tuple[float | None, int]:
    """(the mini-batch's LLDS denominator, dp_size) from verl's ``config.global_batch_info``; (None, 1) without
    it (a direct call on one batch: the micro-batch's own count)."""
    info = getattr(config, "global_batch_info", None) or {}
    dp = int(info.get("dp_size") or 1)
    n = info.get("batch_num_tokens") if norm == "token_mean" else info.get("global_batch_size")
    if n is None:
        if dp > 1:
            raise ValueError(f"LLDS norm {norm!r} with dp_size={dp} needs verl's global_batch_info (batch_num_tokens / "
                             "global_batch_size); verl's ppo_loss sets it")
        return None, 1
    return float(n), dp


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_llds(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``llds``: the base verl loss + λ·L_LLDS (mini-batch normalized), with lld/* metrics."""
    global _warned_noise
    s = llds_config(config)
    cfg = s.cfg
    pg_loss, metrics = get_policy_loss_fn(s.base_loss_mode)(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights,
    )
    mask = response_mask.bool()
    n_global, dp = global_normalizer(cfg.norm, config)
    term, st = lld.llds_loss(log_prob, old_log_prob, advantages, mask, cfg, normalizer=n_global)
    own_n = max(lld.llds_normalizer(advantages, mask, cfg.norm), 1)
    raw = float(term.detach()) * (n_global / own_n if n_global is not None else 1.0)  # the micro-batch's own L
    d_max = lld.max_abs_displacement(log_prob, old_log_prob, mask)
    gated = s.noise_floor > 0 and d_max <= s.noise_floor
    if gated:
        if not _warned_noise and st["n_penalized_tokens"] > 0:
            log.warning("lld-monitor LLDS: max |Δ| = %.3g <= llds_noise_floor = %.3g on a micro-batch: old_log_prob "
                        "and log_prob come from the same parameters (an on-policy mini-batch), so Δ is numerical "
                        "noise; no LLDS term there (logged as lld/llds_noise_gated)", d_max, s.noise_floor)
            _warned_noise = True
        loss = pg_loss
    else:
        loss = pg_loss + cfg.lam * term * dp
    n_tok = max(int(mask.sum()), 1)
    metrics = dict(metrics)
    metrics.update({
        "lld/llds_loss": 0.0 if gated else cfg.lam * raw,
        "lld/llds_raw": raw,
        "lld/llds_noise_gated": float(gated),
        "lld/delta_abs_max": d_max,
        "lld/frac_preserved": st["n_preserved"] / max(mask.shape[0], 1),
        "lld/frac_penalized_tokens": st["n_penalized_tokens"] / n_tok,
    })
    return loss, metrics


__all__ = ["LOSS_MODE", "METRIC_KEYS", "VERL_NORMS", "LLDSPolicyLossConfig", "VerlLLDS", "compute_policy_loss_llds",
           "global_normalizer", "llds_config"]
