"""Which logged W&B keys become which `steps` signal, and which mode a run was trained in.

The importer keeps *every* scalar key of a run, unchanged, in the `metrics` table (long form). On top of
that, a key whose meaning matches one of our step signals (`schema.STEP_SIGNALS`) is copied into `steps`
so imported runs plot on the same axes as local runs and the detector reads them the same way.

Only keys whose meaning matches ours are mapped (see docs/integrations.md for the table with reasons).
Notable keys that are deliberately NOT mapped (they stay in `metrics` under their own name):
- `actor/pos_avg_old_log_prob` / `actor/neg_avg_old_log_prob` (Search-R1): sums over A>=0 (A<0) tokens
  divided by *all* model tokens of the micro-batch, so they are diluted proxies, not our per-token
  log-likelihood of correct / incorrect responses;
- `actor/ppo_kl`: signed mean of (logp_old - logp_new) over *all* model tokens, not only preserved
  (A >= 0) responses, so it is not `delta_preserved_mean`;
- `actor/mean_reduce_chunk`: a *count* of displaced actions per preserved response, not a fraction;
- TRL `loss`: the total loss (policy + KL + entropy terms), not the policy-gradient loss.

Sources of the names: verl / Search-R1 `dp_actor.py`, `metric_utils.py` (research/paper.md section 5), TRL
1.16 `GRPOTrainer._compute_loss` / `_generate_and_score_completions` and `transformers.Trainer.log`
(anchors.md section 1.2; the W&B callback prefixes them with ``train/``), and our own exporter
(``lld/<signal>``, see wandb_export.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lld_monitor.store.schema import MODES, STEP_SIGNALS

Row = Mapping[str, Any]


@dataclass(frozen=True)
class KeyMap:
    signal: str  # a name in STEP_SIGNALS
    key: str  # the logged key
    family: str  # "verl" | "search-r1" | "trl" | "lld-monitor"
    note: str = ""
    when: Callable[[Row], bool] | None = None  # row predicate: map only if it holds


def _answer_span_found(row: Row) -> bool:
    v = row.get("actor/is_answer_mask")
    return isinstance(v, (int, float)) and v > 0


# Candidate keys per signal, first match wins. Keep in sync with docs/integrations.md.
KEY_MAP: tuple[KeyMap, ...] = (
    # --- our own exporter (round trip of lld-monitor runs logged to W&B)
    *(KeyMap(s, f"lld/{s}", "lld-monitor") for s in STEP_SIGNALS),
    # --- verl / Search-R1
    KeyMap("reward_mean", "critic/score/mean", "verl", "sequence reward mean over the step's rollouts"),
    KeyMap("entropy", "actor/entropy_loss", "search-r1", "token entropy over model tokens (Search-R1 name)"),
    KeyMap("entropy", "actor/entropy", "verl", "token entropy over model tokens (current verl name)"),
    KeyMap("grad_norm", "actor/grad_norm", "verl", "pre-clip total grad norm, mean over mini-batch updates"),
    KeyMap("clip_frac", "actor/pg_clipfrac", "verl", "fraction of model tokens with an active PPO clip"),
    KeyMap("kl", "actor/kl_loss", "verl", "low_var_kl (k3) to the reference, token mean"),
    KeyMap("pg_loss", "actor/pg_loss", "verl", "clipped surrogate, token mean"),
    KeyMap("llds_loss", "actor/loss_noreduce", "search-r1", "LLDS penalty with lambda folded in (0 when lambda=0)"),
    KeyMap("lr", "actor/lr", "verl"),
    KeyMap("response_length", "response_length/mean", "verl",
           "tokens on the response side; in Search-R1 this INCLUDES retrieved observation tokens"),
    KeyMap("searches_per_response", "env/number_of_valid_search", "search-r1", "mean valid searches per trajectory"),
    KeyMap("answer_prob_mean", "actor/lowest_prob_avg_mean", "search-r1",
           "mean probability of answer-span tokens; only when a span was found (actor/is_answer_mask > 0)",
           when=_answer_span_found),
    KeyMap("step_time", "timing_s/step", "verl", "wall-clock seconds of the step"),
    # --- TRL GRPOTrainer (as logged through transformers' WandbCallback: "train/" prefix), then bare names
    *(
        KeyMap(sig, f"{prefix}{key}", "trl", note)
        for prefix in ("train/", "")
        for sig, key, note in (
            ("reward_mean", "reward", "mean reward of the step's completions"),
            ("reward_std", "reward_std", "std of all rewards of the step"),
            ("entropy", "entropy", "token-masked mean entropy over completions"),
            ("grad_norm", "grad_norm", "pre-clip total grad norm (transformers.Trainer)"),
            ("clip_frac", "clip_ratio/region_mean", "fraction of tokens clipped (low or high region)"),
            ("kl", "kl", "k3 KL to the reference (only when beta != 0)"),
            ("pg_loss", "policy_loss", "policy loss before the entropy bonus (only with entropy regularization)"),
            ("response_length", "completions/mean_length", "mean completion length in tokens"),
            ("lr", "learning_rate", "learning rate"),
            ("step_time", "step_time", "seconds per optimizer step"),
        )
    ),
)

# keys that carry the step axis rather than a value
TRL_STEP_KEY = "train/global_step"
LLD_STEP_KEY = "lld/step"  # written by wandb_export.WandbExporter
SKIP_KEYS = frozenset({"_step"})


_BY_KEY: dict[str, list[KeyMap]] = {}
for _km in KEY_MAP:
    _BY_KEY.setdefault(_km.key, []).append(_km)
_ORDER = {id(km): i for i, km in enumerate(KEY_MAP)}


@lru_cache(maxsize=1024)
def _plan(keys: frozenset[str]) -> tuple[KeyMap, ...]:
    """The candidate mappings whose key is among `keys`, in priority order (rows of a run share key sets)."""
    cands = [km for k in keys for km in _BY_KEY.get(k, ())]
    return tuple(sorted(cands, key=lambda km: _ORDER[id(km)]))


def map_row(row: Row) -> dict[str, float]:
    """Step signals found in one history row (first matching candidate key per signal)."""
    out: dict[str, float] = {}
    for km in _plan(frozenset(row.keys())):
        if km.signal in out:
            continue
        v = row.get(km.key)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if km.when is not None and not km.when(row):
            continue
        out[km.signal] = float(v)
    return out


def mapped_keys(keys: set[str] | list[str]) -> dict[str, str]:
    """signal -> the key that would feed it, for a set of logged keys (first candidate present)."""
    present = set(keys)
    out: dict[str, str] = {}
    for km in KEY_MAP:
        if km.signal not in out and km.key in present:
            out[km.signal] = km.key
    return out


def detect_family(keys: set[str] | list[str]) -> str:
    """'search-r1', 'verl', 'trl', 'lld-monitor' or 'unknown' from the keys a run logged."""
    ks = set(keys)
    if any(k.startswith("lld/") for k in ks):
        return "lld-monitor"
    if "actor/loss_noreduce" in ks or "env/number_of_valid_search" in ks or "actor/entropy_loss" in ks:
        return "search-r1"
    if any(k.startswith(("actor/", "critic/")) for k in ks):
        return "verl"
    if TRL_STEP_KEY in ks or "train/reward" in ks or "reward" in ks:
        return "trl"
    return "unknown"


# ---------------------------------------------------------------------------------------------- mode


def _walk(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a nested config into 'a.b.c' -> value (leaf values only)."""
    out: dict[str, Any] = {}
    if isinstance(config, Mapping):
        # W&B's own config format {"key": {"value": v, "desc": ...}} (online API, config.yaml)
        if set(config.keys()) <= {"value", "desc"} and "value" in config:
            return _walk(config["value"], prefix)
        for k, v in config.items():
            out.update(_walk(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = config
    return out


def _find(flat: dict[str, Any], name: str) -> Any:
    """Value of the first key whose last component is `name` (shortest path first)."""
    for key in sorted(flat, key=lambda k: (k.count("."), k)):
        if key.rsplit(".", 1)[-1] == name:
            return flat[key]
    return None


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ModeInference:
    mode: str  # one of MODES
    reason: str


def infer_mode(config: Mapping[str, Any] | None, keys: set[str] | list[str] = ()) -> ModeInference:
    """Guess a run's training mode from its config (and, failing that, its logged keys).

    Rules, first that applies:
    1. our own config (`mode` in MODES, written by RunLogger / the exporter) is taken as is;
    2. Search-R1 LLDS code: `no_reduce_lambda > 0` -> llds, and additionally `mask_answer` true -> llds_ma;
       `no_reduce_lambda == 0` -> vanilla (the LLDS term is off whatever mask_answer says: the answer
       coefficient is min(mask_weight, lambda) = 0);
    3. our LLDS config names (`llds_lambda` / `lam` > 0, `answer_weight` set or `adaptive_beta`) likewise;
    4. a GRPO config without any LLDS key (verl `adv_estimator`, TRL `num_generations`) -> vanilla;
    5. otherwise unknown. The importer's `--mode` overrides all of this.
    """
    flat = _walk(dict(config or {}))
    own = _find(flat, "mode")
    if isinstance(own, str) and own in MODES and own != "unknown" and (
        "mode" in flat or "lld_monitor.mode" in flat
    ):
        return ModeInference(own, f"config mode={own!r}")
    lam = _num(_find(flat, "no_reduce_lambda"))
    if lam is not None:
        if lam > 0:
            if _truthy(_find(flat, "mask_answer")):
                return ModeInference("llds_ma", f"no_reduce_lambda={lam:g} > 0 and mask_answer is on")
            return ModeInference("llds", f"no_reduce_lambda={lam:g} > 0")
        return ModeInference("vanilla", f"no_reduce_lambda={lam:g} (LLDS off)")
    lam = _num(_find(flat, "llds_lambda"))
    if lam is None and _find(flat, "gate") is not None:
        lam = _num(_find(flat, "lam"))
    if lam is not None:
        if lam > 0:
            aw = _find(flat, "answer_weight")
            if aw is not None or _find(flat, "adaptive_beta") not in (None, "", "none", "None"):
                return ModeInference("llds_ma", f"LLDS lambda={lam:g} with an answer weight")
            return ModeInference("llds", f"LLDS lambda={lam:g} > 0")
        return ModeInference("vanilla", f"LLDS lambda={lam:g} (off)")
    if _find(flat, "adv_estimator") is not None or _find(flat, "num_generations") is not None:
        return ModeInference("vanilla", "GRPO config without LLDS keys")
    fam = detect_family(keys)
    if fam in ("verl", "trl"):
        return ModeInference("vanilla", f"{fam} metrics without LLDS keys in the config")
    return ModeInference("unknown", "no LLDS or GRPO keys in the config")


__all__ = [
    "KeyMap",
    "KEY_MAP",
    "TRL_STEP_KEY",
    "LLD_STEP_KEY",
    "map_row",
    "mapped_keys",
    "detect_family",
    "infer_mode",
    "ModeInference",
]
