"""Evaluate the early-warning detector on a labelled set of runs: lead time before the reward
collapse on collapsing runs, false warnings on the others, with all signals and with step scalars only.

    .venv/bin/python bench/detector_eval.py --store /work/experiments/spiral_store
    .venv/bin/python bench/detector_eval.py --synthetic 10        # synthetic trajectories (no store needed)

Labels (hindsight, using the whole run; the detector never sees them):
  collapse step    lld_monitor.detect.reward_collapse_step (the written definition: trailing mean of
                   10 reward points below 0.5 x its running peak for 5 consecutive points)
  phase II onset   the step at which the correct-response log-likelihood (ll_correct_mean, centred
                   rolling median of 15 steps) peaked before the collapse step: after it, it only declines
  phase II length  collapse step - phase II onset
  decline step     the same definition with 0.8 instead of 0.5 (the smoothed reward 20 % below its running
                   peak for 5 points): the first visible reward decline, reported for every run, also
                   for runs that decline without collapsing ("lead to decline" = decline - first warning)
Goal per collapsing run: first alert of severity >= warning at least 20 steps AND at least a quarter of
its phase II length before the collapse step. Goal per non-collapsing run: no alert >= warning.
"LLD warn" = the first alert >= warning raised by a non-reward signal (likelihood, displacement, entropy,
grad norm, ratios): the by-mode summary says whether that signature separates vanilla from LLDS runs.

Variants per run:
  full      every column of the run (our token-derived signals included)
  scalars   only what a verl / Search-R1 W&B run would have: the verl-named step metrics the backend
            logs (actor/*, critic/*, ...), without actor/mean_reduce_chunk (only the LLDS fork logs it)
            and without any lld-monitor column; derived from our columns when a run has no verl names
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from lld_monitor.detect import SIGNAL_CANDIDATES, DetectorConfig, detect_run, reward_collapse_step
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl

DEFAULT_STORE = "/work/experiments/spiral_store"
LEAD_MIN_STEPS = 20
LEAD_MIN_FRAC_PHASE2 = 0.25
# verl keys kept in the scalar-only variant; everything else is dropped
STRICT_VERL_EXCLUDE = {"actor/mean_reduce_chunk"}
DERIVE_VERL = {
    "reward_mean": "critic/score/mean",
    "entropy": "actor/entropy_loss",
    "grad_norm": "actor/grad_norm",
    "clip_frac": "actor/pg_clipfrac",
    "kl": "actor/kl_loss",
}


@dataclass
class Row:
    run: str
    mode: str
    variant: str
    steps: int
    collapse_step: int | None
    decline_step: int | None
    phase2_onset: int | None
    first_info: int | None
    first_warning: int | None
    first_critical: int | None
    warning_signal: str | None
    first_leading_warning: int | None  # first alert >= warning raised by a non-reward signal
    leading_signal: str | None
    lead: int | None
    lead_decline: int | None
    need: float | None
    goal_met: bool
    n_severe: int
    final_phase: str


def phase2_onset(sig: pd.DataFrame, collapse_step: int | None) -> int | None:
    """Hindsight label: the step the smoothed correct-response likelihood peaked before the collapse."""
    if collapse_step is None:
        return None
    col = next((c for c in ("ll_correct_mean", "actor/pos_avg_old_log_prob") if c in sig.columns), None)
    if col is None:
        return None
    s = sig[["step", col]].dropna()
    s = s[s.step <= collapse_step]
    if len(s) < 10:
        return None
    sm = s[col].rolling(15, center=True, min_periods=5).median()
    return int(s.step.iloc[int(np.nanargmax(sm.to_numpy()))])


def scalar_only(sig: pd.DataFrame, samples: pd.DataFrame | None = None) -> pd.DataFrame:
    verl = [c for c in sig.columns if "/" in c and c not in STRICT_VERL_EXCLUDE]
    if any(c.startswith(("actor/", "critic/")) for c in verl):
        return sig[["step"] + verl].copy()
    out = sig[["step"]].copy()
    for ours, theirs in DERIVE_VERL.items():
        if ours in sig.columns:
            out[theirs] = sig[ours]
    if samples is not None and len(samples) and {"logp_old_sum", "advantage", "n_action_tokens"} <= set(samples.columns):
        g = samples.assign(pos=np.where(samples.advantage >= 0, samples.logp_old_sum, 0.0)).groupby("step")
        pos = g["pos"].sum() / g["n_action_tokens"].sum()
        out = out.merge(pos.rename("actor/pos_avg_old_log_prob").reset_index(), on="step", how="left")
    return out


def decline_step(sig: pd.DataFrame, cfg: DetectorConfig) -> int | None:
    """First step of a 20 % reward decline: the collapse definition with collapse_frac = 0.8."""
    return reward_collapse_step(sig, replace(cfg, collapse_frac=0.8))


def evaluate(name: str, mode: str, variant: str, sig: pd.DataFrame, collapse: int | None, onset: int | None,
             cfg: DetectorConfig, decline: int | None = None) -> Row:
    res = detect_run(sig, cfg)

    def first(sev: tuple[str, ...]):
        hits = [a for a in res.alerts if a.severity in sev]
        return hits[0] if hits else None

    info, warn, crit = first(("info",)), first(("warning", "critical")), first(("critical",))
    reward_cols = {c.label for c in SIGNAL_CANDIDATES["reward"]}
    lw = [a for a in res.alerts if a.severity in ("warning", "critical") and a.signal not in reward_cols]
    lw0 = lw[0] if lw else None
    lead = need = None
    if collapse is not None:
        need = float(max(LEAD_MIN_STEPS, LEAD_MIN_FRAC_PHASE2 * (collapse - onset) if onset is not None else 0))
        lead = None if warn is None else int(collapse - warn.step)
        goal = lead is not None and lead >= need
    else:
        goal = warn is None
    return Row(
        run=name, mode=mode, variant=variant, steps=int(len(sig)), collapse_step=collapse, decline_step=decline,
        phase2_onset=onset,
        first_info=None if info is None else info.step, first_warning=None if warn is None else warn.step,
        first_critical=None if crit is None else crit.step, warning_signal=None if warn is None else warn.signal,
        first_leading_warning=None if lw0 is None else lw0.step, leading_signal=None if lw0 is None else lw0.signal,
        lead=lead, lead_decline=None if (warn is None or decline is None) else int(decline - warn.step),
        need=need, goal_met=bool(goal),
        n_severe=sum(a.severity in ("warning", "critical") for a in res.alerts), final_phase=res.phase,
    )


def load_store(path: str, only: list[str] | None, seen: set[str] | None = None):
    from lld_monitor.store import open_store_reader

    r = open_store_reader(path)
    try:
        runs = r.runs()
        for rec in runs.to_dict("records"):
            if only and rec["name"] not in only and rec["run_id"] not in only:
                continue
            if seen is not None:  # the same run copied into two stores is evaluated once
                if rec["run_id"] in seen:
                    continue
                seen.add(rec["run_id"])
            sig = r.signals(rec["run_id"])
            if sig.empty:
                continue
            has_verl = any(c.startswith("actor/") for c in sig.columns)
            samples = None if has_verl else r.samples(rec["run_id"])
            yield rec["name"], str(rec.get("mode")), sig, samples
    finally:
        r.close()


def load_synthetic(n: int):
    for seed in range(n):
        yield f"synthetic-spiral-s{seed}", "vanilla", spiral(SpiralSpec(seed=seed, noise=1.0 + 0.5 * (seed % 2))), None
        yield f"synthetic-healthy-s{seed}", "llds", healthy(seed=seed, noise=1.0 + 0.5 * (seed % 2)), None


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))


def print_table(rows: list[Row]) -> None:
    hdr = f"{'run':<28} {'mode':<8} {'variant':<8} {'steps':>5} {'collapse':>8} {'decline':>7} {'II-on':>5} " \
          f"{'1st info':>8} {'1st warn':>8} {'1st crit':>8} {'lead':>5} {'need':>5} {'goal':>4} {'lead-dec':>8} " \
          f"{'LLD warn':>8}  warned by"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r.run[:28]:<28} {r.mode[:8]:<8} {r.variant:<8} {r.steps:>5} {_fmt(r.collapse_step):>8} "
              f"{_fmt(r.decline_step):>7} {_fmt(r.phase2_onset):>5} {_fmt(r.first_info):>8} {_fmt(r.first_warning):>8} "
              f"{_fmt(r.first_critical):>8} {_fmt(r.lead):>5} {_fmt(r.need):>5} {'yes' if r.goal_met else 'NO':>4} "
              f"{_fmt(r.lead_decline):>8} {_fmt(r.first_leading_warning):>8}  {r.warning_signal or ''}"
              f"{'' if r.leading_signal in (None, r.warning_signal) else ' / LLD: ' + r.leading_signal}")


def summarize(rows: list[Row]) -> dict:
    out = {}
    for variant in sorted({r.variant for r in rows}):
        rs = [r for r in rows if r.variant == variant]
        col = [r for r in rs if r.collapse_step is not None]
        non = [r for r in rs if r.collapse_step is None]
        warned = [r for r in col if r.lead is not None and r.lead > 0]
        leads = [r.lead for r in col if r.lead is not None]
        out[variant] = {
            "collapsing_runs": len(col),
            "warned_before_collapse": len(warned),
            "recall": (len(warned) / len(col)) if col else None,
            "lead_goal_met": sum(r.goal_met for r in col),
            "lead_median": statistics.median(leads) if leads else None,
            "lead_min": min(leads) if leads else None,
            "non_collapsing_runs": len(non),
            "runs_with_false_warnings": sum(r.n_severe > 0 for r in non),
            "false_warning_alerts": sum(r.n_severe for r in non),
            # by mode: does the LLD signature (a warning from a non-reward signal) separate the arms?
            "vanilla_runs": sum(r.mode == "vanilla" for r in rs),
            "vanilla_with_lld_warning": sum(r.mode == "vanilla" and r.first_leading_warning is not None for r in rs),
            "regularized_runs": sum(r.mode in ("llds", "llds_ma") for r in rs),
            "regularized_with_lld_warning": sum(r.mode in ("llds", "llds_ma") and r.first_leading_warning is not None
                                                for r in rs),
            # runs whose reward declined by 20 % (with or without collapsing): warned before the decline?
            "declining_runs": sum(r.decline_step is not None for r in rs),
            "warned_before_decline": sum(r.lead_decline is not None and r.lead_decline > 0 for r in rs),
            "lead_decline_median": statistics.median(ld) if (ld := [r.lead_decline for r in rs
                                                                    if r.lead_decline is not None]) else None,
        }
    return out


def time_detector(frames: list[pd.DataFrame], cfg: DetectorConfig, reps: int = 5) -> float:
    """Median over `reps` replays of the longest run: microseconds per step."""
    df = max(frames, key=len)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        detect_run(df, cfg)
        ts.append((time.perf_counter() - t0) / max(len(df), 1) * 1e6)
    return float(statistics.median(ts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", action="append", help=f"run store(s) to evaluate (default {DEFAULT_STORE})")
    ap.add_argument("--run", action="append", help="only these run names / ids")
    ap.add_argument("--synthetic", type=int, default=0, metavar="N",
                    help="evaluate N synthetic collapsing + N synthetic healthy runs instead of / besides stores")
    ap.add_argument("--config", help="JSON file of DetectorConfig overrides")
    ap.add_argument("--json", metavar="OUT", help="also write rows and summary as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("lld_monitor.detect").setLevel(logging.ERROR)
    cfg = DetectorConfig.from_dict(json.loads(Path(args.config).read_text())) if args.config else DetectorConfig()

    sources = []
    seen: set[str] = set()
    stores = args.store or ([] if args.synthetic else [DEFAULT_STORE])
    for st in stores:
        if not Path(st).exists():
            print(f"detector_eval: no store at {st}", file=sys.stderr)
            return 2
        sources.append(load_store(st, args.run, seen))
    if args.synthetic:
        sources.append(load_synthetic(args.synthetic))

    rows: list[Row] = []
    frames: list[pd.DataFrame] = []
    for src in sources:
        for name, mode, sig, samples in src:
            collapse = reward_collapse_step(sig, cfg)
            decline = decline_step(sig, cfg)
            onset = phase2_onset(sig, collapse)
            frames.append(sig)
            rows.append(evaluate(name, mode, "full", sig, collapse, onset, cfg, decline))
            sc = scalar_only(sig, samples) if not name.startswith("synthetic-") else to_verl(sig)
            rows.append(evaluate(name, mode, "scalars", sc, collapse, onset, cfg, decline))
    if not rows:
        print("detector_eval: no runs to evaluate", file=sys.stderr)
        return 2
    print_table(rows)
    summ = summarize(rows)
    print()
    for variant, s in summ.items():
        rec = "-" if s["recall"] is None else f"{s['recall']:.0%}"
        print(f"[{variant}] collapsing runs {s['collapsing_runs']}: warned before collapse "
              f"{s['warned_before_collapse']} (recall {rec}), lead goal met {s['lead_goal_met']}, "
              f"lead median {_fmt(s['lead_median'])} min {_fmt(s['lead_min'])} steps | non-collapsing runs "
              f"{s['non_collapsing_runs']}: with false warnings {s['runs_with_false_warnings']} "
              f"({s['false_warning_alerts']} alerts)")
        print(f"[{variant}] runs whose reward declined 20 %: {s['declining_runs']}, warned before the decline "
              f"{s['warned_before_decline']}, lead to decline median {_fmt(s['lead_decline_median'])} steps")
        print(f"[{variant}] by mode: LLD-signal warnings (>= warning, non-reward signal) on vanilla runs "
              f"{s['vanilla_with_lld_warning']}/{s['vanilla_runs']}, on LLDS / LLDS-MA runs "
              f"{s['regularized_with_lld_warning']}/{s['regularized_runs']}")
    us = time_detector(frames, cfg)
    print(f"detector cost: {us:.0f} us/step (median of 5 replays of the longest run, {max(map(len, frames))} steps)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": summ,
                                               "us_per_step": us, "config": cfg.to_dict()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
