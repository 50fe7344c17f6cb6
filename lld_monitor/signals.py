"""The step-signal registry: every step signal once, with everything any part of lld-monitor says about it.

A row (`Signal`) gives the store column, its unit, label and colour, whether higher is better, the
detector signal it feeds (and at which rank), and the keys other frameworks log for it (`Source`),
each marked *exact* (the same number) or *proxy* (related, but not the same number).

Who derives what from here:
- the store's `schema.STEP_SIGNALS` are the rows with ``stored=True``, in this order;
- the W&B importer (`map_row` below, used by `integrations.wandb`) copies into `steps` only *exact* external keys
  (`import_sources`): a stored column always means exactly what its row says;
- the detector (`detect.signal_sources`) and the dashboard (`ui.series`) rank candidates with the same
  function (`candidates`): the column itself, then its exact keys, then its proxies. The dashboard
  draws exact keys only under a canonical name; a proxy stays visible under its own key.

Adding a framework = adding `Source` rows (and its name to `FRAMEWORKS`); docs/signals.md is generated
from this table (`python -m lld_monitor.signals > docs/signals.md`, pinned by a test).
Torch-free and pandas-free: the dashboard imports it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

OURS = "ours"
EXPORT_PREFIX = "lld/"
# "ours" = the store column itself; "lld-monitor" = our W&B exporter / verl helper (`lld/<column>`)
FRAMEWORKS: tuple[str, ...] = (OURS, "lld-monitor", "verl", "search-r1", "trl")
DETECTOR_SIGNALS: tuple[str, ...] = (
    "reward", "ll_correct", "displacement", "frac_displaced", "entropy", "grad_norm", "clip_frac", "ppo_kl",
)


def as_number(v: object) -> float | None:
    """A real number as float; None for missing, bool, str and anything else (NaN and inf are numbers)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    return float(v)


@dataclass(frozen=True)
class Source:
    """A logged key that carries a signal. `key` is one key, or two joined by " / " or " + " (derived)."""

    key: str
    framework: str
    exact: bool
    note: str = ""
    only_if_positive: str | None = None  # count this key only in rows where that key is > 0

    @property
    def parts(self) -> tuple[str, ...]:
        for op in (" / ", " + "):
            if op in self.key:
                return tuple(self.key.split(op))
        return (self.key,)

    def read(self, row: Mapping[str, object]) -> float | None:
        """This source's value in one row (a dict of key -> value), or None when it has none."""
        if self.only_if_positive is not None:
            gate = as_number(row.get(self.only_if_positive))
            if gate is None or not gate > 0:
                return None
        vals = [as_number(row.get(k)) for k in self.parts]
        if any(v is None for v in vals):
            return None
        if len(vals) == 1:
            return vals[0]
        a, b = vals
        if " / " in self.key:
            if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:  # type: ignore[arg-type]
                return None
            return a / b  # type: ignore[operator]
        return a + b  # type: ignore[operator]


@dataclass(frozen=True)
class Signal:
    name: str  # the store column (when stored) and the name everywhere in lld-monitor
    label: str
    unit: str
    colour: str
    higher_is_better: bool | None  # None: neither direction is good in itself
    meaning: str
    sources: tuple[Source, ...] = ()  # external keys, exact ones first
    detector: str | None = None  # the detector signal this column feeds (DETECTOR_SIGNALS)
    detector_rank: int = 0  # 0 = the detector's first choice among the columns feeding that signal
    stored: bool = True  # a column of the store's `steps` table


def _v(key: str, note: str = "", exact: bool = True, **kw) -> Source:
    return Source(key, "verl", exact, note, **kw)


def _s(key: str, note: str = "", exact: bool = True, **kw) -> Source:
    return Source(key, "search-r1", exact, note, **kw)


def _t(key: str, note: str = "", exact: bool = True) -> tuple[Source, ...]:
    """A TRL key, as logged through transformers' WandbCallback (`train/`) and bare."""
    return Source(f"train/{key}", "trl", exact, note), Source(key, "trl", exact, note)


SIGNALS: tuple[Signal, ...] = (
    Signal("reward_mean", "reward (mean)", "reward", "#1f77b4", True,
           "mean sequence reward over the step's rollouts",
           (_v("critic/score/mean", "sequence reward mean over the step's rollouts"),
            *_t("reward", "mean reward of the step's completions"),
            _v("critic/rewards/mean", "score minus the in-reward KL penalty (equal when use_kl_in_reward is off)",
               exact=False),
            Source("rewards/mean", "trl", False, "one reward function's mean (TRL logs rewards/<func>/mean)")),
           detector="reward"),
    Signal("reward_std", "reward (std)", "reward", "#aec7e8", None,
           "population std (n) of the step's rewards",
           _t("reward_std", "std of all rewards with n - 1 (ours: n)", exact=False)),
    Signal("accuracy", "accuracy", "fraction", "#17becf", True,
           "fraction of rollouts with reward > 0 (training rollouts; a validation score is not this)",
           detector="reward", detector_rank=1),
    Signal("ll_correct_sum", "ll correct (sum)", "nats", "#2ca02c", True,
           "mean over correct responses (>= 1 action token) of the summed action-token ln pi_old",
           detector="ll_correct", detector_rank=1),
    Signal("ll_correct_mean", "ll correct", "nats/token", "#2ca02c", True,
           "the same per action token (length-normalized)",
           (_s("actor/pos_avg_old_log_prob",
               "sum of ln pi_old over A >= 0 tokens / all model tokens of the micro-batch: diluted, and "
               "A >= 0 is not 'correct'", exact=False),),
           detector="ll_correct"),
    Signal("ll_incorrect_sum", "ll incorrect (sum)", "nats", "#d62728", None,
           "mean over incorrect responses (>= 1 action token) of the summed action-token ln pi_old"),
    Signal("ll_incorrect_mean", "ll incorrect", "nats/token", "#d62728", None,
           "the same per action token",
           (_s("actor/neg_avg_old_log_prob", "sum over A < 0 tokens / all model tokens: diluted", exact=False),)),
    Signal("delta_preserved", "Δ preserved (sum)", "nats", "#9467bd", True,
           "mean over preserved responses (A >= 0, >= 1 action token) of the summed Δ = ln pi_after - ln pi_before",
           detector="displacement", detector_rank=1),
    Signal("delta_preserved_mean", "Δ preserved (per token)", "nats/token", "#9467bd", True,
           "the same per action token",
           detector="displacement"),
    Signal("frac_actions_displaced", "frac actions displaced", "fraction", "#8c564b", False,
           "fraction of the preserved responses' actions whose summed Δ < 0",
           (_s("actor/mean_reduce_chunk / env/number_of_actions/mean",
               "displaced actions per preserved response / actions per response (all responses)", exact=False),),
           detector="frac_displaced"),
    Signal("frac_responses_displaced", "frac responses displaced", "fraction", "#c49c94", False,
           "fraction of preserved responses whose summed Δ < 0",
           detector="frac_displaced", detector_rank=1),
    Signal("entropy", "entropy", "nats", "#e377c2", None,
           "mean token entropy over action tokens (rollout policy)",
           (_s("actor/entropy_loss", "token entropy over model tokens (Search-R1 name)"),
            _v("actor/entropy", "token entropy over model tokens (current verl name)"),
            *_t("entropy", "token-masked mean entropy over completions")),
           detector="entropy"),
    Signal("grad_norm", "grad norm", "norm", "#7f7f7f", None,
           "pre-clip total grad norm, mean over the step's optimizer updates",
           (_v("actor/grad_norm", "pre-clip total grad norm, mean over mini-batch updates"),
            *_t("grad_norm", "pre-clip total grad norm (transformers.Trainer)")),
           detector="grad_norm"),
    Signal("clip_frac", "clip fraction", "fraction", "#bcbd22", None,
           "fraction of action tokens whose PPO clip was active",
           (_v("actor/pg_clipfrac", "fraction of model tokens with an active PPO clip"),
            *_t("clip_ratio/region_mean", "fraction of tokens clipped (low or high region)"),
            Source("clip_ratio/low_mean + clip_ratio/high_mean", "trl", True,
                   "the two regions are disjoint (A < 0 low, A > 0 high), so their sum is the region mean"),
            *_t("clip_ratio", "older TRL name; its definition changed between versions", exact=False)),
           detector="clip_frac"),
    Signal("kl", "KL to reference", "nats", "#ff7f0e", None,
           "k3 KL to the reference, token mean",
           (_v("actor/kl_loss", "low_var_kl (k3) to the reference, token mean"),
            *_t("kl", "k3 KL to the reference (only when beta != 0)"))),
    Signal("pg_loss", "policy loss", "loss", "#98df8a", None,
           "clipped surrogate (policy-gradient) loss",
           (_v("actor/pg_loss", "clipped surrogate, token mean"),
            *_t("policy_loss", "policy loss before the entropy bonus (only with entropy regularization)"),
            *_t("loss", "the total loss: policy + beta * KL (+ entropy terms)", exact=False))),
    Signal("llds_loss", "LLDS loss", "loss", "#ff9896", None,
           "λ · L_LLDS (0 for vanilla runs)",
           (_s("actor/loss_noreduce", "LLDS penalty with lambda folded in (0 when lambda = 0)"),)),
    Signal("response_length", "response length", "tokens", "#c5b0d5", None,
           "mean action tokens per response (tool tokens excluded)",
           (_v("response_length/mean", "response-side tokens; in Search-R1 this includes retrieved observations",
               exact=False),
            *_t("completions/mean_length", "completion tokens; includes tool output when TRL runs tools",
                exact=False),
            Source("completion_length", "trl", False, "older TRL name of completions/mean_length"))),
    Signal("searches_per_response", "searches / response", "count", "#f7b6d2", None,
           "mean valid searches per response",
           (_s("env/number_of_valid_search", "mean valid searches per trajectory"),
            _v("tool_call_counts/mean", "tool calls per trajectory, every tool (not only valid searches)", exact=False),
            *_t("tools/call_frequency", "tool calls per completion, every tool, invalid calls included", exact=False))),
    Signal("answer_prob_mean", "answer probability", "probability", "#dbdb8d", True,
           "mean probability of answer-span tokens",
           (_s("actor/lowest_prob_avg_mean", "mean probability of answer-span tokens; only when a span was found",
               only_if_positive="actor/is_answer_mask"),)),
    Signal("lr", "learning rate", "lr", "#9edae5", None, "learning rate of the step",
           (_v("actor/lr"), *_t("learning_rate", "learning rate"))),
    Signal("step_time", "step time", "s", "#c7c7c7", False, "seconds for the whole step",
           (_v("timing_s/step", "wall-clock seconds of the step"),
            _v("perf/time_per_step", "verl's perf/ copy of timing_s/step"),
            *_t("step_time", "seconds per optimizer step"))),
    Signal("ppo_kl", "PPO KL (verl)", "nats/token", "#393b79", None,
           "verl's signed mean of ln pi_old - ln pi_theta over all model tokens (positive = likelihood fell)",
           (_v("actor/ppo_kl", "within-step likelihood change over all model tokens, not only preserved ones"),),
           detector="ppo_kl", stored=False),
)

BY_NAME: dict[str, Signal] = {s.name: s for s in SIGNALS}
STEP_SIGNALS: tuple[str, ...] = tuple(s.name for s in SIGNALS if s.stored)


def own_sources(sig: Signal) -> tuple[Source, ...]:
    """The column itself and our exporter's `lld/<column>` (stored signals only)."""
    if not sig.stored:
        return ()
    return (Source(sig.name, OURS, True, "the store column"),
            Source(f"{EXPORT_PREFIX}{sig.name}", "lld-monitor", True, "our W&B exporter / verl helper"))


def _exact_first_unique(srcs: list[Source]) -> tuple[Source, ...]:
    seen: set[str] = set()
    out: list[Source] = []
    for src in [s for s in srcs if s.exact] + [s for s in srcs if not s.exact]:
        if src.key not in seen:  # TRL's bare `entropy`, `kl`, ... are our column names
            seen.add(src.key)
            out.append(src)
    return tuple(out)


def all_sources(name: str) -> tuple[Source, ...]:
    sig = BY_NAME[name]
    return own_sources(sig) + sig.sources


def candidates(name: str, *, proxies: bool = True) -> tuple[Source, ...]:
    """What the dashboard and the detector read for `name`, best first: the column, then exact
    external keys, then (with `proxies`) proxy keys. The `lld/` export keys are the importer's business."""
    srcs = [s for s in all_sources(name) if s.framework != "lld-monitor" and (proxies or s.exact)]
    return _exact_first_unique(srcs)


def import_sources(name: str) -> tuple[Source, ...]:
    """The W&B keys the importer copies into the `steps` column `name`: exact external keys only
    (`lld/` first: our own exporter's figure wins)."""
    return tuple(s for s in all_sources(name) if s.exact and s.framework != OURS)


def detector_columns(signal: str) -> tuple[str, ...]:
    """The registry rows feeding detector signal `signal`, best first."""
    rows = sorted((s for s in SIGNALS if s.detector == signal), key=lambda s: s.detector_rank)
    return tuple(s.name for s in rows)


def detector_candidates(signal: str) -> tuple[Source, ...]:
    """The detector's ranked sources for `signal`: the feeding columns' `candidates` in column rank,
    every exact key before any proxy (a proxy is read only when no exact key is present)."""
    return _exact_first_unique([src for col in detector_columns(signal) for src in candidates(col)])


def label(name: str) -> str:
    sig = BY_NAME.get(name)
    return sig.label if sig is not None else name


def markdown_table() -> str:
    """docs/signals.md: the registry as tables (generated; tests/test_signals.py pins the file)."""
    lines = [
        "# Step signals",
        "",
        "Generated from `lld_monitor/signals.py` by `python -m lld_monitor.signals > docs/signals.md`;",
        "a test fails when this file and the registry differ. Edit the registry, not this file.",
        "",
        "Every signal once: its store column, unit, whether higher is better, the detector signal it feeds",
        "(rank 0 = first choice), and the keys other frameworks log for it. *exact* keys carry the same",
        "number and are copied into `steps` by the W&B importer; *proxy* keys are related but not the same",
        "number: they stay in `metrics` under their own name, the detector may fall back on them (after every",
        "exact key; the alert names the key), and the dashboard shows them under their own key only.",
        "Every stored column is also exported and imported as `lld/<column>` (exact).",
        "",
        "| column | label | unit | higher is better | detector (rank) | meaning |",
        "|---|---|---|---|---|---|",
    ]
    hib = {True: "yes", False: "no", None: "-"}
    for s in SIGNALS:
        det = f"{s.detector} ({s.detector_rank})" if s.detector else ""
        col = f"`{s.name}`" + ("" if s.stored else " (not stored)")
        lines.append(f"| {col} | {s.label} | {s.unit} | {hib[s.higher_is_better]} | {det} | {s.meaning} |")
    lines += ["", "## External keys", "", "| column | key | framework | exact / proxy | note |", "|---|---|---|---|---|"]
    for s in SIGNALS:
        for src in s.sources:
            note = src.note + (f" (only where `{src.only_if_positive}` > 0)" if src.only_if_positive else "")
            kind = "exact" if src.exact else "**proxy**"
            lines.append(f"| `{s.name}` | `{src.key}` | {src.framework} | {kind} | {note} |")
    lines += [
        "",
        "## Adding a framework",
        "",
        "1. Add its name to `FRAMEWORKS` in `lld_monitor/signals.py`.",
        "2. For each signal it logs, add a `Source(key, framework, exact, note)` to that signal's `sources`",
        "   (exact keys before proxies; `a / b` or `a + b` for a key derived from two).",
        "3. If its runs can be recognised from their keys, teach `integrations.wandb.run_profile.detect_family`.",
        "4. Regenerate this page: `python -m lld_monitor.signals > docs/signals.md`.",
        "",
        "The importer, the detector's candidates and the dashboard's series all follow from these rows.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- keys of other frameworks
# (signal, source) in priority order per signal: `lld/<signal>` first, then the frameworks' exact keys
KEY_MAP: tuple[tuple[str, Source], ...] = tuple(
    (name, src) for name in STEP_SIGNALS for src in import_sources(name)
)

# keys that carry the step axis rather than a value
TRL_STEP_KEY = "train/global_step"
LLD_STEP_KEY = "lld/step"  # written by integrations.wandb.export.WandbExporter
SKIP_KEYS = frozenset({"_step"})


@lru_cache(maxsize=1024)
def _plan(keys: frozenset[str]) -> tuple[tuple[str, Source], ...]:
    """The mappings whose keys are all among `keys`, in priority order (rows of a run share key sets)."""
    return tuple((name, src) for name, src in KEY_MAP if all(k in keys for k in src.parts))


def map_row(row: Mapping[str, object]) -> dict[str, float]:
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


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_table())
