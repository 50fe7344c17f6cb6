"""Summarize the spiral experiment: per run, peak/final reward, the detector's phase starts and the
simple signal markers used in docs/backend.md.

    .venv/bin/python scripts/analyze_spiral.py /work/experiments/spiral_store [--window 10] [--json | --markdown]

`--markdown` prints the run table of docs/backend.md (runs ordered by mode, then seed).

Markers (on a trailing `window`-step mean; baseline = the first window):
- ll_decay_step: first step where ll_correct_mean is 0.02 nats/token below its baseline and stays below
  for the next window;
- entropy_surge_step: first step where entropy exceeds 1.5x its baseline;
- reward_drop_step: first step where the smoothed reward is below 0.8x its running peak.
"""

from __future__ import annotations

import argparse
import json
import math

import pandas as pd


def _first(mask: pd.Series) -> int | None:
    idx = mask[mask].index
    return int(idx[0]) if len(idx) else None


def summarize(store: str, window: int = 10) -> list[dict]:
    from lld_monitor.detect import detect_run
    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    out = []
    for _, run in r.runs().sort_values("name").iterrows():
        sig = r.signals(run.run_id).set_index("step").sort_index()
        sig = sig.select_dtypes("number")
        sm = sig.rolling(window, min_periods=window).mean()
        rew = sm["reward_mean"]
        peak_step = int(rew.idxmax())
        trough_step = int(rew.loc[peak_step:].idxmin())
        delta = sig["delta_preserved"]
        base_ll = sm["ll_correct_mean"].dropna().iloc[0] if sm["ll_correct_mean"].notna().any() else math.nan
        base_h = sm["entropy"].dropna().iloc[0]
        below = sm["ll_correct_mean"] < base_ll - 0.02
        stays = below & below[::-1].rolling(window, min_periods=1).min()[::-1].astype(bool)
        res = detect_run(r.signals(run.run_id))
        out.append({
            "run": run["name"], "run_id": run.run_id, "mode": run["mode"], "steps": int(run.steps),
            "reward_start": float(rew.dropna().iloc[0]),
            "reward_peak": float(rew.loc[peak_step]), "reward_peak_step": peak_step,
            "reward_final": float(sig["reward_mean"].iloc[-window:].mean()),
            "reward_trough": float(rew.loc[trough_step]), "reward_trough_step": trough_step,
            "delta_preserved_neg_share": float((delta < 0).mean()), "delta_preserved_mean": float(delta.mean()),
            "ll_correct_start": float(base_ll), "ll_correct_final": float(sig["ll_correct_mean"].iloc[-window:].mean()),
            "entropy_start": float(base_h), "entropy_max": float(sm["entropy"].max()),
            "entropy_final": float(sig["entropy"].iloc[-window:].mean()),
            "delta_preserved_final": float(sig["delta_preserved"].iloc[-window:].mean()),
            "frac_resp_displaced_final": float(sig["frac_responses_displaced"].iloc[-window:].mean()),
            "grad_norm_max": float(sig["grad_norm"].max()),
            "ll_decay_step": _first(stays),
            "entropy_surge_step": _first(sm["entropy"] > 1.5 * base_h),
            "reward_drop_step": _first(rew < 0.8 * rew.cummax()),
            "detector_phase": res.phase, "detector_phase_starts": res.phase_starts, "detector_collapse_step": res.collapse_step,
        })
    r.close()
    return out


def markdown(rows: list[dict]) -> str:
    order = {"vanilla": 0, "llds": 1, "llds_ma": 2}
    rows = sorted(rows, key=lambda r: (order.get(r["mode"], 9), len(r["run"]), r["run"]))
    out = ["| run | reward start → peak (step) | trough (step) | last 10 | Δ preserved < 0 (share of steps, mean nats) "
           "| entropy max | grad-norm max | phases (detector): stagnation / decay / phase III | reward collapse |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ps = r["detector_phase_starts"]
        phases = " / ".join(str(ps.get(k, "–")) for k in ("stagnation", "decay", "collapse"))
        col = r["detector_collapse_step"]
        out.append(f"| {r['run']} | {r['reward_start']:.2f} → {r['reward_peak']:.2f} ({r['reward_peak_step']}) "
                   f"| {r['reward_trough']:.2f} ({r['reward_trough_step']}) | {r['reward_final']:.2f} "
                   f"| {r['delta_preserved_neg_share']:.0%}, {r['delta_preserved_mean']:+.2f} | {r['entropy_max']:.2f} "
                   f"| {r['grad_norm_max']:.2f} | {phases} | {'–' if col is None else col} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="the run table of docs/backend.md")
    a = ap.parse_args()
    rows = summarize(a.store, a.window)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    if a.markdown:
        print(markdown(rows))
        return
    cols = ["run", "reward_start", "reward_peak", "reward_peak_step", "reward_final", "ll_correct_start", "ll_correct_final",
            "entropy_start", "entropy_max", "delta_preserved_final", "ll_decay_step", "entropy_surge_step",
            "reward_drop_step", "detector_phase_starts", "detector_collapse_step"]
    df = pd.DataFrame(rows)[cols]
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 60):
        print(df.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
