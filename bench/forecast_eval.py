"""The collapse forecast judged as pre-registered (docs/results/forecast-preregistration.md): both models fitted on
the fit runs of the corpus (bench/forecast_corpus/), scored once on the held-out seeds and on the held-out config,
against the constant and the phase-rule baselines.

    .venv/bin/python -m bench.forecast_eval                      # print the tables (Markdown)
    .venv/bin/python -m bench.forecast_eval --write-models       # also (re)write lld_monitor/detect/forecast_models/
    .venv/bin/python -m bench.forecast_eval --out docs/results/forecast-evaluation-2026-12-07.md

The shipped models are exactly what `--write-models` writes: the regularization is chosen by 5-fold-by-run Brier
on the fit runs only; the reported runs never enter a fit. Runs on numpy and pandas; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from bench.forecast_corpus import OUT as CORPUS  # noqa: E402
from bench.forecast_corpus import CorpusRun, load  # noqa: E402
from lld_monitor.detect import forecast_fit as ff  # noqa: E402
from lld_monitor.detect import load_detector_config  # noqa: E402
from lld_monitor.detect.forecast_model import HORIZON, INPUTS, MODELS_DIR, THRESHOLD, ForecastModel  # noqa: E402

log = logging.getLogger("bench.forecast_eval")

FIT_CONFIGS = ("spiral", "lowlr")
HELD_OUT_CONFIG = "const7"
FOLDS = 5
COMMAND = "python -m bench.forecast_eval --write-models"


def is_fit_run(run: CorpusRun) -> bool:
    """The pre-registered split: odd seeds of the configs the model may see."""
    return run.config in FIT_CONFIGS and run.seed % 2 == 1


@dataclass
class Judged:
    split: str
    runs: list[ff.RunSteps]
    model: ff.Scores
    constant: ff.Scores
    phase: ff.Scores

    def row(self, name: str) -> str:
        m, c, p = self.model, self.constant, self.phase
        missed = sum(v is None for v in m.leads.values())
        healthy = max(m.max_p_no_collapse.values()) if m.max_p_no_collapse else math.nan
        return (f"| {name} | {self.split} | {len(self.runs)} ({len(m.leads)} collapse) | {m.n} | {m.base_rate:.3f} | "
                f"**{m.brier:.4f}** | {c.brier:.4f} | {m.brier / c.brier:.2f} | {p.brier:.4f} | {m.ece:.3f} | "
                f"{_lead(m.median_lead)} | {missed} | {healthy:.2f} |")


def _lead(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def steps_of(runs: list[CorpusRun], inputs: str) -> list[ff.RunSteps]:
    cfg = load_detector_config(None)
    return [ff.run_steps(r.name, r.signals, HORIZON, inputs, cfg) for r in runs]


def fit_model(fit_runs: list[ff.RunSteps], inputs: str) -> tuple[ForecastModel, dict[float, float], ff.Scores]:
    l2, cv = ff.choose_l2(fit_runs, inputs, HORIZON, FOLDS)
    preds = ff.kfold_predictions(fit_runs, FOLDS, lambda rs: ff.fit(rs, "cv", inputs, HORIZON, l2))
    cv_scores = ff.scores_of(fit_runs, preds)
    model = ff.fit(fit_runs, inputs, inputs, HORIZON, l2, fitted={
        "runs": [r.name for r in fit_runs], "command": COMMAND,
        "corpus": "bench/forecast_corpus (docs/results/forecast-preregistration.md: odd seeds of spiral and lowlr)",
        "cv": {"folds": FOLDS, "brier": cv_scores.brier, "ece": cv_scores.ece,
               "l2_brier": {f"{k:g}": v for k, v in cv.items()}}})
    return model, cv, cv_scores


def judge(model: ForecastModel, fit_runs: list[ff.RunSteps], runs: list[ff.RunSteps], split: str) -> Judged:
    sc = ff.scores_of(runs, [ff.predict(model, r) for r in runs])
    rates = ff.phase_rates(fit_runs)
    fallback = float(np.nanmean(np.concatenate([r.frame["y"].to_numpy(float) for r in fit_runs])))
    return Judged(split, runs, sc, ff.scores_of(runs, ff.constant_baseline(runs, sc.base_rate)),
                  ff.scores_of(runs, ff.phase_baseline(runs, rates, fallback)))


def targets(j: Judged) -> list[tuple[str, bool]]:
    m = j.model
    healthy = max(m.max_p_no_collapse.values()) if m.max_p_no_collapse else 0.0
    return [("Brier <= 0.7 x constant", m.brier <= 0.7 * j.constant.brier),
            ("Brier < phase rule", m.brier < j.phase.brier),
            ("ECE <= 0.1", m.ece <= 0.1),
            ("median lead >= 25", m.median_lead is not None and m.median_lead >= 25),
            ("no healthy run reaches p >= 0.5", healthy < THRESHOLD)]


def cost_per_step(runs: list[CorpusRun], model: ForecastModel, reps: int = 5) -> tuple[float, float]:
    """(ms per step the forecast adds to the online detector, ms per step of the detector without it): medians
    of `reps` replays of `runs`, with and without the model, interleaved."""
    from lld_monitor.detect import detect_run

    steps = sum(len(r.signals) for r in runs)
    with_f, without = [], []
    with ff._quiet_detector():
        for _ in range(reps):
            for forecast, out in ((model, with_f), (None, without)):
                t0 = time.perf_counter()
                for r in runs:
                    detect_run(r.signals, None, forecast)
                out.append((time.perf_counter() - t0) * 1000 / steps)
    base = float(np.median(without))
    return float(np.median(with_f)) - base, base


def report(corpus: Path, write_models: bool) -> str:
    t0 = time.perf_counter()
    runs = load(corpus)
    fit_runs = [r for r in runs if is_fit_run(r)]
    seeds_out = [r for r in runs if r.config in FIT_CONFIGS and not is_fit_run(r)]
    config_out = [r for r in runs if r.config == HELD_OUT_CONFIG]
    lines = [f"Corpus: {len(runs)} runs ({corpus.relative_to(Path.cwd()) if corpus.is_relative_to(Path.cwd()) else corpus}); "
             f"fit on {len(fit_runs)} (odd seeds of {', '.join(FIT_CONFIGS)}), reported on {len(seeds_out)} held-out "
             f"seeds and {len(config_out)} runs of the held-out config {HELD_OUT_CONFIG}. Horizon H = {HORIZON}.", ""]
    table = ["| model | reported on | runs | labelled steps | base rate | Brier | constant | ratio | phase rule | ECE | "
             "median lead | missed | highest p, no collapse |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    details: list[str] = []
    for inputs in INPUTS:
        fit_steps = steps_of(fit_runs, inputs)
        model, cv, cv_scores = fit_model(fit_steps, inputs)
        if inputs == "all":
            added, base = cost_per_step(fit_runs[:6], model)
            lines += [f"Cost: the forecast adds {added:.3f} ms per step to the online detector ({base:.3f} ms per step "
                      "without it; medians of 5 replays of 6 runs, interleaved).", ""]
        if write_models:
            MODELS_DIR.mkdir(exist_ok=True)
            (MODELS_DIR / f"{inputs}.json").write_text(model.to_json(), encoding="utf-8")
        details += [f"### {inputs} (`lld_monitor/detect/forecast_models/{inputs}.json`, fingerprint "
                    f"`{model.fingerprint}`)", "",
                    f"Features ({len(model.features)}): {', '.join(model.features)}.",
                    "Regularization by 5-fold-by-run Brier on the fit runs: "
                    + ", ".join(f"l2={k:g}: {v:.4f}" for k, v in cv.items())
                    + f" -> **{model.fitted['l2']:g}** (cross-validated Brier {cv_scores.brier:.4f}, ECE "
                      f"{cv_scores.ece:.3f}).", ""]
        for split, sel in (("held-out seeds", seeds_out), (f"held-out config ({HELD_OUT_CONFIG})", config_out)):
            if not sel:
                continue
            j = judge(model, fit_steps, steps_of(sel, inputs), split)
            table.append(j.row(inputs))
            checks = targets(j)
            details += [f"**{inputs}, {split}**: " + "; ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in checks)
                        + ("" if inputs == "all" else " (targets are for the all-signals model; reported only)"), "",
                        "Leads (collapse step − first step with p ≥ 0.5): " + ", ".join(
                            f"{k} {v if v is not None else 'missed'}" for k, v in j.model.leads.items()) + ".",
                        "Highest p of runs that never collapse: " + ", ".join(
                            f"{k} {v:.2f}" for k, v in j.model.max_p_no_collapse.items()) + ".", "",
                        "Reliability (bins of p):", "", "| p | n | mean p | observed rate |", "|---|---|---|---|"]
            for b in j.model.reliability.itertuples():
                if b.n:
                    details.append(f"| {b.lo:.1f}-{b.hi:.1f} | {b.n} | {b.mean_p:.3f} | {b.rate:.3f} |")
            details.append("")
    took = time.perf_counter() - t0
    m = machine()
    head = ["# The collapse forecast on held-out runs", "",
            f"Generated {dt.date.today().isoformat()} by `python -m bench.forecast_eval --write-models --out <this file>` on "
            f"{m.get('cpu_model', '?')}, {m.get('cpus', '?')} CPUs ({took:.0f} s), from the step tables in "
            "`bench/forecast_corpus/` (`python -m bench.forecast_corpus train --root R` then `export --root R`; "
            "`check --root R` compares them with the stores). Labels, splits, metrics and targets were committed "
            "before any fit: [forecast-preregistration.md](forecast-preregistration.md). The models are fitted on the "
            "fit runs only and scored once; `--write-models` writes exactly the shipped files.", ""]
    return "\n".join(head + lines + table + [""] + details)


# ------------------------------------------------------------------ the same runs as W&B imports (issue 37)
def _write_wandb(root: str, corpus: str, names: str) -> None:
    """Subprocess (WANDB_MODE=offline): each run's verl-named scalars (what a verl run of the LLDS authors' code puts
    in W&B) logged through the real wandb SDK."""
    import wandb

    want = set(names.split(","))
    for run in load(Path(corpus)):
        if run.name not in want:
            continue
        keys = [c for c in run.signals.columns if "/" in c]
        w = wandb.init(project="forecast", name=run.name, config={"algorithm": {"adv_estimator": "grpo"}})
        for rec in run.signals[["step", *keys]].to_dict("records"):
            step = int(rec.pop("step"))
            w.log({k: float(v) for k, v in rec.items() if v == v}, step=step)
        w.finish()


def wandb_check(corpus: Path, names: list[str], work: Path) -> list[str]:
    """Log `names` to W&B offline under verl's keys, import them (`import-wandb --offline`), and compare the
    forecast `lld-monitor forecast` gives on the import with the scalars model on the corpus run."""
    import os
    import subprocess

    from lld_monitor.detect import detect_run
    from lld_monitor.detect.forecast_model import shipped
    from lld_monitor.integrations.wandb.importer import import_offline
    from lld_monitor.store import open_store_reader

    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(work), WANDB_SILENT="true", WANDB_CONSOLE="off",
               WANDB_CONFIG_DIR=str(work / "cfg"), WANDB_CACHE_DIR=str(work / "cache"),
               WANDB_DATA_DIR=str(work / "data"), WANDB_DISABLE_GIT="true")
    subprocess.run([sys.executable, __file__, "--write-wandb", str(corpus), ",".join(names)], check=True, env=env,
                   cwd=work, timeout=600)
    store = work / "store"
    results = import_offline(str(store), work / "wandb", progress=False)
    model = shipped("scalars")
    runs = {r.name: r for r in load(corpus)}
    lines = ["| run (imported from W&B) | model chosen | steps forecast | max abs p difference vs the corpus run | "
             "first p ≥ 0.5 | collapse |", "|---|---|---|---|---|---|"]
    with open_store_reader(store) as reader:
        for res in results:
            got = detect_run(reader.signals(res.run_id))  # forecast=AUTO: what serve / detect / forecast use
            ref = detect_run(runs[res.name].signals, None, model)
            a, b = dict(got.forecast), dict(ref.forecast)
            diff = max((abs(a[s] - b[s]) for s in a.keys() & b.keys()), default=math.nan)
            first = next((s for s, p in got.forecast if p >= THRESHOLD), None)
            lines.append(f"| {res.name} | {got.forecast_model} | {len(a)} (corpus run: {len(b)}) | {diff:.2e} | "
                         f"{first if first is not None else '-'} | {got.collapse_step} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="folder of the corpus's step tables")
    ap.add_argument("--write-models", action="store_true", help="write the two fitted models into the package")
    ap.add_argument("--out", type=Path, help="also write the Markdown here")
    ap.add_argument("--wandb", default="spiral-vanilla-seed2,spiral-llds-seed2,lowlr-vanilla-seed2",
                    help="held-out runs checked as W&B imports ('' to skip)")
    ap.add_argument("--write-wandb", nargs=2, help=argparse.SUPPRESS)
    if "--write-wandb" in sys.argv:
        a = ap.parse_args()
        _write_wandb(".", *a.write_wandb)
        return 0
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    text = report(args.corpus.resolve(), args.write_models)
    if args.wandb:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            text += ("\n\n### The scalars model on the same runs imported from W&B\n\nEach run's verl-named scalars "
                     "logged through the wandb SDK (offline), imported with `import_offline` (which stores the "
                     "detector's replay beside the run), and forecast as `lld-monitor forecast` does (the model "
                     "chosen by the run's first row):\n\n"
                     + "\n".join(wandb_check(args.corpus.resolve(), args.wandb.split(","), Path(tmp))))
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
