"""`lld-monitor forecast`: p_collapse, the chance that each run's reward collapses within the next H steps, at
every step (lld_monitor.detect.forecast_model); `lld-monitor forecast fit`: a forecast model fitted on your own runs.

`--json` prints the public contract (docs/detector.md, "Forecast"; fields may be added, never renamed):
{"runs": [{"name", "horizon", "model", "collapse_step": int|null, "steps": [{"step", "p_collapse": float|null}]}]}
p_collapse is null at and after the collapse step (the forecast is undefined there).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from lld_monitor.commands.detect import _num  # finite float or None, as `detect --json` writes it
from lld_monitor.detect import detect_run, load_detector_config
from lld_monitor.detect.forecast_model import HORIZON, INPUTS, THRESHOLD, ForecastModel
from lld_monitor.detect.offline import run_model
from lld_monitor.store import default_store_path
from lld_monitor.store.location import exists_locally

HELP = "the chance each run's reward collapses within the next steps (p_collapse), or `forecast fit` a model"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("fit",),
                        help="fit: fit a model on the store's runs (k-fold by run) and write it to --out")
    parser.add_argument("--store", default=default_store_path(),
                        help="run store: a folder or s3://bucket/prefix (default: $LLD_MONITOR_STORE or ./lld_runs)")
    parser.add_argument("--run", action="extend", nargs="+", metavar="NAME",
                        help="run name(s) or id(s) (default: every run in the store)")
    parser.add_argument("--horizon", type=int, default=None,
                        help=f"steps ahead (default: the model's; a fit's default is {HORIZON})")
    parser.add_argument("--model", metavar="FILE",
                        help="a model from `lld-monitor forecast fit` (default: the shipped one that fits each run's "
                             "columns: all signals when it logs displacement, else verl/TRL scalars)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract instead of text")
    fit = parser.add_argument_group("fit")
    fit.add_argument("--out", metavar="FILE", help="fit: where to write the model (JSON)")
    fit.add_argument("--inputs", choices=INPUTS, default="all",
                     help="fit: the columns the model sees: all, or what verl and TRL log by default (scalars)")
    fit.add_argument("--folds", type=int, default=5, help="fit: k of the k-fold by run (default 5)")


def run_record(run: dict, res, model: ForecastModel, steps: list[int]) -> dict:
    """One entry of the `forecast --json` contract: every step of the run, p null where undefined (`res` None: a
    run without steps)."""
    p = dict(res.forecast) if res is not None else {}
    collapse = None if res is None or res.collapse_step is None else int(res.collapse_step)
    return {"name": run.get("name"), "horizon": model.horizon, "model": model.name, "collapse_step": collapse,
            "steps": [{"step": int(s), "p_collapse": _num(p.get(s))} for s in steps]}


def _model(path: str | None, signals) -> ForecastModel | None:
    """--model's file, else the model RunLogger's detector chose for the run (`detect.offline.run_model`)."""
    return ForecastModel.load(path) if path else run_model(signals)


def _open(store: str):
    from lld_monitor.store import NotAStoreError, StoreError, open_store_reader

    if not exists_locally(store):
        raise SystemExit(f"lld-monitor forecast: no store at {store!r}; pass --store PATH")
    try:
        return open_store_reader(store)
    except (NotAStoreError, StoreError) as e:
        raise SystemExit(f"lld-monitor forecast: {e}") from e


def _runs(reader, keys: list[str] | None, store: str) -> list[dict]:
    from lld_monitor.store import StoreError

    if not keys:
        return reader.runs().to_dict("records")
    out = []
    for key in keys:
        try:
            out.append(reader.run(key))
        except (KeyError, StoreError) as e:
            raise SystemExit(f"lld-monitor forecast: {e}; list them with `lld-monitor runs --store {store}`") from e
    return out


def forecast(args: argparse.Namespace) -> int:
    cfg = load_detector_config(None)
    reader = _open(args.store)
    records = []
    try:
        for run in _runs(reader, args.run, args.store):
            sig = reader.signals(run["run_id"])
            try:
                model = _model(args.model, sig)
            except (FileNotFoundError, ValueError) as e:
                print(f"lld-monitor forecast: {e}", file=sys.stderr)
                return 2
            if model is None:
                print("lld-monitor forecast: no forecast model is shipped for this install; fit one with "
                      "`lld-monitor forecast fit --store S --out model.json` and pass --model", file=sys.stderr)
                return 2
            if args.horizon is not None and args.horizon != model.horizon:
                print(f"lld-monitor forecast: model {model.name!r} predicts within {model.horizon} steps, not "
                      f"{args.horizon}; fit one for {args.horizon} with `lld-monitor forecast fit --horizon "
                      f"{args.horizon}`", file=sys.stderr)
                return 2
            res = detect_run(sig, cfg, model) if len(sig) else None
            records.append(run_record(run, res, model, [int(s) for s in sig["step"]] if len(sig) else []))
    finally:
        reader.close()
    if args.json:
        json.dump({"runs": records}, sys.stdout, indent=1, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    for rec in records:
        known = [s for s in rec["steps"] if s["p_collapse"] is not None]
        last = known[-1] if known else None
        cs = rec["collapse_step"]
        now = (f"p_collapse {last['p_collapse']:.2f} at step {last['step']}" if last else "no forecast yet")
        first = next((s["step"] for s in known if s["p_collapse"] >= THRESHOLD), None)
        print(f"{rec['name']}: {now} (within {rec['horizon']} steps, model {rec['model']}); "
              f"first p >= {THRESHOLD:g}: {first if first is not None else 'never'}; "
              f"reward collapse: {'step ' + str(cs) if cs is not None else 'none'}")
    return 0


def fit(args: argparse.Namespace) -> int:
    from lld_monitor.detect import forecast_fit as ff

    if not args.out:
        print("lld-monitor forecast fit: --out FILE is required (where to write the model)", file=sys.stderr)
        return 2
    horizon = args.horizon or HORIZON
    cfg = load_detector_config(None)
    reader = _open(args.store)
    try:
        runs = [ff.run_steps(str(r["name"]), reader.signals(r["run_id"]), horizon, args.inputs, cfg)
                for r in _runs(reader, args.run, args.store)]
    finally:
        reader.close()
    runs = [r for r in runs if len(r.frame)]
    try:
        ff.check_enough(runs)
    except ff.NotEnoughRuns as e:
        print(f"lld-monitor forecast fit: {e}", file=sys.stderr)
        return 2
    n_c = sum(r.collapse_step is not None for r in runs)
    print(f"{len(runs)} runs ({n_c} with a reward collapse), {sum(len(r.frame) for r in runs)} steps; "
          f"labels: collapse within {horizon} steps; inputs: {args.inputs}")
    l2, cv = ff.choose_l2(runs, args.inputs, horizon, args.folds)
    print("regularization (k-fold Brier by run): " + ", ".join(f"l2={k:g}: {v:.4f}" for k, v in cv.items())
          + f" -> {l2:g}")
    preds = ff.kfold_predictions(runs, args.folds, lambda rs: ff.fit(rs, "cv", args.inputs, horizon, l2))
    sc = ff.scores_of(runs, preds)
    const = ff.scores_of(runs, ff.constant_baseline(runs, sc.base_rate))
    print(f"held-out ({args.folds}-fold by run): Brier {sc.brier:.4f} (constant {const.brier:.4f}), ECE {sc.ece:.3f}, "
          f"base rate {sc.base_rate:.3f} over {sc.n} labelled steps")
    print(sc.reliability.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    leads = ", ".join(f"{k} {v if v is not None else 'missed'}" for k, v in sc.leads.items())
    print(f"leads of p >= 0.5 before each collapse: {leads or '-'}; median {sc.median_lead}")
    if sc.max_p_no_collapse:
        print("highest p of the runs that never collapse: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sc.max_p_no_collapse.items()))
    model = ff.fit(runs, Path(args.out).stem, args.inputs, horizon, l2, fitted={
        "runs": [r.name for r in runs], "command": "lld-monitor " + " ".join(sys.argv[1:]),
        "heldout": {"brier": sc.brier, "ece": sc.ece, "base_rate": sc.base_rate, "folds": args.folds}})
    Path(args.out).write_text(model.to_json(), encoding="utf-8")
    print(f"wrote {args.out} ({len(model.features)} features); use it with --model {args.out} in `lld-monitor "
          f"forecast`, `detect` and `serve`")
    return 0


def run(args: argparse.Namespace) -> int:
    return fit(args) if args.action == "fit" else forecast(args)
