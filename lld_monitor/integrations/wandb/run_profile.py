"""What the W&B importer knows of a run before it writes a row: one typed record, read once.

`RunProfile.read(config, keys, mode)` looks at a run's config and the keys of its first history rows and
decides everything the import needs from them:
- **mode** (vanilla | llds | llds_ma | unknown) and why (`infer_mode`; `--mode` overrides it);
- **framework** ('search-r1', 'verl', 'trl', 'lld-monitor' or 'unknown', from the keys: `detect_family`);
- **the step axis**: `lld/step` (our exporter), `train/global_step` (transformers' WandbCallback) or `_step`;
- **the fixes** its mapped signals need beyond the plain key mapping (`signals.map_row`):
  - *verl loss scale.* Current verl's actor (`dp_actor.update_policy`) accumulates
    ``metrics["actor/pg_loss"] += pg_loss * loss_scale_factor`` (and ``actor/kl_loss`` likewise) over the
    micro-batches of a mini-batch *and* over every mini-batch and PPO epoch of the step, so the logged value is
    the mini-batch mean summed over ``ppo_epochs × train_batch_size / ppo_mini_batch_size`` updates. When the
    run's config gives that count, the `pg_loss` / `kl` step signals are divided by it (the raw values stay in
    `metrics` under their own keys); when it does not, the import says so. Search-R1's fork (an older verl)
    averages with ``append_to_dict`` and is left as is.
  - *no fake zero KL.* That verl initialises ``actor/kl_loss = 0.0`` and logs it even with
    ``use_kl_loss=False``: the `kl` signal is then left empty, not 0.
  - *verl bypass mode* (``algorithm.rollout_correction.bypass_mode``): ``old_log_probs = rollout_log_probs``,
    so a displacement or ``actor/ppo_kl`` measures the rollout-engine / trainer mismatch, not LLD. Reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lld_monitor.signals import EXPORT_PREFIX, LLD_STEP_KEY, TRL_STEP_KEY
from lld_monitor.store.schema import MODES

SignalFix = Callable[[dict[str, float]], None]

VERL_UPDATE_KEYS = (
    "actor_rollout_ref.actor.ppo_epochs",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
)


@dataclass(frozen=True)
class RunProfile:
    """Everything the import decides from a run's config and first keys (see the module docstring)."""

    mode: str  # one of MODES
    mode_reason: str
    framework: str
    step_key: str
    fix: SignalFix | None = None  # applied to each row's mapped signals
    notes: list[str] = field(default_factory=list)  # for the import report
    fixes_done: dict[str, Any] = field(default_factory=dict)  # kept in config._lld_monitor_import

    @classmethod
    def read(cls, config: Mapping[str, Any] | None, keys: Iterable[str], mode: str | None = None) -> "RunProfile":
        """The profile of a run with this config whose first history rows have these keys; `mode` (set by
        hand) overrides the inferred one."""
        keys = set(keys)
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        inferred, reason = infer_mode(config, keys)
        step_key = next((axis for axis in (LLD_STEP_KEY, TRL_STEP_KEY) if axis in keys), "_step")
        fix, notes, done = signal_fix(config or {}, keys)
        return cls(mode or inferred, "set by hand" if mode else reason, detect_family(keys), step_key, fix, notes, done)


def detect_family(keys: set[str] | list[str]) -> str:
    """'search-r1', 'verl', 'trl', 'lld-monitor' or 'unknown' from the keys a run logged."""
    ks = set(keys)
    if any(k.startswith(EXPORT_PREFIX) for k in ks):
        return "lld-monitor"
    # Search-R1's own names; `actor/entropy_loss` is not one (current verl's new engine logs it too)
    if "actor/loss_noreduce" in ks or any(k.startswith("env/") for k in ks):
        return "search-r1"
    if any(k.startswith(("actor/", "critic/")) for k in ks):
        return "verl"
    if TRL_STEP_KEY in ks or "train/reward" in ks or "reward" in ks:
        return "trl"
    return "unknown"



# ---------------------------------------------------------------------------------------------- config
def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a nested config into 'a.b.c' -> value (leaf values only)."""
    out: dict[str, Any] = {}
    if isinstance(config, Mapping):
        # W&B's own config format {"key": {"value": v, "desc": ...}} (online API, config.yaml)
        if set(config.keys()) <= {"value", "desc"} and "value" in config:
            return flatten_config(config["value"], prefix)
        for k, v in config.items():
            out.update(flatten_config(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = config
    return out


def find_in_config(flat: dict[str, Any], name: str) -> Any:
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


def infer_mode(config: Mapping[str, Any] | None, keys: set[str] | list[str] = ()) -> tuple[str, str]:
    """(mode, reason): a run's training mode guessed from its config (and, failing that, its logged keys).

    Rules, first that applies:
    1. our own config (`mode` in MODES, written by RunLogger / the exporter) is taken as is;
    2. Search-R1 LLDS code: `no_reduce_lambda > 0` -> llds, and additionally `mask_answer` true -> llds_ma;
       `no_reduce_lambda == 0` -> vanilla (the LLDS term is off whatever mask_answer says: the answer
       coefficient is min(mask_weight, lambda) = 0);
    3. our LLDS config names (`llds_lambda` / `lam` > 0, `answer_weight` set or `adaptive_beta`) likewise;
    4. a GRPO config without any LLDS key (verl `adv_estimator`, TRL `num_generations`) -> vanilla;
    5. otherwise unknown. The importer's `--mode` overrides all of this.
    """
    flat = flatten_config(dict(config or {}))
    own = find_in_config(flat, "mode")
    if isinstance(own, str) and own in MODES and own != "unknown" and (
        "mode" in flat or "lld_monitor.mode" in flat
    ):
        return (own, f"config mode={own!r}")
    lam = _num(find_in_config(flat, "no_reduce_lambda"))
    if lam is not None:
        if lam > 0:
            if _truthy(find_in_config(flat, "mask_answer")):
                return ("llds_ma", f"no_reduce_lambda={lam:g} > 0 and mask_answer is on")
            return ("llds", f"no_reduce_lambda={lam:g} > 0")
        return ("vanilla", f"no_reduce_lambda={lam:g} (LLDS off)")
    lam = _num(find_in_config(flat, "llds_lambda"))
    if lam is None and find_in_config(flat, "gate") is not None:
        lam = _num(find_in_config(flat, "lam"))
    if lam is not None:
        if lam > 0:
            aw = find_in_config(flat, "answer_weight")
            if aw is not None or find_in_config(flat, "adaptive_beta") not in (None, "", "none", "None"):
                return ("llds_ma", f"LLDS lambda={lam:g} with an answer weight")
            return ("llds", f"LLDS lambda={lam:g} > 0")
        return ("vanilla", f"LLDS lambda={lam:g} (off)")
    if find_in_config(flat, "adv_estimator") is not None or find_in_config(flat, "num_generations") is not None:
        return ("vanilla", "GRPO config without LLDS keys")
    fam = detect_family(keys)
    if fam in ("verl", "trl"):
        return ("vanilla", f"{fam} metrics without LLDS keys in the config")
    return ("unknown", "no LLDS or GRPO keys in the config")


# ---------------------------------------------------------------------------------------------- fixes
def _is_search_r1(flat: Mapping[str, Any], keys: Iterable[str]) -> bool:
    ks = set(keys)
    return (
        "actor/loss_noreduce" in ks
        or any(k.startswith("env/") for k in ks)
        or find_in_config(dict(flat), "no_reduce_lambda") is not None
        or find_in_config(dict(flat), "state_masking") is not None
    )


def _int(v: Any) -> int | None:
    try:
        i = int(v)
    except (TypeError, ValueError):
        return None
    return i if i > 0 else None


def verl_updates_per_step(config: Mapping[str, Any]) -> int | None:
    """ppo_epochs × (train_batch_size / ppo_mini_batch_size) from a verl config, or None if a value is missing."""
    flat = flatten_config(dict(config))
    epochs, batch, mini = (_int(flat.get(k)) for k in VERL_UPDATE_KEYS)
    if epochs is None or batch is None or mini is None:
        return None
    return epochs * max(1, batch // mini)


def signal_fix(config: Mapping[str, Any], keys: Iterable[str]) -> tuple[SignalFix | None, list[str], dict[str, Any]]:
    """The correction of mapped step signals for a run, the notes for the import report, and what was done
    (kept in ``config._lld_monitor_import``)."""
    keys = set(keys)
    if not any(k in keys for k in ("actor/pg_loss", "actor/kl_loss")):
        return None, [], {}
    flat = flatten_config(dict(config))
    notes: list[str] = []
    done: dict[str, Any] = {}
    bypass = flat.get("algorithm.rollout_correction.bypass_mode")
    if _truthy(bypass) if bypass is not None else False:
        notes.append("verl bypass mode (old_log_probs = rollout_log_probs): actor/ppo_kl and any displacement "
                     "measure the rollout / trainer mismatch, not LLD")
        done["bypass_mode"] = True
    if _is_search_r1(flat, keys):
        return None, notes, done
    use_kl = flat.get("actor_rollout_ref.actor.use_kl_loss")
    drop_kl = use_kl is not None and not _truthy(use_kl)
    if drop_kl:
        notes.append("use_kl_loss is off: verl logs actor/kl_loss = 0.0 anyway; the kl signal is left empty")
        done["kl_dropped"] = "use_kl_loss=False"
    n = verl_updates_per_step(config)
    if n is None:
        missing = [k for k in VERL_UPDATE_KEYS if _int(flat.get(k)) is None]
        notes.append("actor/pg_loss and actor/kl_loss are mapped as logged: current verl sums them over the "
                     f"step's mini-batch updates, and the config lacks {missing} to count them")
        done["loss_scale"] = "unknown"
    elif n > 1:
        notes.append(f"actor/pg_loss and actor/kl_loss divided by {n} mini-batch updates per step "
                     "(verl sums them over updates; the raw values stay in metrics)")
        done["loss_scale"] = n

    def fix(sig: dict[str, float]) -> None:
        if drop_kl:
            sig.pop("kl", None)
        if n is not None and n > 1:
            for name in ("pg_loss", "kl"):
                if name in sig:
                    sig[name] = sig[name] / n

    return fix, notes, done
