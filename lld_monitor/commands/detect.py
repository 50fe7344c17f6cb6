"""`lld-monitor detect`: the current phase, phase starts, collapse step and every alert of the runs in
a store, computed offline by `lld_monitor.detect.detect_run` (the same alerts the online detector
raised while the run was written).

`--json` prints the public contract (docs/detector.md):
{"runs": [{"name", "mode", "source", "phase", "phase_starts": {phase: step}, "collapse_step": int|null,
           "alerts": [{"step", "phase", "severity", "signal", "value", "threshold", "message"}],
           "phase_title", "reward_collapsed": bool, "phase_changes": [{"step", "phase"}],
           "p_collapse": float|null, "p_collapse_step": int|null, "forecast_model": str|null}]}
Phase keys and titles: lld_monitor.detect.phases ("acceleration" = phase III, "collapse" = the reward
has collapsed). Non-finite alert values are written as null. p_collapse is the latest collapse forecast (the chance
the reward collapses within the model's horizon, `lld-monitor forecast` for every step; null once it collapsed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import pandas as pd

from lld_monitor.detect import (
    PHASES,
    SEVERITIES,
    DetectionResult,
    DetectorConfig,
    detect_run,
    load_detector_config,
    onset_table,
    phase_title,
    post_mortem_reference,
)
from lld_monitor.detect.forecast_model import AUTO, ForecastModel
from lld_monitor.store import default_store_path
from lld_monitor.store.location import exists_locally

HELP = f"name each run's phase ({' / '.join(PHASES)}) and list its early-warning alerts"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=default_store_path(),
                        help="run store: a folder or s3://bucket/prefix (default: $LLD_MONITOR_STORE or ./lld_runs)")
    parser.add_argument("--run", action="extend", nargs="+", metavar="NAME",
                        help="run name(s) or id(s): --run A B, or --run A --run B (default: every run in the store)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract instead of text")
    parser.add_argument("--min-severity", choices=SEVERITIES, default="info",
                        help="only list alerts at or above this severity (default: info = all)")
    parser.add_argument("--onsets", action="store_true",
                        help="also list, per signal, the step its sustained change began (the post-mortem's "
                             "onset table; JSON: added fields 'reference', 'onsets', 'spikes')")
    parser.add_argument("--config", metavar="FILE",
                        help="JSON file of DetectorConfig overrides, e.g. {\"decay_z\": -4} (default: "
                             "$LLD_MONITOR_DETECTOR_CONFIG, which RunLogger and the dashboard read too)")
    parser.add_argument("--model", metavar="FILE",
                        help="collapse-forecast model from `lld-monitor forecast fit` (default: "
                             "$LLD_MONITOR_FORECAST_MODEL, else the shipped one that fits each run's columns)")


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def run_record(run: dict, res: DetectionResult, min_severity: str = "info") -> dict:
    """One entry of the `detect --json` contract."""
    floor = SEVERITIES.index(min_severity)
    return {
        "name": run.get("name"),
        "mode": run.get("mode"),
        "source": run.get("source"),
        "phase": res.phase,
        "phase_starts": {k: int(v) for k, v in res.phase_starts.items()},
        "collapse_step": None if res.collapse_step is None else int(res.collapse_step),
        "alerts": [
            {
                "step": int(a.step),
                "phase": a.phase,
                "severity": a.severity,
                "signal": a.signal,
                "value": _num(a.value),
                "threshold": _num(a.threshold),
                "message": a.message,
            }
            for a in res.alerts
            if SEVERITIES.index(a.severity) >= floor
        ],
        # added fields (the ones above keep their names and meaning)
        "phase_title": phase_title(res.phase),
        "reward_collapsed": res.collapse_step is not None,
        "phase_changes": [{"step": int(s), "phase": p} for s, p in res.phase_changes],
        "p_collapse": _num(res.forecast[-1][1]) if res.forecast and res.collapse_step is None else None,
        "p_collapse_step": int(res.forecast[-1][0]) if res.forecast and res.collapse_step is None else None,
        "forecast_model": res.forecast_model,
    }


def onset_record(sig) -> dict:
    """The post-mortem's onsets of one run as added `detect --json` fields (lld_monitor.detect.onset)."""
    if not len(sig):
        return {"reference": {"step": None, "kind": "none"}, "onsets": [], "spikes": []}
    ref, kind = post_mortem_reference(sig)
    onsets, spikes = onset_table(sig, ref)

    def rows(df) -> list[dict]:
        return [{k: (None if v is None or (isinstance(v, float) and not math.isfinite(v)) or v is pd.NA
                     else (int(v) if k in ("onset_step", "lead_steps", "step") else v))
                 for k, v in r.items()} for r in df.astype(object).to_dict("records")]

    return {"reference": {"step": ref, "kind": kind}, "onsets": rows(onsets), "spikes": rows(spikes)}


def _load_config(path: str | None) -> DetectorConfig:
    """--config FILE; without it, $LLD_MONITOR_DETECTOR_CONFIG's file if set (what RunLogger and the
    dashboard use), else the defaults."""
    try:
        return load_detector_config(path or None)
    except ValueError as e:
        raise SystemExit(f"lld-monitor detect: --config: {e}") from e


def _print_text(rec: dict, out) -> None:
    starts = ", ".join(f"{k} @ {v}" for k, v in sorted(rec["phase_starts"].items(), key=lambda kv: kv[1]))
    cs = rec["collapse_step"]
    print(f"{rec['name']}  (mode {rec['mode']}, source {rec['source']})", file=out)
    print(f"  phase now: {rec['phase_title']} ({rec['phase']})   phases began: {starts or '-'}", file=out)
    print(f"  reward collapse: {'step ' + str(cs) if cs is not None else 'none'}", file=out)
    if rec["p_collapse"] is not None:
        print(f"  collapse forecast: p = {rec['p_collapse']:.2f} at step {rec['p_collapse_step']} "
              f"(model {rec['forecast_model']})", file=out)
    if not rec["alerts"]:
        print("  alerts: none", file=out)
    if "onsets" in rec:
        ref = rec["reference"]
        print(f"  onsets (reference: {ref['kind']}" + (f" at step {ref['step']})" if ref["step"] is not None else ")"),
              file=out)
        for o in rec["onsets"]:
            if o["onset_step"] is None:
                print(f"    {o['column']:<28} -        {o['note']}", file=out)
            else:
                lead = "" if o["lead_steps"] is None else f", lead {o['lead_steps']}"
                print(f"    {o['column']:<28} step {o['onset_step']:>4}  {o['direction']:<4} {o['size_sigma']} sigma{lead}",
                      file=out)
        if rec["spikes"]:
            sp = ", ".join(f"{x['column']}@{x['step']}" for x in rec["spikes"])
            print(f"  isolated spikes (not onsets): {sp}", file=out)
    for a in rec["alerts"]:
        print(f"  step {a['step']:>6}  {a['severity']:<8} {a['phase']:<10} {a['signal']}: {a['message']}", file=out)


def run(args: argparse.Namespace) -> int:
    from lld_monitor.store import NotAStoreError, StoreError, open_store_reader  # noqa: PLC0415

    cfg = _load_config(getattr(args, "config", None))
    store = args.store
    if not exists_locally(store):
        print(f"lld-monitor detect: no store at {store!r}; pass --store PATH (a folder made by "
              f"`lld-monitor train` or `lld-monitor import-wandb`)", file=sys.stderr)
        return 2
    try:
        reader = open_store_reader(store)
    except (NotAStoreError, StoreError) as e:
        print(f"lld-monitor detect: {e}", file=sys.stderr)
        return 2
    try:
        runs_df = reader.runs()
        if args.run:
            runs = []
            for key in args.run:
                try:
                    runs.append(reader.run(key))
                except (KeyError, StoreError) as e:
                    print(f"lld-monitor detect: {e}; list them with `lld-monitor runs --store {store}`",
                          file=sys.stderr)
                    return 2
        else:
            runs = runs_df.to_dict("records")
        records = []
        for run_row in runs:
            sig = reader.signals(run_row["run_id"])
            try:
                model = ForecastModel.load(args.model) if getattr(args, "model", None) else AUTO
            except (FileNotFoundError, ValueError) as e:
                print(f"lld-monitor detect: --model: {e}", file=sys.stderr)
                return 2
            res = detect_run(sig, cfg, model) if len(sig) else DetectionResult("healthy", {}, None, [])
            rec = run_record(run_row, res, args.min_severity)
            if getattr(args, "onsets", False):
                rec.update(onset_record(sig))
            records.append(rec)
    finally:
        reader.close()

    if args.json:
        json.dump({"runs": records}, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        if not records:
            print(f"no runs in {store}")
        for rec in records:
            _print_text(rec, sys.stdout)
    return 0
