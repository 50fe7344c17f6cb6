"""The collapse forecast judged as pre-registered (docs/results/forecast-preregistration.md), in two rounds, from the
corpus's step tables (bench/forecast_corpus/):

- round 1: both models fitted on the odd seeds of spiral 1-10 and lowlr 1-6, scored once on their even seeds and on
  the held-out config const7. Its models are kept in bench/forecast_round1/; `--round 1` refits them and checks
  that the fit gives the same models.
- round 2 (the default): candidate models compared by 5-fold-by-run cross-validation on every run round 1 saw of
  spiral and lowlr (32 runs); the all-signals one meeting the most targets in cross-validation (ties: the lower
  Brier; the scalars one: the lower Brier) is scored once on the fresh seeds (spiral 11-14, lowlr 7-8), beside
  round 1's model, and on const7.

    .venv/bin/python -m bench.forecast_eval                      # round 2: print the tables (Markdown)
    .venv/bin/python -m bench.forecast_eval --write-models       # and ship its models if they beat round 1's
    .venv/bin/python -m bench.forecast_eval --out docs/results/forecast-evaluation-round2-2026-12-07.md
    .venv/bin/python -m bench.forecast_eval --round 1            # round 1 again (its models must come out equal)

The reported runs never enter a fit or a choice. Runs on numpy and pandas; a few minutes on 2 cores.
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
from lld_monitor.detect.forecast_model import FEATURES, HORIZON, INPUTS, MODELS_DIR, THRESHOLD, ForecastModel  # noqa: E402

log = logging.getLogger("bench.forecast_eval")

FIT_CONFIGS = ("spiral", "lowlr")
HELD_OUT_CONFIG = "const7"
ROUND1_SEEDS = {"spiral": range(1, 11), "lowlr": range(1, 7)}
"""The seeds of the fit configs that round 1 had, and so has seen; the later ones are round 2's fresh seeds."""
ROUND1_MODELS = Path(__file__).with_name("forecast_round1")
"""Round 1's models, as shipped at 5902375 (`--round 1` refits them and checks that it gets the same)."""
ROUND1_FEATURES = tuple(f for f in FEATURES if f != "steps_to_line")
FOLDS = 5
COMMAND = "python -m bench.forecast_eval --write-models"


def seen_in_round1(run: CorpusRun) -> bool:
    return run.config in FIT_CONFIGS and run.seed in ROUND1_SEEDS[run.config]


def is_fit_run(run: CorpusRun, round_: int = 2) -> bool:
    """The pre-registered fit runs: round 1, the odd seeds it had; round 2, every run round 1 saw."""
    return seen_in_round1(run) and (round_ == 2 or run.seed % 2 == 1)


def reported_splits(runs: list[CorpusRun], round_: int) -> list[tuple[str, list[CorpusRun]]]:
    const7 = [r for r in runs if r.config == HELD_OUT_CONFIG]
    if round_ == 1:
        return [("held-out seeds", [r for r in runs if seen_in_round1(r) and r.seed % 2 == 0]),
                (f"held-out config ({HELD_OUT_CONFIG})", const7)]
    return [("fresh seeds", [r for r in runs if r.config in FIT_CONFIGS and not seen_in_round1(r)]),
            (f"held-out config ({HELD_OUT_CONFIG}, seen in round 1)", const7)]


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


@dataclass
class Candidate:
    """A feature pool and a regularization, judged by k-fold-by-run cross-validation on the fit runs."""

    features: str  # the pool's name
    l2: float
    scores: ff.Scores
    constant: ff.Scores
    met: int  # of the targets `target_checks` judges without the phase rule

    def row(self) -> str:
        s = self.scores
        fa = sum(v >= THRESHOLD for v in s.max_p_no_collapse.values())
        return (f"| {self.features} | {self.l2:g} | {s.brier:.4f} | {s.brier / self.constant.brier:.2f} | "
                f"{s.ece:.3f} | {_lead(s.median_lead)} | {fa} of {len(s.max_p_no_collapse)} | {self.met} |")


def target_checks(m: ff.Scores, constant: ff.Scores, phase: ff.Scores | None = None) -> list[tuple[str, bool]]:
    """The pre-registered targets of the all-signals model; the phase rule's only where its scores are given (the
    cross-validation of a candidate has none: it would need a second fit per fold)."""
    healthy = max(m.max_p_no_collapse.values(), default=0.0)
    return [("Brier <= 0.7 x constant", m.brier <= 0.7 * constant.brier),
            *([("Brier < phase rule", m.brier < phase.brier)] if phase is not None else []),
            ("ECE <= 0.1", m.ece <= 0.1),
            ("median lead >= 25", m.median_lead is not None and m.median_lead >= 25),
            ("no healthy run reaches p >= 0.5", healthy < THRESHOLD)]


def targets(j: Judged) -> list[tuple[str, bool]]:
    return target_checks(j.model, j.constant, j.phase)


POOLS = {"round-1 features": ROUND1_FEATURES, "round-1 features + steps_to_line": FEATURES}


def cross_validate(fit_runs: list[ff.RunSteps], inputs: str, pool: str, l2: float) -> Candidate:
    preds = ff.kfold_predictions(fit_runs, FOLDS, lambda rs: ff.fit(rs, "cv", inputs, HORIZON, l2, POOLS[pool]))
    sc = ff.scores_of(fit_runs, preds)
    const = ff.scores_of(fit_runs, ff.constant_baseline(fit_runs, sc.base_rate))
    return Candidate(pool, l2, sc, const, sum(ok for _, ok in target_checks(sc, const)))


def fit_model(fit_runs: list[ff.RunSteps], inputs: str, round_: int
              ) -> tuple[ForecastModel, list[Candidate], Candidate]:
    """Round 1: its feature pool, the regularization by cross-validated Brier. Round 2: every pool and
    regularization; for the all-signals model the most targets met in cross-validation, ties to the lower Brier;
    for the scalars model (the targets are not its) the lower Brier, as in round 1."""
    pools = ["round-1 features"] if round_ == 1 else list(POOLS)
    cands = [cross_validate(fit_runs, inputs, pool, l2) for pool in pools for l2 in ff.L2_CHOICES]
    if round_ == 1 or inputs == "scalars":
        best = min(cands, key=lambda c: (c.scores.brier, c.l2))
    else:
        best = min(cands, key=lambda c: (-c.met, c.scores.brier, c.l2))
    model = ff.fit(fit_runs, inputs, inputs, HORIZON, best.l2, POOLS[best.features], fitted={
        "runs": [r.name for r in fit_runs], "command": COMMAND if round_ == 2 else COMMAND + " --round 1",
        "corpus": "bench/forecast_corpus (docs/results/forecast-preregistration.md: "
                  + ("odd seeds of spiral and lowlr)" if round_ == 1 else "round 2: spiral seeds 1-10, lowlr 1-6)"),
        "cv": {"folds": FOLDS, "brier": best.scores.brier, "ece": best.scores.ece,
               **({"l2_brier": {f"{c.l2:g}": c.scores.brier for c in cands}} if round_ == 1 else
                  {"features": best.features, "targets_met": best.met})}})
    return model, cands, best


def judge(model: ForecastModel, fit_runs: list[ff.RunSteps], runs: list[ff.RunSteps], split: str) -> Judged:
    sc = ff.scores_of(runs, [ff.predict(model, r) for r in runs])
    rates = ff.phase_rates(fit_runs)
    fallback = float(np.nanmean(np.concatenate([r.frame["y"].to_numpy(float) for r in fit_runs])))
    return Judged(split, runs, sc, ff.scores_of(runs, ff.constant_baseline(runs, sc.base_rate)),
                  ff.scores_of(runs, ff.phase_baseline(runs, rates, fallback)))


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


def _judged_lines(j: Judged, inputs: str, label: str) -> list[str]:
    lowest = {r.name: float(r.frame["reward_vs_peak"].min()) for r in j.runs if r.collapse_step is None}
    lines = [f"**{label}, {j.split}**: " + "; ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in targets(j))
             + ("" if inputs == "all" else " (targets are for the all-signals model; reported only)"), "",
             "Leads (collapse step − first step with p ≥ 0.5): " + ", ".join(
                 f"{k} {v if v is not None else 'missed'}" for k, v in j.model.leads.items()) + ".",
             "Highest p of runs that never collapse (and their lowest smoothed reward / running peak): " + ", ".join(
                 f"{k} {v:.2f} ({lowest[k]:.2f})" for k, v in j.model.max_p_no_collapse.items()) + ".", "",
             "Reliability (bins of p):", "", "| p | n | mean p | observed rate |", "|---|---|---|---|"]
    lines += [f"| {b.lo:.1f}-{b.hi:.1f} | {b.n} | {b.mean_p:.3f} | {b.rate:.3f} |"
              for b in j.model.reliability.itertuples() if b.n]
    return lines + [""]


def report(corpus: Path, write_models: bool, round_: int = 2) -> str:
    t0 = time.perf_counter()
    runs = load(corpus)
    fit_runs = [r for r in runs if is_fit_run(r, round_)]
    splits = reported_splits(runs, round_)
    lines = [f"Corpus: {len(runs)} runs ({corpus.relative_to(Path.cwd()) if corpus.is_relative_to(Path.cwd()) else corpus}); "
             f"round {round_} fits on {len(fit_runs)} ("
             + ("odd seeds of spiral 1-10 and lowlr 1-6" if round_ == 1 else "spiral seeds 1-10, lowlr 1-6")
             + "), reports on " + " and ".join(f"{len(sel)} runs of the {name}" for name, sel in splits)
             + f". Horizon H = {HORIZON}.", ""]
    table = ["| model | reported on | runs | labelled steps | base rate | Brier | constant | ratio | phase rule | ECE | "
             "median lead | missed | highest p, no collapse |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    details: list[str] = []
    for inputs in INPUTS:
        fit_steps = steps_of(fit_runs, inputs)
        model, cands, best = fit_model(fit_steps, inputs, round_)
        round1 = ForecastModel.load(ROUND1_MODELS / f"{inputs}.json")
        if inputs == "all":
            added, base = cost_per_step(fit_runs[:6], model)
            lines += [f"Cost: the forecast adds {added:.3f} ms per step to the online detector ({base:.3f} ms per step "
                      "without it; medians of 5 replays of 6 runs, interleaved).", ""]
        details += [f"### {inputs} (fingerprint `{model.fingerprint}`)", "",
                    f"Features ({len(model.features)}): {', '.join(model.features)}.", "",
                    f"Candidates, {FOLDS}-fold-by-run cross-validation on the fit runs"
                    + (" (the lower Brier chosen):" if round_ == 1 or inputs == "scalars" else
                       " (the most targets met chosen, ties to the lower Brier):"), "",
                    "| features | l2 | Brier | ratio to constant | ECE | median lead | runs without collapse at p ≥ 0.5 "
                    "| targets met |", "|---|---|---|---|---|---|---|---|",
                    *(c.row() for c in cands), "",
                    f"Chosen: {best.features}, l2 = {best.l2:g}.", ""]
        if round_ == 1:
            details += [f"Same model as round 1's file (bench/forecast_round1/{inputs}.json): "
                        f"{'yes' if model.fingerprint == round1.fingerprint else 'NO'}.", ""]
        judged = {}
        for split, sel in splits:
            if not sel:
                continue
            steps = steps_of(sel, inputs)
            j = judge(model, fit_steps, steps, split)
            judged[split] = j
            table.append(j.row(f"{inputs}, round {round_}"))
            details += _judged_lines(j, inputs, f"{inputs}, round {round_}")
            if round_ == 2 and split == "fresh seeds":
                j1 = judge(round1, fit_steps, steps, split)
                judged["round 1"] = j1
                table.append(j1.row(f"{inputs}, round 1 (shipped at 5902375)"))
                details += _judged_lines(j1, inputs, f"{inputs}, round 1's model")
        if round_ == 2 and "round 1" in judged:
            new, old = judged["fresh seeds"].model.brier, judged["round 1"].model.brier
            ship = new < old
            details += [f"Ship rule ({inputs}): Brier on the fresh seeds {new:.4f} (round 2) vs {old:.4f} (round 1): "
                        + ("round 2's model is shipped." if ship else "round 1's model stays shipped."), ""]
            if write_models and ship:
                MODELS_DIR.mkdir(exist_ok=True)
                (MODELS_DIR / f"{inputs}.json").write_text(model.to_json(), encoding="utf-8")
    took = time.perf_counter() - t0
    m = machine()
    cmd = COMMAND + (" --round 1" if round_ == 1 else "")
    head = [f"# The collapse forecast on held-out runs, round {round_}", "",
            f"Generated {dt.date.today().isoformat()} by `{cmd} --out <this file>` on "
            f"{m.get('cpu_model', '?')}, {m.get('cpus', '?')} CPUs ({took:.0f} s), from the step tables in "
            "`bench/forecast_corpus/` (`python -m bench.forecast_corpus train --root R` then `export --root R`; "
            "`check --root R` compares them with the stores). Labels, splits, metrics and targets were committed "
            "before any fit: [forecast-preregistration.md](forecast-preregistration.md). The models are fitted on the "
            "fit runs only and the reported runs are scored once.", ""]
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
    ap.add_argument("--round", type=int, choices=(1, 2), default=2, dest="round_",
                    help="1: round 1 again (its models must come out equal); 2: round 2 (default)")
    ap.add_argument("--write-models", action="store_true",
                    help="round 2: write each fitted model into the package if it beats round 1's on the fresh seeds")
    ap.add_argument("--out", type=Path, help="also write the Markdown here")
    ap.add_argument("--wandb", default=None,
                    help="held-out runs checked as W&B imports ('' to skip)")
    ap.add_argument("--write-wandb", nargs=2, help=argparse.SUPPRESS)
    if "--write-wandb" in sys.argv:
        a = ap.parse_args()
        _write_wandb(".", *a.write_wandb)
        return 0
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.write_models and args.round_ == 1:
        ap.error("--write-models is for round 2 (round 1's models are kept in bench/forecast_round1/)")
    if args.wandb is None:
        args.wandb = ("spiral-vanilla-seed2,spiral-llds-seed2,lowlr-vanilla-seed2" if args.round_ == 1 else
                      "spiral-vanilla-seed12,spiral-llds-seed12,lowlr-vanilla-seed8")
    text = report(args.corpus.resolve(), args.write_models, args.round_)
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
