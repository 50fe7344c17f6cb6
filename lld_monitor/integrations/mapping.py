"""Which logged W&B keys become which `steps` signal, and which mode a run was trained in.

The importer keeps *every* scalar key of a run, unchanged, in the `metrics` table (long form). On top of
that, a key that carries exactly one of our step signals is copied into `steps`, so imported runs plot
on the same axes as local runs and the detector reads them the same way. Which keys those are is the
registry's business (`lld_monitor.signals`, table in docs/signals.md): only keys marked *exact* are
mapped; *proxy* keys (e.g. `actor/pos_avg_old_log_prob`, TRL's total `loss`) stay in `metrics` under
their own names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lld_monitor import signals as registry
from lld_monitor.store.schema import MODES

Row = Mapping[str, Any]

# (signal, source) in priority order per signal: `lld/<signal>` first, then the frameworks' exact keys
KEY_MAP: tuple[tuple[str, registry.Source], ...] = tuple(
    (name, src) for name in registry.STEP_SIGNALS for src in registry.import_sources(name)
)

# keys that carry the step axis rather than a value
TRL_STEP_KEY = "train/global_step"
LLD_STEP_KEY = "lld/step"  # written by wandb_export.WandbExporter
SKIP_KEYS = frozenset({"_step"})


@lru_cache(maxsize=1024)
def _plan(keys: frozenset[str]) -> tuple[tuple[str, registry.Source], ...]:
    """The mappings whose keys are all among `keys`, in priority order (rows of a run share key sets)."""
    return tuple((name, src) for name, src in KEY_MAP if all(k in keys for k in src.parts))


def map_row(row: Row) -> dict[str, float]:
    """Step signals found in one history row (first source with a number per signal; NaN is a number)."""
    out: dict[str, float] = {}
    for name, src in _plan(frozenset(row.keys())):
        if name in out:
            continue
        v = src.read(row)
        if v is not None:
            out[name] = v
    return out


def mapped_keys(keys: set[str] | list[str]) -> dict[str, str]:
    """signal -> the key that would feed it, for a set of logged keys (first candidate present)."""
    out: dict[str, str] = {}
    for name, src in _plan(frozenset(keys)):
        out.setdefault(name, src.key)
    return out


def detect_family(keys: set[str] | list[str]) -> str:
    """'search-r1', 'verl', 'trl', 'lld-monitor' or 'unknown' from the keys a run logged."""
    ks = set(keys)
    if any(k.startswith(registry.EXPORT_PREFIX) for k in ks):
        return "lld-monitor"
    # Search-R1's own names; `actor/entropy_loss` is not one (current verl's new engine logs it too)
    if "actor/loss_noreduce" in ks or any(k.startswith("env/") for k in ks):
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
    "KEY_MAP",
    "TRL_STEP_KEY",
    "LLD_STEP_KEY",
    "map_row",
    "mapped_keys",
    "detect_family",
    "infer_mode",
    "ModeInference",
]
