r"""The LLD math: token confidence, displacement, GRPO advantages, PPO-clip, LLDS and LLDS-MA.

Pure torch (no storage, no UI). Every function is batched over a right-padded ``[B, T]`` layout of
*response* tokens (prompt excluded) with a boolean ``action_mask``: True on tokens the model
generated (actions, including the final answer), False on tool/observation tokens and on padding.
Tool tokens stay in the model's context but are excluded from every likelihood figure and every loss.

Sign conventions (read this first)
----------------------------------
* Displayed displacement (paper Def. 4.1, Eq. 3; the store's ``delta_*`` columns):

      Δ_{i,t,k} = ln π_after(y_{i,t,k} | ·) − ln π_before(y_{i,t,k} | ·)      (negative = likelihood fell)

  :func:`displacement` returns this Δ per token, summed per action (``action_sum``) and per response
  (``response_sum``), and the per-response length-normalized mean (``response_mean``).
* The regularizer uses the paper's flipped sign (paper §5.5, and the official code's ``d``):

      d_{i,t,k} = ln π_old(y_{i,t,k} | ·) − ln π_θ(y_{i,t,k} | ·) = −Δ                (positive = fell)

Masks
-----
* action segmentation: each maximal run of action tokens between observations is one action
  (:func:`action_index`: 0, 1, 2, … per run, −1 elsewhere) — identical to the official code's
  "chunks" of ``response_mask``.
* answer span: the last closed ``<answer> … </answer>`` span, tags included, found on token ids
  (:func:`answer_span_mask`).

LLDS (paper Eqs. 4–6, 9, 10)
----------------------------
Preserving set Y_pre = {i : Â_i ≥ 0 and response i has ≥ 1 action token}. With the gate
g_{i,t} ∈ {0, 1} and the answer weight w_{i,t,k} (β on answer-span tokens under LLDS-MA, else 1):

    per-token penalty   p_{i,t,k} = [Â_i ≥ 0] · g_{i,t} · w_{i,t,k} · max(0, d_{i,t,k})

    A-gate  (gate="action", default):   g_{i,t} = 𝟙[ Σ_k d_{i,t,k} > 0 ]        (action's sum fell)
    R-gate  (gate="response"):          g_{i,t} = 𝟙[ Σ_t Σ_k d_{i,t,k} > 0 ]    (response's sum fell)
    token   (gate="token"):             g_{i,t} = 1                              (Eq. 9, ungated)

Gates use the signed, unweighted d (as the official code after its "fix bug" commit 6453f61).

Normalization:

    norm="response" (paper, default):  L = (1/|Y_pre|) Σ_{i∈Y_pre} (1 / Σ_t |y_{i,t}|) Σ_{t,k} p_{i,t,k}
    norm="token_mean" (official code): L = Σ_{i,t,k} p_{i,t,k} / (number of action tokens of ALL
                                        responses in the batch, Â < 0 ones included)
    norm="seq_mean":                   L = (1/|Y|) Σ_{i∈Y_pre} (1 / Σ_t |y_{i,t}|) Σ_{t,k} p_{i,t,k}
                                        (Y = the responses with ≥ 1 action token, Â < 0 ones included)

All give 0 when nothing is in the denominator.

Micro-batches and ranks: the denominator is a count over the *global* batch (the one optimizer step).
``llds_loss(..., normalizer=N)`` divides by a given N instead of this batch's own count; with N the
global count (:func:`llds_normalizer` summed over the micro-batches of every rank), the micro-batch
values add up exactly to the global batch's value, so the effective λ does not depend on how the batch
is split. Without ``normalizer`` (one batch, one optimizer step) the batch's own count is used. Total loss (Eq. 6): L_total = L_GRPO + λ·L_LLDS;
:func:`llds_loss` returns L_LLDS *without* λ (``LLDSConfig.lam`` is for the caller).

∂L/∂ln π_θ(y_{i,t,k}) = −g·w/norm_i < 0 on penalized tokens (d > 0, gate open, w > 0), so a gradient
step raises their log-likelihood; it is exactly 0 on every other token (``relu'(0) = 0``).

LLDS-MA β (paper App. B.2.1 vs official code)
---------------------------------------------
    fixed:            β = LLDSConfig.answer_weight
    adaptive "paper": β = min(V / V_B, 1)             V = mean valid searches, V_B = v_base (2)
    adaptive "code":  β = min(max(V − (V_B − 1), 0), 1)   = min(max(V − 1, 0), 1) for V_B = 2

In the official code the answer-span coefficient is ``min(mask_weight, λ)`` with
``mask_weight = answer_no_reduce_lambda · max(V − 1, 0)``; that is β = min(ω·max(V−1, 0), 1) with
ω = answer_no_reduce_lambda / λ. Passing both ``answer_weight=ω`` and ``adaptive_beta`` gives
β = min(ω · ramp(V), 1) with the uncapped ramp V/V_B or max(V − (V_B − 1), 0) (ω defaults to 1).

GRPO and PPO-clip (official code §4.1–4.2)
-------------------------------------------
    Â_i = (r_i − mean_g) / (std_g + eps),  std unbiased (n−1) like torch.std, eps = 1e-6,
          all-equal groups → exactly 0, singleton groups → 0 (default) or r_i/(1+eps) (verl).
    ratio = exp(ln π_θ − ln π_old) (log-ratio clamped to [−20, ln 100], as the code's ratio clamp),
    pg = token mean over action tokens of max(−Â·ratio, −Â·clip(ratio, 1−ε, 1+ε)),
    k3 KL (verl ``low_var_kl``): kl = exp(ln π_ref − ln π_θ) − (ln π_ref − ln π_θ) − 1, clamped to [−10, 10].
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "NOISE_FLOOR",
    "DisplacementStats",
    "LLDSConfig",
    "action_index",
    "answer_beta",
    "answer_span_mask",
    "displacement",
    "displacement_summary",
    "grpo_advantages",
    "llds_loss",
    "llds_normalizer",
    "llds_token_flags",
    "max_abs_displacement",
    "LLDSTokens",
    "logprobs_and_entropy",
    "ppo_clip_loss",
    "response_advantages",
    "token_entropy",
    "token_logprobs",
]

logger = logging.getLogger(__name__)

GATES = ("action", "response", "token")
NORMS = ("response", "token_mean", "seq_mean")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean")
BETA_RULES = ("paper", "code")
SINGLETON_RULES = ("zero", "verl")

# ln(100): the official code clamps the PPO ratio to at most 100 (see module docstring).
_LOG_RATIO_MAX = math.log(100.0)
_LOG_RATIO_MIN = -20.0
_K3_CLAMP = 10.0


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------
def _check_2d(name: str, x: Tensor, like: Tensor | None = None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}")
    if like is not None and x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but expected {tuple(like.shape)} (same as the log-probs)")


def _as_bool_mask(name: str, mask: Tensor, like: Tensor | None = None) -> Tensor:
    _check_2d(name, mask, like)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return mask != 0
    raise TypeError(f"{name} must be a bool (or 0/1) tensor, got {mask.dtype}")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r} (use 1.0 for none)")


def _scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 3-D tensor [B, T, V], got {shape}")
    _check_temperature(temperature)
    z = logits.float()  # bf16/fp16 -> float32 before any softmax
    if temperature != 1.0:
        z = z / temperature
    return z


# ---------------------------------------------------------------------------------------------
# token log-probs and entropy
# ---------------------------------------------------------------------------------------------
def _gather_targets(logp_all: Tensor, targets: Tensor) -> Tensor:
    if targets.shape != logp_all.shape[:2]:
        raise ValueError(f"targets must be [B, T] = {tuple(logp_all.shape[:2])}, got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    return logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def _entropy_from_logp(logp_all: Tensor) -> Tensor:
    # H = −Σ p ln p. Where a logit is −inf, p = 0 and ln p = −inf: replace ln p by 0 there so that
    # neither the value (0·−inf) nor the gradient becomes NaN.
    p = logp_all.exp()
    safe = torch.where(torch.isfinite(logp_all), logp_all, torch.zeros_like(logp_all))
    return -(p * safe).sum(-1)


# Without autograd, logits are processed in row chunks of about this many elements, so the float32
# copy never exceeds ~64 MB even for a 150k vocabulary (with autograd the graph needs it all anyway).
_CHUNK_ELEMS = 1 << 24


def _logp_entropy(
    logits: Tensor, targets: Tensor | None, temperature: float, want_entropy: bool
) -> tuple[Tensor | None, Tensor | None]:
    _scaled_logits(logits, temperature)  # validates shape and temperature
    if targets is not None and targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must be [B, T] = {tuple(logits.shape[:2])}, got {tuple(targets.shape)}")
    b, t, v = logits.shape
    if (torch.is_grad_enabled() and logits.requires_grad) or b * t * v <= _CHUNK_ELEMS:
        logp_all = F.log_softmax(_scaled_logits(logits, temperature), dim=-1)
        lp = _gather_targets(logp_all, targets) if targets is not None else None
        return lp, (_entropy_from_logp(logp_all) if want_entropy else None)
    flat = logits.reshape(b * t, v)
    tflat = targets.reshape(b * t, 1) if targets is not None else None
    rows = max(1, _CHUNK_ELEMS // max(v, 1))
    lps, hs = [], []
    for s in range(0, b * t, rows):
        logp_all = F.log_softmax(_scaled_logits(flat[s : s + rows].unsqueeze(0), temperature), dim=-1)
        if tflat is not None:
            lps.append(_gather_targets(logp_all, tflat[s : s + rows].reshape(1, -1)).reshape(-1))
        if want_entropy:
            hs.append(_entropy_from_logp(logp_all).reshape(-1))
    lp = torch.cat(lps).reshape(b, t) if tflat is not None else None
    return lp, (torch.cat(hs).reshape(b, t) if want_entropy else None)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """ln π(targets | ·) in float32 from logits [B, T, V] (any float dtype), divided by ``temperature``.

    ``logits[:, t]`` must already be the distribution over ``targets[:, t]`` (shift done by the caller).
    """
    lp, _ = _logp_entropy(logits, targets, temperature, want_entropy=False)
    return lp


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy −Σ_v p_v ln p_v (nats) per position, float32, NaN-free for −inf logits."""
    _, h = _logp_entropy(logits, None, temperature, want_entropy=True)
    return h


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Both :func:`token_logprobs` and :func:`token_entropy` from one float32 log-softmax."""
    return _logp_entropy(logits, targets, temperature, want_entropy=True)


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------
def action_index(action_mask: Tensor) -> Tensor:
    """0, 1, 2, … for each maximal run of action tokens in a row; −1 on non-action tokens. [B, T] long."""
    m = _as_bool_mask("action_mask", action_mask)
    prev = torch.zeros_like(m)
    prev[:, 1:] = m[:, :-1]
    starts = m & ~prev
    idx = starts.long().cumsum(dim=1) - 1
    return torch.where(m, idx, torch.full_like(idx, -1))


def _subsequence_starts(token_ids: Tensor, allowed: Tensor, pattern: Sequence[int]) -> Tensor:
    """[B, T] bool: True at j where token_ids[:, j:j+L] == pattern and every one of those tokens is allowed."""
    b, t = token_ids.shape
    length = len(pattern)
    out = torch.zeros(b, t, dtype=torch.bool, device=token_ids.device)
    if length == 0 or length > t:
        return out
    pat = torch.as_tensor(list(pattern), dtype=token_ids.dtype, device=token_ids.device)
    windows = token_ids.unfold(1, length, 1)  # [B, T-L+1, L]
    ok = allowed.unfold(1, length, 1).all(-1)
    out[:, : t - length + 1] = (windows == pat).all(-1) & ok
    return out


def answer_span_mask(
    token_ids: Tensor,
    action_mask: Tensor,
    open_ids: Sequence[int],
    close_ids: Sequence[int],
) -> Tensor:
    """The last closed ``<answer> … </answer>`` span per row, tags included, as a bool [B, T] mask.

    Works on token ids (multi-token tags matched as subsequences), so no re-tokenization is needed.
    Only tags made of action tokens count (an ``<answer>`` inside a tool observation is ignored) and
    the span is intersected with ``action_mask``. The span closes at the *last* ``close_ids``
    occurrence and opens at the last ``open_ids`` occurrence that ends before it. A row with no closed
    span is all False. (The official code instead decodes the last 50 tokens, regex-matches
    ``<answer>.*?</answer>`` and re-tokenizes, which is approximate; see docs/lld.md.)
    """
    if not isinstance(token_ids, Tensor) or token_ids.dim() != 2:
        raise ValueError("token_ids must be a 2-D integer tensor [B, T]")
    if token_ids.is_floating_point():
        raise TypeError(f"token_ids must be integer token ids, got {token_ids.dtype}")
    m = _as_bool_mask("action_mask", action_mask, token_ids)
    open_ids, close_ids = list(open_ids), list(close_ids)
    if not open_ids or not close_ids:
        raise ValueError("open_ids and close_ids must be non-empty token-id sequences, e.g. tokenizer.encode('<answer>')")
    b, t = token_ids.shape
    pos = torch.arange(t, device=token_ids.device).expand(b, t)
    neg = torch.full_like(pos, -1)
    close_start = torch.where(_subsequence_starts(token_ids, m, close_ids), pos, neg).max(dim=1).values
    opens = _subsequence_starts(token_ids, m, open_ids) & (pos + len(open_ids) <= close_start.unsqueeze(1))
    open_start = torch.where(opens, pos, neg).max(dim=1).values
    valid = (close_start >= 0) & (open_start >= 0)
    span = (pos >= open_start.unsqueeze(1)) & (pos < (close_start + len(close_ids)).unsqueeze(1))
    return span & valid.unsqueeze(1) & m


# ---------------------------------------------------------------------------------------------
# displacement
# ---------------------------------------------------------------------------------------------
@dataclass
class DisplacementStats:
    """Δ = logp_new − logp_old (negative = likelihood fell) on action tokens.

    token [B, T] (0 off the action mask); response_sum [B]; response_mean [B] (sum / action tokens,
    0 for a response without action tokens); action_sum [B, A] and action_valid [B, A] (A = the most
    actions of any row, at least 1); also n_tokens [B], n_actions [B], action_len [B, A],
    action_idx [B, T] (as :func:`action_index`).
    """

    token: Tensor
    response_sum: Tensor
    response_mean: Tensor
    action_sum: Tensor
    action_valid: Tensor
    n_tokens: Tensor
    n_actions: Tensor
    action_len: Tensor
    action_idx: Tensor


def _per_action_sums(values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Scatter-sum [B, T] values into [B, A] per action (idx −1 ignored). Returns (sums, counts)."""
    b = idx.shape[0]
    n_act = int(idx.max().item()) + 1 if idx.numel() else 0
    a = max(n_act, 1)
    slot = torch.where(idx >= 0, idx, torch.full_like(idx, a))  # off-action tokens go to a dump slot
    sums = torch.zeros(b, a + 1, dtype=values.dtype, device=values.device).scatter_add(1, slot, values)
    counts = torch.zeros(b, a + 1, dtype=torch.long, device=values.device).scatter_add(
        1, slot, torch.ones_like(slot)
    )
    return sums[:, :a], counts[:, :a]


def displacement(logp_new: Tensor, logp_old: Tensor, action_mask: Tensor) -> DisplacementStats:
    """Per-token, per-action and per-response Δ = logp_new − logp_old over action tokens only.

    Values off the action mask (tool tokens, padding) are ignored even if they are NaN.
    Differentiable; call under ``torch.no_grad()`` for metrics.
    """
    _check_2d("logp_new", logp_new)
    _check_2d("logp_old", logp_old, logp_new)
    m = _as_bool_mask("action_mask", action_mask, logp_new)
    delta = torch.where(m, logp_new.float() - logp_old.float(), torch.zeros((), device=logp_new.device))
    idx = action_index(m)
    action_sum, action_len = _per_action_sums(delta, idx)
    n_tokens = m.sum(dim=1)
    response_sum = delta.sum(dim=1)
    response_mean = response_sum / n_tokens.clamp(min=1)
    return DisplacementStats(
        token=delta,
        response_sum=response_sum,
        response_mean=response_mean,
        action_sum=action_sum,
        action_valid=action_len > 0,
        n_tokens=n_tokens,
        n_actions=(action_len > 0).sum(dim=1),
        action_len=action_len,
        action_idx=idx,
    )


def response_advantages(advantages: Tensor, b: int, mask: Tensor | None = None) -> Tensor:
    """Per-response Â [B] from [B] or verl-style tiled [B, T] advantages.

    verl tiles Â over the response and zeroes it on padding, so a [B, T] row is read at its first
    action token (``mask``), or at position 0 without a mask.
    """
    if not isinstance(advantages, Tensor):
        advantages = torch.as_tensor(advantages)
    if advantages.dim() == 2:
        if advantages.shape[0] != b:
            raise ValueError(f"advantages [B, T] must have B = {b} rows, got {tuple(advantages.shape)}")
        col = torch.zeros(b, dtype=torch.long, device=advantages.device)
        if mask is not None and mask.shape == advantages.shape:
            col = mask.to(advantages.device).int().argmax(dim=1)  # first action token (0 if none)
        advantages = advantages.gather(1, col.unsqueeze(1)).squeeze(1)
    if advantages.shape != (b,):
        raise ValueError(f"advantages must have shape [B] = ({b},) (or [B, T]), got {tuple(advantages.shape)}")
    if advantages.is_floating_point() and not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf; check the rewards and grpo_advantages() input")
    return advantages


def displacement_summary(
    stats: DisplacementStats, advantages: Tensor, correct: Tensor | None = None
) -> dict[str, float]:
    """Batch aggregates over the preserved responses (Â ≥ 0 with ≥ 1 action token).

    delta_preserved: mean of response_sum; delta_preserved_mean: mean of response_mean;
    frac_responses_displaced: fraction with response_sum < 0; frac_actions_displaced: fraction of
    their actions with action_sum < 0. NaN where there is nothing to average (never a fake 0).
    Also n_preserved (responses) and n_preserved_actions.

    With ``correct`` [B] bool (reward > 0), also the paper's Eq. 3 probe over correct responses
    (with ≥ 1 action token): delta_correct (mean Σ Δ), delta_correct_mean, frac_correct_displaced,
    n_correct.
    """
    b = stats.response_sum.shape[0]
    dev = stats.response_sum.device
    adv = response_advantages(advantages, b, stats.action_idx >= 0).to(dev)
    has_tok = stats.n_tokens > 0
    pre = (adv >= 0) & has_tok
    n_pre = int(pre.sum().item())
    acts = stats.action_valid & pre.unsqueeze(1)
    n_act = int(acts.sum().item())
    nan = float("nan")

    def mean_of(x: Tensor, sel: Tensor, n: int) -> float:
        return float(x[sel].double().mean()) if n else nan

    with torch.no_grad():
        out = {
            "delta_preserved": mean_of(stats.response_sum, pre, n_pre),
            "delta_preserved_mean": mean_of(stats.response_mean, pre, n_pre),
            "frac_actions_displaced": mean_of((stats.action_sum < 0).float(), acts, n_act),
            "frac_responses_displaced": mean_of((stats.response_sum < 0).float(), pre, n_pre),
            "n_preserved": float(n_pre),
            "n_preserved_actions": float(n_act),
        }
        if correct is not None:
            c = torch.as_tensor(correct, device=dev)
            if c.shape != (b,):
                raise ValueError(f"correct must have shape [B] = ({b},), got {tuple(c.shape)}")
            sel = c.bool() & has_tok
            n_c = int(sel.sum().item())
            out.update(
                {
                    "delta_correct": mean_of(stats.response_sum, sel, n_c),
                    "delta_correct_mean": mean_of(stats.response_mean, sel, n_c),
                    "frac_correct_displaced": mean_of((stats.response_sum < 0).float(), sel, n_c),
                    "n_correct": float(n_c),
                }
            )
    return out


# |Δ| at or below this on every action token: the "old" and the current log-probs are one policy up to
# recomputation noise (float32 on one device, same batch shapes: ~1e-7; bf16 / another batch layout can be larger)
NOISE_FLOOR = 1e-4


def max_abs_displacement(logp_new: Tensor, logp_old: Tensor, action_mask: Tensor) -> float:
    """max |ln π_new − ln π_old| over the action tokens (0.0 without any). At or below a noise floor
    (:data:`NOISE_FLOOR`) the two log-probs come from the same parameters and Δ is numerical noise: the LLDS term
    would push up the likelihood of whichever tokens the noise lowered, at full λ (its gradient does not shrink
    with |Δ|)."""
    _check_2d("logp_new", logp_new)
    _check_2d("logp_old", logp_old, logp_new)
    m = _as_bool_mask("action_mask", action_mask, logp_new)
    with torch.no_grad():
        diff = torch.where(m, (logp_new.detach().float() - logp_old.detach().float()).abs(),
                           torch.zeros((), device=logp_new.device))
        return float(diff.max()) if diff.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# GRPO advantages and PPO-clip
# ---------------------------------------------------------------------------------------------
def _group_codes(group_ids: Sequence[Hashable] | Tensor, n: int) -> Tensor:
    if isinstance(group_ids, Tensor):
        group_ids = group_ids.tolist()
    else:
        try:
            import numpy as np  # local import: numpy arrays of ids are common

            if isinstance(group_ids, np.ndarray):
                group_ids = group_ids.tolist()
        except ImportError:  # pragma: no cover
            pass
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}; pass one group id per rollout")
    codes: dict[Any, int] = {}
    try:
        return torch.tensor([codes.setdefault(g, len(codes)) for g in ids], dtype=torch.long)
    except TypeError as exc:
        raise TypeError(f"group ids must be hashable (str/int), got {exc}") from exc


def grpo_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    eps: float = 1e-6,
    unbiased: bool = True,
    singleton: str = "zero",
) -> Tensor:
    """Group-relative advantages Â_i = (r_i − mean_g) / (std_g + eps), float32 [N].

    ``unbiased=True`` uses the n−1 std like ``torch.std`` (the official code). Groups whose rewards are
    all equal get exactly 0 (they join LLDS's preserving set). A singleton group gets 0 with
    ``singleton="zero"`` (default: no relative signal), or r/(1+eps) with ``singleton="verl"``
    (verl sets mean 0, std 1 for a group of one).
    """
    if singleton not in SINGLETON_RULES:
        raise ValueError(f"singleton must be one of {SINGLETON_RULES}, got {singleton!r}")
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    n = r.shape[0]
    codes = _group_codes(group_ids, n).to(r.device)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=r.device)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function before computing advantages")
    rd = r.double()
    g = int(codes.max().item()) + 1
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add(0, codes, torch.ones_like(rd))
    mean = torch.zeros(g, dtype=torch.float64, device=r.device).index_add(0, codes, rd) / count
    dev = rd - mean[codes]
    ss = torch.zeros(g, dtype=torch.float64, device=r.device).index_add(0, codes, dev * dev)
    denom = (count - 1.0).clamp(min=1.0) if unbiased else count
    std = (ss / denom).sqrt()
    rmax = torch.zeros(g, dtype=torch.float64, device=r.device).scatter_reduce(0, codes, rd, "amax", include_self=False)
    rmin = torch.zeros(g, dtype=torch.float64, device=r.device).scatter_reduce(0, codes, rd, "amin", include_self=False)
    adv = dev / (std[codes] + eps)
    adv = torch.where((rmax == rmin)[codes], torch.zeros_like(adv), adv)
    if singleton == "verl":
        adv = torch.where((count == 1)[codes], rd / (1.0 + eps), adv)
    return adv.float()


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(x: Tensor, m: Tensor) -> Tensor:
    """Mean over rows with ≥ 1 masked token of each row's masked token mean."""
    n = m.sum(dim=1)
    per_row = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=1) / n.clamp(min=1)
    has = n > 0
    return torch.where(has, per_row, torch.zeros_like(per_row)).sum() / has.sum().clamp(min=1)


def ppo_clip_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_eps: float = 0.2,
    logp_ref: Tensor | None = None,
    kl_coef: float = 0.0,
    agg: str = "token_mean",
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate plus kl_coef · k3 KL, aggregated over action tokens by ``agg``:

    - "token_mean" (verl / Search-R1): Σ over all action tokens of the batch / their number;
    - "seq_mean_token_mean" (DeepSeekMath's GRPO, TRL's loss_type="grpo"): each response's token
      mean, then the mean over responses with ≥ 1 action token. A token of a short response then
      weighs more than one of a long response, so identical tokens shared by a short wrong and a
      long correct response no longer cancel.

    Returns (loss, {"pg_loss", "clip_frac", "kl", "ratio_mean", "approx_kl"}); "kl" is the token-mean
    k3 KL to ``logp_ref`` (0 without a reference). Off-mask values (tool tokens, padding) are ignored.
    """
    _check_2d("logp", logp)
    _check_2d("logp_old", logp_old, logp)
    m = _as_bool_mask("action_mask", action_mask, logp)
    if not (clip_eps > 0):
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    if agg not in LOSS_AGGS:
        raise ValueError(f"agg must be one of {LOSS_AGGS}, got {agg!r}")
    reduce = _masked_mean if agg == "token_mean" else _seq_mean_token_mean
    b = logp.shape[0]
    adv = advantages
    if isinstance(adv, Tensor) and adv.dim() == 2:
        if adv.shape != logp.shape:
            raise ValueError(f"advantages [B, T] must match logp {tuple(logp.shape)}, got {tuple(adv.shape)}")
        adv = adv.float()
    else:
        adv = response_advantages(adv, b).float().unsqueeze(1)
    adv = adv.to(logp.device)
    zero = torch.zeros((), device=logp.device)
    log_ratio = torch.where(m, logp.float() - logp_old.detach().float(), zero)
    ratio = torch.exp(log_ratio.clamp(_LOG_RATIO_MIN, _LOG_RATIO_MAX))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = reduce(torch.maximum(pg1, pg2), m)
    loss = pg_loss
    kl_val = 0.0
    if logp_ref is not None:
        _check_2d("logp_ref", logp_ref, logp)
        kl_log = torch.where(m, logp_ref.detach().float() - logp.float(), zero)
        k3 = (torch.exp(kl_log) - kl_log - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)
        kl = reduce(k3, m)
        kl_val = float(kl.detach())
        if kl_coef:
            loss = loss + kl_coef * kl
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs logp_ref (the reference model's log-probs)")
    with torch.no_grad():
        stats = {
            "pg_loss": float(pg_loss),
            "clip_frac": float(_masked_mean((pg2 > pg1).float(), m)),
            "kl": kl_val,
            "ratio_mean": float(_masked_mean(ratio, m)),
            "approx_kl": float(_masked_mean(-log_ratio, m)),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------
# LLDS / LLDS-MA
# ---------------------------------------------------------------------------------------------
@dataclass
class LLDSConfig:
    """LLDS settings. ``lam`` is λ in L_total = L_GRPO + λ·L_LLDS (applied by the caller).

    gate: "action" (A-gate, paper v2 default) | "response" (R-gate) | "token" (ungated, Eq. 9).
    norm: "response" (paper: per preserved response, by its action-token count, then mean over
          preserved responses) | "token_mean" (official code: sum over the batch / all action tokens,
          Â < 0 responses included in the denominator) | "seq_mean" (per preserved response as
          "response", then divided by the number of all responses with an action token).
    answer_weight: None = plain LLDS; a float = LLDS-MA with fixed β (0 exempts the answer span).
    adaptive_beta: None | "paper" (β = min(V/v_base, 1)) | "code" (β = min(max(V − v_base + 1, 0), 1));
          V = mean valid searches. With both set, answer_weight is the code's multiplier ω.
    """

    lam: float = 0.2
    gate: str = "action"
    norm: str = "response"
    answer_weight: float | None = None
    adaptive_beta: str | None = None
    v_base: float = 2.0

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"LLDSConfig.gate must be one of {GATES}, got {self.gate!r}")
        if self.norm not in NORMS:
            raise ValueError(f"LLDSConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if self.adaptive_beta is not None and self.adaptive_beta not in BETA_RULES:
            raise ValueError(f"LLDSConfig.adaptive_beta must be None or one of {BETA_RULES}, got {self.adaptive_beta!r}")
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"LLDSConfig.lam must be a finite number ≥ 0, got {self.lam}")
        if self.answer_weight is not None and not (math.isfinite(self.answer_weight) and self.answer_weight >= 0):
            raise ValueError(f"LLDSConfig.answer_weight must be None or a finite number ≥ 0, got {self.answer_weight}")
        if not (math.isfinite(self.v_base) and self.v_base > 0):
            raise ValueError(f"LLDSConfig.v_base must be > 0, got {self.v_base}")

    @property
    def masks_answer(self) -> bool:
        """True for LLDS-MA (the answer span gets weight β)."""
        return self.answer_weight is not None or self.adaptive_beta is not None


def _beta_ramp(valid_searches_mean: float, rule: str, v_base: float) -> float:
    """The uncapped ramp: V / v_base (paper) or max(V − (v_base − 1), 0) (code); always ≥ 0."""
    v = float(valid_searches_mean)
    if not math.isfinite(v):
        raise ValueError(f"valid_searches_mean must be finite, got {valid_searches_mean!r}")
    if not (math.isfinite(v_base) and v_base > 0):
        raise ValueError(f"v_base must be > 0, got {v_base}")
    if rule == "paper":
        ramp = v / v_base
    elif rule == "code":
        ramp = v - (v_base - 1.0)
    else:
        raise ValueError(f"rule must be one of {BETA_RULES}, got {rule!r}")
    return max(ramp, 0.0)


def answer_beta(valid_searches_mean: float, rule: str = "paper", v_base: float = 2.0) -> float:
    """Adaptive LLDS-MA weight β from the mean number of valid searches V.

    paper (App. B.2.1): β = min(V / v_base, 1); code: β = min(max(V − (v_base − 1), 0), 1),
    i.e. min(max(V − 1, 0), 1) for v_base = 2. Both are clipped to [0, 1].
    """
    return min(_beta_ramp(valid_searches_mean, rule, v_base), 1.0)


def _resolve_beta(cfg: LLDSConfig, valid_searches_mean: float | None) -> float | None:
    if cfg.adaptive_beta is not None:
        if valid_searches_mean is None:
            raise ValueError(
                f"LLDSConfig.adaptive_beta={cfg.adaptive_beta!r} needs valid_searches_mean "
                "(the batch mean of valid searches per response)"
            )
        # β = min(ω · ramp(V), 1) with the uncapped ramp, exactly the code's min(ω·λ·max(V−1, 0), λ)/λ
        omega = 1.0 if cfg.answer_weight is None else float(cfg.answer_weight)
        return min(omega * _beta_ramp(valid_searches_mean, cfg.adaptive_beta, cfg.v_base), 1.0)
    return None if cfg.answer_weight is None else float(cfg.answer_weight)


class _LLDSTerms(NamedTuple):
    """What :func:`llds_loss` computes before it normalizes (one implementation of the gates and weights)."""

    zero: Tensor
    n_tok: Tensor  # [B] action tokens per response
    pre_resp: Tensor  # [B] bool: Y_pre
    gate: Tensor  # [B, T] bool: preserved action token whose gate is open
    weight: Tensor  # [B, T] gate · w (β on the answer span under LLDS-MA)
    d: Tensor  # [B, T] detached d = ln π_old − ln π_θ on preserved action tokens (> 0: fell), 0 elsewhere
    penalty: Tensor  # [B, T] p = weight · max(0, d), carries the gradient
    penalized: Tensor  # [B, T] bool: weight > 0 and d > 0 (a positive penalty)
    act_open: Tensor  # [B, A] bool
    resp_open: Tensor  # [B] bool
    beta: float | None


def _llds_terms(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cfg: LLDSConfig,
    answer_mask: Tensor | None,
    valid_searches_mean: float | None,
) -> _LLDSTerms:
    _check_2d("logp", logp)
    _check_2d("logp_old", logp_old, logp)
    m = _as_bool_mask("action_mask", action_mask, logp)
    b = logp.shape[0]
    adv = response_advantages(advantages, b, m).to(logp.device)
    beta = _resolve_beta(cfg, valid_searches_mean)
    if beta is not None and answer_mask is None:
        raise ValueError("LLDS-MA (answer_weight / adaptive_beta set) needs answer_mask; build it with answer_span_mask()")

    zero = torch.zeros((), device=logp.device)
    n_tok = m.sum(dim=1)
    pre_resp = (adv >= 0) & (n_tok > 0)  # Y_pre
    pm = m & pre_resp.unsqueeze(1)  # preserved action tokens
    d = torch.where(pm, logp_old.detach().float() - logp.float(), zero)  # d = old − new, > 0: fell
    d_det = d.detach()
    base = F.relu(d)

    idx = action_index(pm)
    act_sum, act_len = _per_action_sums(d_det, idx)
    act_valid = act_len > 0
    if cfg.gate == "action":
        act_open = (act_sum > 0) & act_valid
        tok_gate = torch.gather(act_open, 1, idx.clamp(min=0)) & pm
        resp_open = act_open.any(dim=1)
    elif cfg.gate == "response":
        resp_open = (d_det.sum(dim=1) > 0) & pre_resp
        act_open = act_valid & resp_open.unsqueeze(1)
        tok_gate = pm & resp_open.unsqueeze(1)
    else:  # token
        act_falls, _ = _per_action_sums((d_det > 0).float(), idx)
        act_open = (act_falls > 0) & act_valid
        tok_gate = pm
        resp_open = act_open.any(dim=1)

    weight = tok_gate.float()
    if beta is not None:
        am = _as_bool_mask("answer_mask", answer_mask, logp).to(logp.device)
        weight = torch.where(am, weight * beta, weight)
    penalty = weight * base  # [B, T] ≥ 0
    penalized = (weight > 0) & (d_det > 0)
    return _LLDSTerms(zero, n_tok, pre_resp, tok_gate, weight, d_det, penalty, penalized, act_open, resp_open, beta)


class LLDSTokens(NamedTuple):
    """Per-token view of the LLDS term (:func:`llds_token_flags`), all detached, ``[B, T]``."""

    gated: Tensor  # bool: action token of a preserved response whose gate (action / response / token) is open
    penalized: Tensor  # bool: gated, weight > 0 and its likelihood fell (d > 0): the tokens n_penalized_tokens counts
    penalty: Tensor  # float: p_{i,t,k} = gate · w · max(0, d), before normalization (0 off the penalized tokens)


def llds_token_flags(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cfg: LLDSConfig | None = None,
    answer_mask: Tensor | None = None,
    valid_searches_mean: float | None = None,
) -> LLDSTokens:
    """Which tokens :func:`llds_loss` gates and penalizes, with the same arguments and the same code path.

    ``penalized.sum()`` equals ``llds_loss(...)[1]["n_penalized_tokens"]``; ``penalty`` summed per response and
    normalized by ``cfg.norm`` gives ``llds_raw``. No gradient is built.
    """
    cfg = cfg if cfg is not None else LLDSConfig()
    with torch.no_grad():
        t = _llds_terms(logp, logp_old, advantages, action_mask, cfg, answer_mask, valid_searches_mean)
        return LLDSTokens(t.gate, t.penalized, t.penalty)


def llds_normalizer(advantages: Tensor, action_mask: Tensor, norm: str) -> int:
    """This batch's LLDS denominator for ``norm``: |Y_pre| ("response"), its action tokens ("token_mean"),
    its responses with ≥ 1 action token ("seq_mean"). Summed over the micro-batches of every rank it is the
    global ``normalizer`` of :func:`llds_loss`."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    m = _as_bool_mask("action_mask", action_mask)
    n_tok = m.sum(dim=1)
    if norm == "token_mean":
        return int(n_tok.sum())
    if norm == "seq_mean":
        return int((n_tok > 0).sum())
    adv = response_advantages(advantages, m.shape[0], m).to(m.device)
    return int(((adv >= 0) & (n_tok > 0)).sum())


def _check_normalizer(normalizer: float | None) -> float | None:
    if normalizer is None:
        return None
    n = float(normalizer)
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"normalizer must be a finite count ≥ 0 (the global batch's llds_normalizer), got {normalizer!r}")
    return max(n, 1.0)


def llds_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cfg: LLDSConfig | None = None,
    answer_mask: Tensor | None = None,
    valid_searches_mean: float | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """L_LLDS (or L_LLDS-MA) — λ NOT included. See the module docstring for the formulas.

    logp: current ln π_θ on the response tokens (carries the gradient); logp_old: the rollout
    policy's (detached internally); advantages [B] (or verl-style [B, T], row-constant);
    answer_mask [B, T]: needed for LLDS-MA (see :func:`answer_span_mask`).
    normalizer: the global batch's denominator (:func:`llds_normalizer` summed over every micro-batch
    and rank) when this batch is one micro-batch of it; None (default) = this batch's own count.

    Stats: llds_raw (the loss value), n_penalized_tokens (tokens with a positive penalty),
    n_gated_actions (preserved actions whose gate is open; for gate="token", actions with ≥ 1
    falling token), n_gated_responses, n_preserved (|Y_pre|), beta (1.0 for plain LLDS).
    """
    cfg = cfg if cfg is not None else LLDSConfig()
    norm_n = _check_normalizer(normalizer)
    t = _llds_terms(logp, logp_old, advantages, action_mask, cfg, answer_mask, valid_searches_mean)
    zero, n_tok, pre_resp, penalty = t.zero, t.n_tok, t.pre_resp, t.penalty

    if cfg.norm in ("response", "seq_mean"):
        per_resp = penalty.sum(dim=1) / n_tok.clamp(min=1)
        if norm_n is not None:
            denom = norm_n
        elif cfg.norm == "response":
            denom = pre_resp.sum().clamp(min=1)
        else:  # seq_mean: every response with an action token, Â < 0 included
            denom = (n_tok > 0).sum().clamp(min=1)
        loss = torch.where(pre_resp, per_resp, zero).sum() / denom
    else:  # token_mean: all action tokens of the batch in the denominator, Â < 0 included
        loss = penalty.sum() / (n_tok.sum().clamp(min=1) if norm_n is None else norm_n)

    with torch.no_grad():
        stats = {
            "llds_raw": float(loss),
            "n_penalized_tokens": float(t.penalized.sum()),
            "n_gated_actions": float(t.act_open.sum()),
            "n_gated_responses": float(t.resp_open.sum()),
            "n_preserved": float(pre_resp.sum()),
            "beta": 1.0 if t.beta is None else float(t.beta),
        }
    return loss, stats
