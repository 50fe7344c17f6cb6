"""`lld-monitor whatif`: what LLDS would have done on a run, per token-logged step (the counterfactual).

For each token-logged step, `lld.llds_loss` (the trainer's own function) evaluated on the stored tokens:
logp = logp_new (π after the step's updates), logp_old, the samples' advantages, action mask = action and
answer tokens. That is the penalty LLDS would have measured at the end of the step on the logged groups,
not a replay of training (docs/lld.md). The result is cached beside the run for the dashboard
(lld_monitor/counterfactual/cache.py); a second call only computes steps logged since.

`--json` prints the public contract (fields may be added, never renamed):
{"run": NAME, "config": {lam, gate, norm, answer_weight, adaptive_beta, v_base},
 "steps": [{"step", "llds_raw", "penalty", "n_preserved", "n_gated_responses", "n_gated_actions",
            "n_penalized_tokens", "n_samples", ...}]}
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any

from lld_monitor.counterfactual.cache import DEFAULT_SETTINGS, GATES, NORMS

HELP = "what LLDS would have done on a run: its penalty per token-logged step, from the stored tokens"

log = logging.getLogger(__name__)

#: the public per-step fields of `whatif --json`, in order (README); more may be added, none renamed
STEP_FIELDS = ("step", "llds_raw", "penalty", "n_preserved", "n_gated_responses", "n_gated_actions",
               "n_penalized_tokens", "n_samples")
#: added per-step fields
EXTRA_STEP_FIELDS = ("n_samples_skipped", "beta", "phase", "logged_llds_loss")
_INT_FIELDS = {"step", "n_preserved", "n_gated_responses", "n_gated_actions", "n_penalized_tokens", "n_samples",
               "n_samples_skipped"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lld_monitor.store import default_store_path

    parser.add_argument("--store", default=default_store_path(), metavar="PATH",
                        help="store: a folder or s3://bucket/prefix (default: $LLD_MONITOR_STORE, else ./lld_runs)")
    parser.add_argument("--run", required=True, metavar="NAME", help="run name or id (see `lld-monitor runs`)")
    parser.add_argument("--lam", type=float, default=DEFAULT_SETTINGS["lam"],
                        help=f"λ: penalty = λ · llds_raw (default {DEFAULT_SETTINGS['lam']}, the paper's)")
    parser.add_argument("--gate", choices=GATES, default=DEFAULT_SETTINGS["gate"],
                        help="action (A-gate, default) | response (R-gate) | token (ungated)")
    parser.add_argument("--norm", choices=NORMS, default=DEFAULT_SETTINGS["norm"],
                        help="response (paper, default) | token_mean (official code) | seq_mean (see docs/lld.md)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    parser.add_argument("--recompute", action="store_true", help="ignore the cached result and compute every step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _num(x: Any) -> Any:
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def phase_by_step(signals, steps: list[int]) -> dict[int, str]:
    """The detector's phase at each step (the last phase change at or before it); {} when it cannot tell."""
    from lld_monitor.detect import detect_run

    if signals is None or not len(signals):
        return {}
    try:
        changes = detect_run(signals, forecast=None).phase_changes
    except Exception as exc:  # noqa: BLE001 - the phases are a convenience; the numbers stand without them
        log.warning("no phases: the detector failed on this run (%s)", exc)
        return {}
    out, i, phase = {}, 0, None
    for s in sorted(steps):
        while i < len(changes) and changes[i][0] <= s:
            phase = changes[i][1]
            i += 1
        out[s] = phase
    return out


def step_records(steps, lam: float, phases: dict[int, str], logged: dict[int, float]) -> list[dict[str, Any]]:
    """The `steps` entries of the contract (counts as ints; NaN as null)."""
    from lld_monitor.counterfactual.cache import with_penalty

    out = []
    for rec in with_penalty(steps, lam).to_dict("records"):
        s = int(rec["step"])
        row: dict[str, Any] = {}
        for k in (*STEP_FIELDS, "n_samples_skipped", "beta"):
            row[k] = int(rec[k]) if k in _INT_FIELDS else _num(rec[k])
        row["phase"] = phases.get(s)
        row["logged_llds_loss"] = _num(logged.get(s))
        out.append(row)
    return out


def _fmt(x: float | None, spec: str = ".3e") -> str:
    return "-" if x is None else format(x, spec)


def print_table(doc: dict[str, Any], out) -> None:
    cfg = doc["config"]
    has_logged = any(r["logged_llds_loss"] not in (None, 0.0) for r in doc["steps"])
    print(f"{doc['run']} (mode {doc['mode']}): the LLDS term (λ {cfg['lam']:g}, gate {cfg['gate']}, norm {cfg['norm']}) "
          "measured at the end of each token-logged step on its logged groups", file=out)
    cols = ["step", "phase", "penalty", "llds_raw", "preserved", "gated resp", "gated act", "penalized tok", "samples"]
    if has_logged:
        cols.append("logged llds_loss")
    rows = []
    for r in doc["steps"]:
        row = [str(r["step"]), r["phase"] or "-", _fmt(r["penalty"]), _fmt(r["llds_raw"]), str(r["n_preserved"]),
               str(r["n_gated_responses"]), str(r["n_gated_actions"]), str(r["n_penalized_tokens"]),
               str(r["n_samples"]) + (f" (+{r['n_samples_skipped']} skipped)" if r["n_samples_skipped"] else "")]
        if has_logged:
            row.append(_fmt(r["logged_llds_loss"]))
        rows.append(row)
    widths = [max(len(c), *(len(x[i]) for x in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    for x in rows:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)), file=out)
    if has_logged:
        pairs = [(r["penalty"], r["logged_llds_loss"]) for r in doc["steps"]
                 if r["penalty"] is not None and r["logged_llds_loss"] is not None]
        if pairs:
            import statistics

            below = sum(1 for a, b in pairs if a < b)
            print(f"this run applied LLDS: median logged llds_loss {_fmt(statistics.median(b for _, b in pairs))} "
                  f"(the mean over each step's updates, all groups) vs median penalty here "
                  f"{_fmt(statistics.median(a for a, _ in pairs))} (after the step's last update, logged groups); "
                  f"lower here on {below} of {len(pairs)} steps", file=out)
    summary = phase_summary(doc["steps"])
    if summary:
        print("median penalty by phase (the detector's phases):", file=out)
        for p in summary:
            print(f"  {p['phase']:<12} from step {p['from_step']:>5}: {_fmt(p['penalty_median'])} over {p['steps']} "
                  "token-logged step(s)", file=out)


def phase_summary(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median penalty per run of consecutive steps in one detector phase."""
    import statistics

    out: list[dict[str, Any]] = []
    for r in steps:
        if r["phase"] is None:
            continue
        if not out or out[-1]["phase"] != r["phase"]:
            out.append({"phase": r["phase"], "from_step": r["step"], "values": []})
        if r["penalty"] is not None:
            out[-1]["values"].append(r["penalty"])
    for p in out:
        vals = p.pop("values")
        p["steps"] = len(vals)
        p["penalty_median"] = statistics.median(vals) if vals else None
    return out


def whatif_document(reader, store: str, run: dict[str, Any], cfg: dict[str, Any], *, progress: bool = False,
                    use_cache: bool = True) -> dict[str, Any]:
    """The `whatif --json` document of one run (computes what the cache lacks and writes it back)."""
    from lld_monitor.counterfactual.evaluate import run_whatif

    result = run_whatif(reader, store, run, cfg, progress=progress, use_cache=use_cache)
    steps = [int(s) for s in result.steps["step"]]
    signals = reader.signals(str(run["run_id"]))
    phases = phase_by_step(signals, steps)
    logged = {}
    if len(signals) and "llds_loss" in signals.columns:
        logged = dict(zip(signals["step"].astype(int), signals["llds_loss"]))
    return {"run": run.get("name"), "run_id": run.get("run_id"), "mode": run.get("mode"), "config": dict(cfg),
            "steps": step_records(result.steps, cfg["lam"], phases, logged),
            "cache": None if result.path is None else str(result.path)}


def run(args: argparse.Namespace) -> int:
    from lld_monitor.counterfactual.cache import WhatIfError, settings
    from lld_monitor.store import RunNotFoundError, StoreError, open_store_reader

    if not getattr(args, "verbose", False):
        logging.getLogger("lld_monitor.detect").setLevel(logging.ERROR)  # `detect` lists alerts; here only phases
    try:
        cfg = settings(lam=args.lam, gate=args.gate, norm=args.norm)
    except WhatIfError as e:
        print(f"lld-monitor whatif: {e}", file=sys.stderr)
        return 2
    try:
        reader = open_store_reader(args.store)
    except StoreError as e:
        print(f"lld-monitor whatif: {e}", file=sys.stderr)
        return 2
    try:
        try:
            run_row = reader.run(args.run)
        except RunNotFoundError as e:
            print(f"lld-monitor whatif: {e}; list them with `lld-monitor runs --store {args.store}`", file=sys.stderr)
            return 2
        doc = whatif_document(reader, args.store, run_row, cfg, progress=not args.no_progress,
                              use_cache=not args.recompute)
    except WhatIfError as e:
        print(f"lld-monitor whatif: run {args.run!r}: {e}", file=sys.stderr)
        return 2
    except StoreError as e:
        print(f"lld-monitor whatif: {e}", file=sys.stderr)
        return 2
    finally:
        reader.close()
    if args.json:
        json.dump(doc, sys.stdout, indent=2, allow_nan=False, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print_table(doc, sys.stdout)
    return 0
