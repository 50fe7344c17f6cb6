"""Evaluate the early-warning detector on a labelled corpus of runs, split by seed into a tuning half
and a reported half, with all signals and with step scalars only (verl- and TRL-named).

    .venv/bin/python bench/detector_eval.py --store /work/exp/a/store --store /work/exp/b/store
    .venv/bin/python bench/detector_eval.py --store sample_runs --markdown     # the docs' tables
    .venv/bin/python bench/detector_eval.py --synthetic 10                     # synthetic runs, no store

LABELS (written before any tuning; from the run's own reward, the detector never sees them):
  collapse   lld_monitor.detect.reward_collapse_step is not None (the written collapse definition:
             trailing mean of 10 reward points below 0.5 x its running peak for 5 consecutive points)
  degraded   no collapse, but the mean of the last 20 reward points < 0.8 x the peak, where the peak is
             the running maximum of the same 10-point trailing mean the collapse definition uses
  healthy    otherwise
  running    the store says the run is still running: listed, never counted (its outcome is not known)
  stopped    the store says the run crashed (or was killed) before its last step and its reward had not
             collapsed by then: listed, never counted (its outcome is not known; one that collapsed first
             is a collapse)
SPLIT (written before any tuning): the seed is the integer after "seed" in the run name
  (`vanilla-seed3`, `llds-seed4`, `probe-lr2e-3-seed7`); ODD seeds are the TUNING half, EVEN seeds the
  REPORTED half. A run without a seed in its name is "unsplit": listed, never counted in either half.
  Thresholds may be chosen on the tuning half only; the reported half is what the docs quote.
SCORING (severity >= warning counts as a warning; `info` never does):
  collapse run   warned = first warning at a step < the collapse step; lead = collapse step - that step
  healthy run    any warning is a false warning
  degraded run   reported apart: warned or not, and the lead to its 20 % decline
                 (lld_monitor.detect.reward_decline_step)
  precision      collapse runs warned before the collapse / all runs with a warning before their
                 reference (collapse step, else the end of the run); degraded runs count as false here
  goal           all signals: every collapse warned >= 20 steps ahead, median lead >= 40, 0 warned healthy
                 runs; scalars only: <= 1 warned healthy run per 10 healthy runs
VARIANTS (what the detector is given):
  full          every column of the run (our token-derived signals included)
  scalars-verl  only what a verl / Search-R1 W&B run has: the actor/, critic/, env/, response_length/,
                timing_s/ keys, without actor/mean_reduce_chunk (only the LLDS fork logs it); derived from
                our columns when a run has no verl names (the likelihood proxy from the samples table)
  scalars-trl   only what a TRL GRPOTrainer W&B run has (train/reward, train/entropy, train/grad_norm,
                train/clip_ratio/region_mean, train/kl, ...), derived from our canonical columns
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from lld_monitor.detect import (
    SEVERITIES,
    DetectorConfig,
    detect_run,
    reward_collapse_step,
    reward_decline_step,
    reward_series,
)
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral, to_verl

LABELS = ("collapse", "degraded", "healthy", "running", "stopped")
DEGRADED_LAST_POINTS = 20
DEGRADED_FRAC = 0.8
HALVES = ("tune", "report", "unsplit")
VARIANTS = ("full", "scalars-verl", "scalars-trl")
GOAL_MIN_LEAD = 20
GOAL_MEDIAN_LEAD = 40
GOAL_SCALARS_FALSE_PER_10 = 1
WARN_FLOOR = SEVERITIES.index("warning")
_SEED = re.compile(r"seed[_-]?(\d+)", re.IGNORECASE)

VERL_PREFIXES = ("actor/", "critic/", "env/", "response_length/", "timing_s/", "prompt_length/")
VERL_EXCLUDE = {"actor/mean_reduce_chunk"}
DERIVE_VERL = {
    "reward_mean": "critic/score/mean",
    "entropy": "actor/entropy_loss",
    "grad_norm": "actor/grad_norm",
    "clip_frac": "actor/pg_clipfrac",
    "kl": "actor/kl_loss",
}
DERIVE_TRL = {
    "reward_mean": "train/reward",
    "reward_std": "train/reward_std",
    "entropy": "train/entropy",
    "grad_norm": "train/grad_norm",
    "clip_frac": "train/clip_ratio/region_mean",
    "kl": "train/kl",
    "response_length": "train/completions/mean_length",
    "lr": "train/learning_rate",
}


# ------------------------------------------------------------------------------------------- labels
def seed_of(name: str) -> int | None:
    m = _SEED.search(name)
    return int(m.group(1)) if m else None


def half_of(name: str) -> str:
    """'tune' (odd seed), 'report' (even seed) or 'unsplit' (no seed in the name)."""
    s = seed_of(name)
    return "unsplit" if s is None else ("tune" if s % 2 else "report")


@dataclass(frozen=True)
class Label:
    label: str
    collapse_step: int | None
    decline_step: int | None
    peak: float | None  # running max of the trailing-mean reward
    last_mean: float | None  # mean of the last DEGRADED_LAST_POINTS reward points


def label_run(sig: pd.DataFrame, cfg: DetectorConfig) -> Label:
    """The outcome label of a run by the written rule (module docstring)."""
    collapse = reward_collapse_step(sig, cfg)
    decline = reward_decline_step(sig, cfg)
    _, r = reward_series(sig)
    r = r.dropna()
    r = r[np.isfinite(r.to_numpy())]
    w = int(cfg.reward_smooth_window)
    if len(r) < w:
        return Label("healthy" if collapse is None else "collapse", collapse, decline, None, None)
    peak = float(r.rolling(w).mean().max())
    last = float(r.iloc[-DEGRADED_LAST_POINTS:].mean())
    if collapse is not None:
        lab = "collapse"
    elif peak > 0 and last < DEGRADED_FRAC * peak:
        lab = "degraded"
    else:
        lab = "healthy"
    return Label(lab, collapse, decline, peak, last)


# ----------------------------------------------------------------------------------------- variants
def scalars_verl(sig: pd.DataFrame, samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """The columns a verl / Search-R1 W&B run has (see the module docstring)."""
    verl = [c for c in sig.columns if c.startswith(VERL_PREFIXES) and c not in VERL_EXCLUDE]
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


def scalars_trl(sig: pd.DataFrame) -> pd.DataFrame:
    """The columns a TRL GRPOTrainer W&B run has, named as the W&B callback names them."""
    out = sig[["step"]].copy()
    for ours, theirs in DERIVE_TRL.items():
        if theirs in sig.columns:
            out[theirs] = sig[theirs]
        elif ours in sig.columns:
            out[theirs] = sig[ours]
    return out


# ------------------------------------------------------------------------------------------ scoring
@dataclass
class Row:
    run: str
    store: str
    mode: str
    seed: int | None
    half: str
    variant: str
    label: str
    steps: int
    collapse_step: int | None
    decline_step: int | None
    first_info: int | None
    first_warning: int | None
    warning_signal: str | None
    first_critical: int | None
    lead: int | None  # collapse step - first warning (collapse runs)
    lead_decline: int | None  # decline step - first warning (any run with a decline step)
    warned: bool  # collapse: warned before the collapse; others: any warning
    n_warnings: int
    final_phase: str
    phases: str  # phases entered, in order


def score(name: str, store: str, mode: str, variant: str, sig: pd.DataFrame, lab: Label,
          cfg: DetectorConfig) -> Row:
    res = detect_run(sig, cfg, None)  # the phase detector alone (the forecast: bench/forecast_eval.py)
    warns = [a for a in res.alerts if SEVERITIES.index(a.severity) >= WARN_FLOOR]
    infos = [a for a in res.alerts if a.severity == "info"]
    crits = [a for a in res.alerts if a.severity == "critical"]
    w0 = warns[0] if warns else None
    lead = None if (w0 is None or lab.collapse_step is None) else int(lab.collapse_step - w0.step)
    lead_dec = None if (w0 is None or lab.decline_step is None) else int(lab.decline_step - w0.step)
    warned = (lead is not None and lead > 0) if lab.label == "collapse" else w0 is not None
    return Row(
        run=name, store=store, mode=mode, seed=seed_of(name), half=half_of(name), variant=variant,
        label=lab.label, steps=len(sig), collapse_step=lab.collapse_step, decline_step=lab.decline_step,
        first_info=infos[0].step if infos else None, first_warning=None if w0 is None else w0.step,
        warning_signal=None if w0 is None else w0.signal, first_critical=crits[0].step if crits else None,
        lead=lead, lead_decline=lead_dec, warned=warned, n_warnings=len(warns), final_phase=res.phase,
        phases=" > ".join(p for p, _ in sorted(res.phase_starts.items(), key=lambda kv: kv[1])),
    )


def summarize(rows: list[Row]) -> dict[str, dict[str, dict]]:
    """{half: {variant: figures}} over the rows (see SCORING in the module docstring)."""
    out: dict[str, dict[str, dict]] = {}
    for half in HALVES:
        for variant in VARIANTS:
            rs = [r for r in rows if r.half == half and r.variant == variant]
            if not rs:
                continue
            col = [r for r in rs if r.label == "collapse"]
            hea = [r for r in rs if r.label == "healthy"]
            deg = [r for r in rs if r.label == "degraded"]
            tp = sum(r.warned for r in col)
            fp = sum(r.warned for r in hea) + sum(r.warned for r in deg)
            leads = [r.lead for r in col if r.warned]
            dleads = [r.lead_decline for r in deg if r.lead_decline is not None]
            timely = sum(r.warned and r.lead >= GOAL_MIN_LEAD for r in col)  # type: ignore[operator]
            false_h = sum(r.warned for r in hea)
            if variant == "full":
                goal = (timely == len(col) and (not leads or statistics.median(leads) >= GOAL_MEDIAN_LEAD)
                        and false_h == 0)
            else:
                goal = false_h * 10 <= GOAL_SCALARS_FALSE_PER_10 * max(len(hea), 1)
            out.setdefault(half, {})[variant] = {
                "runs": len(rs),
                "collapse_runs": len(col),
                "collapse_warned": tp,
                "recall": tp / len(col) if col else None,
                "precision": tp / (tp + fp) if (tp + fp) else None,
                "warned_ge_20": timely,
                "lead_min": min(leads) if leads else None,
                "lead_median": statistics.median(leads) if leads else None,
                "healthy_runs": len(hea),
                "healthy_warned": false_h,
                "false_warning_rate": false_h / len(hea) if hea else None,
                "degraded_runs": len(deg),
                "degraded_warned": sum(r.warned for r in deg),
                "degraded_lead_decline_median": statistics.median(dleads) if dleads else None,
                "goal_met": bool(goal),
            }
    return out


# ------------------------------------------------------------------------------------------ sources
Source = Iterator[tuple[str, str, str, pd.DataFrame, pd.DataFrame | None, str]]  # ..., the store's run status


def store_label(path: str) -> str:
    """A short name for a store in tables: its folder, or the folder above when that is called 'store'."""
    p = Path(path).resolve()
    return p.parent.name if p.name in ("store", "runs") else p.name


def load_store(path: str, only: list[str] | None, seen: set[tuple[str, str]]) -> Source:
    """(name, store, mode, signals, samples-or-None, status) per run. The same run copied into two stores (same run id
    and start time) is evaluated once; runs of different stores that share an id are different runs."""
    from lld_monitor.store import open_store_reader

    r = open_store_reader(path)
    try:
        for rec in r.runs().to_dict("records"):
            if only and rec["name"] not in only and rec["run_id"] not in only:
                continue
            key = (str(rec["run_id"]), str(rec.get("started_at")))
            if key in seen:
                continue
            seen.add(key)
            sig = r.signals(rec["run_id"])
            if sig.empty:
                continue
            has_verl = any(c.startswith("actor/") for c in sig.columns)
            samples = None if has_verl else r.samples(rec["run_id"])
            yield (str(rec["name"]), store_label(path), str(rec.get("mode")), sig, samples,
                   str(rec.get("status")))
    finally:
        r.close()


def load_synthetic(n: int) -> Source:
    """n paper-shaped spirals and n healthy runs, seeds 1..n (odd seeds tune, even report)."""
    for seed in range(1, n + 1):
        noise = 1.0 + 0.5 * (seed % 2)
        yield (f"synthetic-spiral-seed{seed}", "synthetic", "vanilla", spiral(SpiralSpec(seed=seed, noise=noise)),
               None, "finished")
        yield f"synthetic-healthy-seed{seed}", "synthetic", "llds", healthy(seed=seed, noise=noise), None, "finished"


def evaluate_sources(sources: list[Source], cfg: DetectorConfig) -> tuple[list[Row], list[pd.DataFrame]]:
    rows: list[Row] = []
    frames: list[pd.DataFrame] = []
    for src in sources:
        for name, store, mode, sig, samples, status in src:
            lab = label_run(sig, cfg)
            if status == "running":
                lab = Label("running", lab.collapse_step, lab.decline_step, lab.peak, lab.last_mean)
            elif status == "crashed" and lab.label != "collapse":
                lab = Label("stopped", lab.collapse_step, lab.decline_step, lab.peak, lab.last_mean)
            frames.append(sig)
            verl = to_verl(sig) if store == "synthetic" else scalars_verl(sig, samples)
            for variant, df in (("full", sig), ("scalars-verl", verl), ("scalars-trl", scalars_trl(sig))):
                rows.append(score(name, store, mode, variant, df, lab, cfg))
    return rows, frames


def time_detector(frames: list[pd.DataFrame], cfg: DetectorConfig, reps: int = 3) -> float:
    """Median over `reps` replays of the longest run: microseconds per step."""
    df = max(frames, key=len)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        detect_run(df, cfg, None)
        ts.append((time.perf_counter() - t0) / max(len(df), 1) * 1e6)
    return float(statistics.median(ts))


# ------------------------------------------------------------------------------------------- output
RATIOS = {"recall", "precision", "false_warning_rate"}


def _f(v, ratio: bool = False) -> str:
    if v is None:
        return "–"
    if ratio:
        return f"{v:.0%}"
    if isinstance(v, float):
        return f"{v:g}" if not v.is_integer() else f"{v:.0f}"
    return str(v)


def _warn_cell(r: Row) -> str:
    if r.first_warning is None:
        return "none"
    return f"{r.first_warning} ({r.warning_signal})"


def per_run_table(rows: list[Row], markdown: bool) -> list[str]:
    """One line per run, the three variants side by side."""
    by_run: dict[tuple[str, str], dict[str, Row]] = {}
    for r in rows:
        by_run.setdefault((r.store, r.run), {})[r.variant] = r
    hdr = ["run", "half", "label", "collapse", "decline"]
    for v in VARIANTS:
        hdr += [f"{v}: 1st warning", f"{v}: lead"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    else:
        lines.append("  ".join(f"{h:>14}" if i else f"{h:<26}" for i, h in enumerate(hdr)))
    order = {h: i for i, h in enumerate(HALVES)}
    several = len({st for st, _ in by_run}) > 1
    for (st, run), vs in sorted(by_run.items(),
                                key=lambda kv: (order[next(iter(kv[1].values())).half], kv[0][1], kv[0][0])):
        base = next(iter(vs.values()))
        cells = [f"{st}/{run}" if several else run, base.half, base.label, _f(base.collapse_step), _f(base.decline_step)]
        for v in VARIANTS:
            r = vs.get(v)
            if r is None:
                cells += ["–", "–"]
                continue
            lead = r.lead if r.label == "collapse" else r.lead_decline
            lead_txt = _f(lead) + ("" if r.label == "collapse" or lead is None else " (to decline)")
            cells += [_warn_cell(r), lead_txt]
        if markdown:
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append("  ".join(f"{c:>14}" if i else f"{c[:26]:<26}" for i, c in enumerate(cells)))
    return lines


SUMMARY_COLS = (
    ("collapse_runs", "collapses"), ("collapse_warned", "warned ahead"), ("recall", "recall"),
    ("precision", "precision"), ("warned_ge_20", "warned ≥ 20"), ("lead_min", "lead min"),
    ("lead_median", "lead median"), ("healthy_runs", "healthy"), ("healthy_warned", "healthy warned"),
    ("degraded_runs", "degraded"), ("degraded_warned", "degraded warned"),
    ("degraded_lead_decline_median", "degraded lead to decline (median)"), ("goal_met", "goal met"),
)


def summary_table(summ: dict[str, dict[str, dict]], markdown: bool) -> list[str]:
    hdr = ["half", "variant"] + [t for _, t in SUMMARY_COLS]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    else:
        lines.append("  ".join(f"{h:>12}" for h in hdr))
    for half, by_v in summ.items():
        for variant, s in by_v.items():
            cells = [half, variant] + [
                ("yes" if s[k] else "NO") if k == "goal_met" else _f(s[k], k in RATIOS) for k, _ in SUMMARY_COLS]
            lines.append("| " + " | ".join(cells) + " |" if markdown else "  ".join(f"{c:>12}" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--store", action="append", default=[], help="run store to evaluate (repeatable)")
    ap.add_argument("--run", action="append", help="only these run names / ids (repeatable)")
    ap.add_argument("--synthetic", type=int, default=0, metavar="N",
                    help="also evaluate N synthetic collapsing + N synthetic healthy runs (seeds 1..N)")
    ap.add_argument("--half", choices=("tune", "report", "all"), default="all",
                    help="only this half, per run and in the summary (tune while blind to the reported half)")
    ap.add_argument("--config", help="JSON file of DetectorConfig overrides")
    ap.add_argument("--markdown", action="store_true", help="print the docs' tables (per run and summary)")
    ap.add_argument("--json", metavar="OUT", help="also write rows and summary as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("lld_monitor.detect").setLevel(logging.ERROR)
    cfg = DetectorConfig.from_dict(json.loads(Path(args.config).read_text())) if args.config else DetectorConfig()
    if not args.store and not args.synthetic:
        ap.error("give --store PATH (repeatable) and/or --synthetic N")

    sources: list[Source] = []
    seen: set[tuple[str, str]] = set()
    for st in args.store:
        if not Path(st).exists():
            print(f"detector_eval: no store at {st}", file=sys.stderr)
            return 2
        sources.append(load_store(st, args.run, seen))
    if args.synthetic:
        sources.append(load_synthetic(args.synthetic))
    t0 = time.perf_counter()
    rows, frames = evaluate_sources(sources, cfg)
    if not rows:
        print("detector_eval: no runs to evaluate", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    shown = rows if args.half == "all" else [r for r in rows if r.half == args.half]
    summ = summarize(rows)
    if args.half != "all":
        summ = {h: v for h, v in summ.items() if h == args.half}
    print("\n".join(per_run_table(shown, args.markdown)))
    print()
    print("\n".join(summary_table(summ, args.markdown)))
    us = time_detector(frames, cfg)
    print(f"\n{len(frames)} runs in {elapsed:.1f} s ({elapsed / len(frames):.2f} s per run, 3 variants); "
          f"detector cost {us:.0f} us/step (median of 3 replays of the longest run, {max(map(len, frames))} steps)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in shown], "summary": summ,
                                               "us_per_step": us, "config": cfg.to_dict()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
