"""LLDS as a verl policy loss, registered with verl's own registry (verl 0.9.1; ``pip install lld-monitor[verl]``).

Loaded on the workers by verl itself, selected by config — verl is not edited::

    actor_rollout_ref.model.external_lib=lld_monitor.integrations.verl_llds
    actor_rollout_ref.actor.policy_loss.loss_mode=llds

λ and the gate / norm default to :class:`lld_monitor.lld.LLDSConfig` (λ = 0.2, A-gate, per-response norm).
To set them, point the policy-loss config at :class:`LLDSPolicyLossConfig` (verl builds it with Hydra)::

    actor_rollout_ref.actor.policy_loss._target_=lld_monitor.integrations.verl_llds.LLDSPolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.llds_lambda=0.1
    +actor_rollout_ref.actor.policy_loss.llds_norm=token_mean

The loss is ``L = L_base + λ · L_LLDS`` where ``L_base`` is the registered verl loss named by
``llds_base_loss_mode`` (``vanilla``: verl's PPO-clip) and ``L_LLDS`` is :func:`lld_monitor.lld.llds_loss` on
the micro-batch (``log_prob`` carries the gradient; ``old_log_prob`` and ``response_mask`` are verl's: tool /
observation tokens are 0 in ``response_mask`` and so excluded). Under verl's global-batch normalisation
(``config.global_batch_info``: ``dp_size`` and ``batch_num_tokens`` / ``global_batch_size``) the term is scaled
like verl's own ``agg_loss`` so the micro-batches add up to the global-batch value.

Per-micro-batch step metrics go out the verl way: in the loss's metrics dict, which verl averages over
micro-batches (``lld/<signal>`` keys from :func:`lld_monitor.integrations.verl.lld_metrics`, plus
``lld/llds_loss`` = λ·L_LLDS and ``lld/llds_raw``). Non-finite values (nothing to average in this
micro-batch) are left out rather than poisoning the mean.

LLDS-MA is not offered here: verl 0.9.1's ``ppo_loss`` hands the policy loss only ``old_log_prob``,
``log_prob``, ``advantages`` and ``response_mask`` (no token ids, no answer span).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss
from verl.workers.config import PolicyLossConfig

from lld_monitor import lld
from lld_monitor.integrations.verl import lld_metrics

log = logging.getLogger(__name__)

LOSS_MODE = "llds"


@dataclass
class LLDSPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus the LLDS settings (see lld.LLDSConfig)."""

    llds_lambda: float = lld.LLDSConfig.lam
    llds_gate: str = lld.LLDSConfig.gate
    llds_norm: str = lld.LLDSConfig.norm
    llds_base_loss_mode: str = "vanilla"


def llds_config(config: Any) -> tuple[lld.LLDSConfig, str]:
    """(LLDSConfig, base loss mode) from an actor config whose policy_loss may carry the llds_* fields."""
    pl = config.policy_loss if config is not None and "policy_loss" in config else {}

    def get(name: str, default: Any) -> Any:
        v = pl.get(name, default) if hasattr(pl, "get") else getattr(pl, name, default)
        return default if v is None else v

    cfg = lld.LLDSConfig(lam=float(get("llds_lambda", lld.LLDSConfig.lam)), gate=str(get("llds_gate", "action")),
                         norm=str(get("llds_norm", "response")))
    base = str(get("llds_base_loss_mode", "vanilla"))
    if base == LOSS_MODE:
        raise ValueError("llds_base_loss_mode cannot be 'llds' itself; use 'vanilla' or another registered verl loss")
    return cfg, base


def _global_scale(cfg: lld.LLDSConfig, response_mask: torch.Tensor, config: Any) -> float:
    """Factor that makes the per-micro-batch term add up to the global-batch value, as verl's agg_loss does."""
    info = getattr(config, "global_batch_info", None) or {}
    dp = int(info.get("dp_size") or 1)
    if cfg.norm == "token_mean" and info.get("batch_num_tokens"):
        return float(response_mask.sum()) / float(info["batch_num_tokens"]) * dp
    if cfg.norm == "response" and info.get("global_batch_size"):
        return response_mask.shape[0] / float(info["global_batch_size"]) * dp
    return 1.0


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
    """verl policy loss ``llds``: the base verl loss + λ·L_LLDS, with lld/<signal> micro-batch metrics."""
    cfg, base_mode = llds_config(config)
    base_fn = get_policy_loss_fn(base_mode)
    pg_loss, metrics = base_fn(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights,
    )
    mask = response_mask.bool()
    term, _ = lld.llds_loss(log_prob, old_log_prob, advantages, mask, cfg)
    loss = pg_loss + cfg.lam * term * _global_scale(cfg, mask, config)
    step = lld_metrics({"old_log_probs": old_log_prob, "advantages": advantages, "response_mask": mask},
                       log_prob=log_prob.detach())
    step["lld/llds_loss"] = cfg.lam * float(term.detach())
    step["lld/llds_raw"] = float(term.detach())
    metrics = dict(metrics)
    metrics.update({k: v for k, v in step.items() if math.isfinite(v)})
    return loss, metrics


__all__ = ["LOSS_MODE", "LLDSPolicyLossConfig", "compute_policy_loss_llds", "llds_config"]
