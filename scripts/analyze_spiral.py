"""Summarize the spiral experiment: per run, peak/final reward, the detector's phase starts and the
simple signal markers used in docs/backend.md.

    .venv/bin/python scripts/analyze_spiral.py /work/experiments/spiral_store [--window 10] [--json | --markdown | --goal | --errors | --groups]

`--markdown` prints the run table of docs/backend.md (runs ordered by mode, then seed).

Markers (on a trailing `window`-step mean; baseline = the first window):
- ll_decay_step: first step where ll_correct_mean is 0.02 nats/token below its baseline and stays below
  for the next window;
- entropy_surge_step: first step where entropy exceeds 1.5x its baseline;
- reward_drop_step: first step where the smoothed reward is below 0.8x its running peak.

`--groups`: what each step's updates do to each kind of response, per block of `--block` steps: the share of
the block's responses of each kind and their mean same-token Δ (ln π_after − ln π_old, summed over the
response's action tokens; nats per response). Kinds: `A0 correct` (a group that is all correct: Â = 0, no
policy gradient of its own; LLDS preserves it), `A0 wrong` (all wrong: Â = 0 too, so GRPO never corrects
it and LLDS preserves it as well), `Â > 0`, `Â < 0`.

`--errors`: what the wrong responses got wrong, at the warm start (steps 0-9, the lr still in its warm-up), early
(steps 20-59) and late (the last 50 steps), each
wrong response put in the first kind that fits, checked against the run's own world (rebuilt from its
stored config): an invalid action; no search; a first query that is not the question's entity (a mangled
copy); a two-hop question answered after one search; a wrong second query; no answer; else, with every
search right, a wrong entity that is in the retrieved documents (another slot or person) or an answer
that is not in them (a mangled copy). Below the table, per arm and window, the median (range) over runs of the
wrong share and of the copy-error rate: the share of wrong responses whose first or second query names the
wrong entity (COPY_ERRORS).

The testbed's goal (issue "A spiral testbed that reproduces the paper every time"), written down before
any tuning and checked by `--goal`; every series is the trailing `window`-step mean:
- collapse: `lld_monitor.detect.reward_collapse_step` (the detector's written definition) within the run;
- LLDS holds: no collapse and the last 20 steps' mean reward >= HOLD_FRAC x the run's smoothed peak;
- the paper's order of events (vanilla): the correct-response likelihood starts to fall at `ll_fall_step`
  (the step of the smoothed ll_correct_mean's maximum before the collapse, provided it ends at least
  LL_FALL_MIN nats/token below that maximum); the reward is still rising or flat within REWARD_TOL of its
  value at `ll_fall_step` for >= HOLD_STEPS steps after it (`reward_hold_steps`); then the entropy or the
  grad norm surges (`surge_step`: first step after `ll_fall_step` at which either exceeds SURGE_FACTOR x
  its median over steps [window, ll_fall_step]); then the reward collapses (surge_step < collapse step).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import statistics
import sys

import pandas as pd

HOLD_FRAC = 0.85
HOLD_LAST = 20
HOLD_STEPS = 30
REWARD_TOL = 0.05
LL_FALL_MIN = 0.01
SURGE_FACTOR = 2.0


def order_of_events(sm: pd.DataFrame, collapse: int | None, window: int) -> dict:
    """The markers of the paper's order of events on smoothed signals `sm` (index = step); see the module doc."""
    end = collapse if collapse is not None else int(sm.index.max())
    ll = sm["ll_correct_mean"].loc[:end].dropna()
    out = {"ll_fall_step": None, "reward_hold_steps": None, "surge_step": None, "surge_signal": None, "paper_order": False}
    if ll.empty:
        return out
    fall = int(ll.idxmax())
    if float(ll.loc[fall:].min()) > float(ll.loc[fall]) - LL_FALL_MIN:
        return out
    out["ll_fall_step"] = fall
    rew = sm["reward_mean"]
    after = rew.loc[fall:]
    dropped = after < float(rew.loc[fall]) - REWARD_TOL
    out["reward_hold_steps"] = (int(dropped.idxmax()) if dropped.any() else int(after.index.max())) - fall
    surges = []
    for col in ("entropy", "grad_norm"):
        base = sm[col].loc[window:fall].median()
        hit = sm[col].loc[fall + 1:] > SURGE_FACTOR * base
        if hit.any():
            surges.append((int(hit.idxmax()), col))
    if surges:
        out["surge_step"], out["surge_signal"] = min(surges)
    out["paper_order"] = bool(collapse is not None and out["reward_hold_steps"] >= HOLD_STEPS
                              and out["surge_step"] is not None and out["surge_step"] < collapse)
    return out


def _mode_rank(mode: str) -> int:
    """Tables list vanilla first, then llds, llds_ma (the store's order of modes, `schema.MODES`), then the rest."""
    from lld_monitor.store.schema import MODES

    return MODES.index(mode) if mode in MODES else len(MODES)


def _first(mask: pd.Series) -> int | None:
    idx = mask[mask].index
    return int(idx[0]) if len(idx) else None


def summarize(store: str, window: int = 10, stopped: bool = False) -> list[dict]:
    from lld_monitor.detect import detect_run, reward_collapse_step
    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    out = []
    for _, run in r.runs().sort_values("name").iterrows():
        if (run.status != "finished" and not stopped) or int(run.steps) < window:
            print(f"skipped {run['name']}: {run.status}, {int(run.steps)} steps", file=sys.stderr)
            continue
        raw = r.signals(run.run_id)
        sig = raw.set_index("step").sort_index().select_dtypes("number")
        sm = sig.rolling(window, min_periods=window).mean()
        rew = sm["reward_mean"]
        peak_step = int(rew.idxmax())
        trough_step = int(rew.loc[peak_step:].idxmin())
        delta = sig["delta_preserved"]
        base_ll = sm["ll_correct_mean"].dropna().iloc[0] if sm["ll_correct_mean"].notna().any() else math.nan
        base_h = sm["entropy"].dropna().iloc[0]
        below = sm["ll_correct_mean"] < base_ll - 0.02
        stays = below & below[::-1].rolling(window, min_periods=1).min()[::-1].astype(bool)
        res = detect_run(raw, forecast=None)
        collapse = reward_collapse_step(raw)
        last20 = float(sig["reward_mean"].iloc[-HOLD_LAST:].mean())
        out.append({
            "seed": _seed(run["name"]), "collapse_step": collapse, "reward_last20": last20,
            "holds": collapse is None and last20 >= HOLD_FRAC * float(rew.loc[peak_step]),
            **order_of_events(sm, collapse, window),
            "run": run["name"] if run.status == "finished" else f"{run['name']} ({run.status} at {int(run.steps)} steps)",
            "run_id": run.run_id, "mode": run["mode"], "steps": int(run.steps),
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


def _seed(name: str) -> int | None:
    m = re.search(r"seed(\d+)", name)
    return int(m.group(1)) if m else None


def goal(rows: list[dict]) -> str:
    """The testbed's goal counted over the runs (module doc): one line per criterion."""
    van = [r for r in rows if r["mode"] == "vanilla"]
    lld = [r for r in rows if r["mode"] == "llds"]
    ma = [r for r in rows if r["mode"] == "llds_ma"]
    lines = [f"vanilla collapses: {sum(r['collapse_step'] is not None for r in van)}/{len(van)}",
             f"vanilla in the paper's order (likelihood falls, reward holds >= {HOLD_STEPS} steps, surge, collapse): "
             f"{sum(r['paper_order'] for r in van)}/{len(van)}",
             f"LLDS holds (no collapse, last {HOLD_LAST} >= {HOLD_FRAC} x peak): {sum(r['holds'] for r in lld)}/{len(lld)}"]
    if ma:
        lines.append(f"LLDS-MA holds: {sum(r['holds'] for r in ma)}/{len(ma)}")
    return "\n".join(lines)


# Issue 28's restated bar, written down before any tuning (`--bar`); one config, seeds paired across arms.
BAR_LLDS_PEAK_FRAC = 0.75  # LLDS's last-20 mean >= this x its own (smoothed) peak ...
BAR_LLDS_PEAK_STRETCH = 0.85  # ... and the stretch goal
BAR_MECHANISM_DELTA = -0.05  # nats per response: LLDS's all-correct groups' mean Δ stays above, vanilla's falls below
BAR_CPU_MINUTES = 5.0


def _a0_correct_delta(store: str) -> dict[str, float]:
    """Per run: the mean same-token Δ (nats per response) of its all-correct groups' responses over the run."""
    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    out = {}
    for _, run in r.runs().iterrows():
        s = r.samples(run.run_id)
        a0 = s[(s.advantage == 0) & (s.reward > 0)]
        out[run["name"]] = float((a0.logp_new_sum - a0.logp_old_sum).mean()) if len(a0) else math.nan
    r.close()
    return out


def _cpu_minutes(store: str) -> dict[str, float]:
    """Per run name: CPU minutes of its trainer process, as scripts/run_spiral_experiment.py recorded them."""
    from pathlib import Path

    path = Path(store).parent / "logs" / "cpu.jsonl"
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["run_name"]] = rec["cpu_s"] / 60
    return out


def bar(rows: list[dict], store: str) -> str:
    """The per-seed table and the counts against issue 28's restated bar (constants above)."""
    by = {(r["mode"], r["seed"]): r for r in rows}
    seeds = sorted({s for m, s in by if m == "vanilla"} & {s for m, s in by if m == "llds"})
    delta = _a0_correct_delta(store)
    cpu = _cpu_minutes(store)
    out = ["| seed | vanilla: collapse (step), last 20, paper order | LLDS: collapse, last 20, x peak | LLDS >= vanilla "
           "| all-correct groups' Δ, vanilla / LLDS | CPU min (vanilla / LLDS) |", "|---|---|---|---|---|---|"]
    counts = {k: 0 for k in ("llds_collapse", "paired", "peak", "stretch", "peak_any", "stretch_any", "van_collapse",
                             "order", "mechanism", "cpu")}
    for s in seeds:
        v, lr = by[("vanilla", s)], by[("llds", s)]
        frac = lr["reward_last20"] / lr["reward_peak"] if lr["reward_peak"] else math.nan
        dv, dl = delta.get(v["run"], math.nan), delta.get(lr["run"], math.nan)
        mech = dl >= BAR_MECHANISM_DELTA > dv
        cv, cl = cpu.get(v["run"]), cpu.get(lr["run"])
        counts["llds_collapse"] += lr["collapse_step"] is not None
        counts["paired"] += lr["reward_last20"] >= v["reward_last20"]
        counts["peak"] += lr["collapse_step"] is None and frac >= BAR_LLDS_PEAK_FRAC
        counts["stretch"] += lr["collapse_step"] is None and frac >= BAR_LLDS_PEAK_STRETCH
        counts["peak_any"] += frac >= BAR_LLDS_PEAK_FRAC
        counts["stretch_any"] += frac >= BAR_LLDS_PEAK_STRETCH
        counts["van_collapse"] += v["collapse_step"] is not None
        counts["order"] += bool(v["paper_order"])
        counts["mechanism"] += mech
        counts["cpu"] += all(c is not None and c <= BAR_CPU_MINUTES for c in (cv, cl))
        out.append(f"| {s} | {v['collapse_step'] if v['collapse_step'] is not None else '–'}, {v['reward_last20']:.2f}, "
                   f"{'yes' if v['paper_order'] else 'no'} | {lr['collapse_step'] if lr['collapse_step'] is not None else '–'}, "
                   f"{lr['reward_last20']:.2f}, {frac:.2f} | {'yes' if lr['reward_last20'] >= v['reward_last20'] else 'no'} "
                   f"| {dv:+.3f} / {dl:+.3f} {'(separates)' if mech else ''} "
                   f"| {'?' if cv is None else f'{cv:.1f}'} / {'?' if cl is None else f'{cl:.1f}'} |")
    n, nc = len(seeds), counts["van_collapse"]
    out += ["", f"over {n} seed pairs:",
            f"- LLDS collapses: {counts['llds_collapse']}/{n} (bar: 0)",
            f"- LLDS last-20 >= its vanilla twin's: {counts['paired']}/{n} (bar: >= 90 %)",
            f"- LLDS last-20 >= {BAR_LLDS_PEAK_FRAC} x its peak: {counts['peak_any']}/{n} (bar: >= 80 %); "
            f">= {BAR_LLDS_PEAK_STRETCH} x: {counts['stretch_any']}/{n} (stretch: >= 90 %)",
            f"  ... and without a collapse: {counts['peak']}/{n}; >= {BAR_LLDS_PEAK_STRETCH} x: {counts['stretch']}/{n}",
            f"- vanilla collapses: {nc}/{n} (bar: >= 70 %)",
            f"- the paper's order among vanilla collapses: {counts['order']}/{nc} (bar: >= 60 %)",
            f"- mechanism (all-correct groups' mean Δ: LLDS >= {BAR_MECHANISM_DELTA} > vanilla): {counts['mechanism']}/{n} "
            "(bar: all)",
            f"- both runs <= {BAR_CPU_MINUTES:g} CPU-minutes: {counts['cpu']}/{n}"]
    return "\n".join(out)


def goal_markdown(rows: list[dict]) -> str:
    """Per run: start -> peak, likelihood-fall step, reward hold, surge, collapse, last-20 mean (the docs' 10-seed table)."""
    rows = sorted(rows, key=lambda r: (_mode_rank(r["mode"]), r["seed"] if r["seed"] is not None else 0, r["run"]))
    out = ["| run | reward start → peak (step) | likelihood falls from (step) | reward holds (steps) | surge (step, signal) "
           "| reward collapse (step) | last 20 | holds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def opt(v):
            return "–" if v is None else str(v)
        surge = "–" if r["surge_step"] is None else f"{r['surge_step']} ({r['surge_signal']})"
        out.append(f"| {r['run']} | {r['reward_start']:.2f} → {r['reward_peak']:.2f} ({r['reward_peak_step']}) "
                   f"| {opt(r['ll_fall_step'])} | {opt(r['reward_hold_steps'])} | {surge} | {opt(r['collapse_step'])} "
                   f"| {r['reward_last20']:.2f} | {'yes' if r['holds'] else 'no'} |")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    from lld_monitor.detect.phases import ACCELERATION, DECAY, STAGNATION

    rows = sorted(rows, key=lambda r: (_mode_rank(r["mode"]), len(r["run"]), r["run"]))
    out = ["| run | reward start → peak (step) | trough (step) | last 10 | Δ preserved < 0 (share of steps, mean nats) "
           "| entropy max | grad-norm max | phases (detector): stagnation / decay / phase III | reward collapse |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ps = r["detector_phase_starts"]
        phases = " / ".join(str(ps.get(k, "–")) for k in (STAGNATION, DECAY, ACCELERATION))
        col = r["detector_collapse_step"]
        out.append(f"| {r['run']} | {r['reward_start']:.2f} → {r['reward_peak']:.2f} ({r['reward_peak_step']}) "
                   f"| {r['reward_trough']:.2f} ({r['reward_trough_step']}) | {r['reward_final']:.2f} "
                   f"| {r['delta_preserved_neg_share']:.0%}, {r['delta_preserved_mean']:+.2f} | {r['entropy_max']:.2f} "
                   f"| {r['grad_norm_max']:.2f} | {phases} | {'–' if col is None else col} |")
    return "\n".join(out)


ERROR_KINDS = ("invalid action", "no search", "wrong first query", "stopped after one search", "wrong second query",
               "no answer", "right searches, wrong entity of the documents", "right searches, answer not in the documents")
ERROR_WINDOWS = (("warm start", 0, 10), ("early", 20, 60), ("late", -50, None))  # warm start: lr still < 10 % of its peak
COPY_ERRORS = ("wrong first query", "wrong second query")  # issue 28's copy-error rate: a query naming the wrong entity
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_INFO = re.compile(r"<information>(.*?)</information>", re.DOTALL)


def error_kind(text: str, question) -> str:
    """The first ERROR_KINDS entry that describes a wrong response to `question` (a world.Question)."""
    from lld_monitor.backend.env import INVALID_MESSAGE
    from lld_monitor.backend.reward import extract_answer, normalize_answer

    if INVALID_MESSAGE in text:
        return "invalid action"
    queries = [normalize_answer(q) for q in _SEARCH.findall(text)]
    if not queries:
        return "no search"
    chain = question.chain
    if queries[0] != normalize_answer(chain[0][0]):
        return "wrong first query"
    if question.hops == 2:
        if len(queries) == 1:
            return "stopped after one search"
        if queries[1] != normalize_answer(chain[1][0]):
            return "wrong second query"
    ans = extract_answer(text)
    if ans is None:
        return "no answer"
    seen = " ".join(_INFO.findall(text))
    inside = f" {normalize_answer(ans)} " in f" {normalize_answer(seen)} "
    return "right searches, wrong entity of the documents" if inside else "right searches, answer not in the documents"


def error_rows(store: str) -> list[dict]:
    """Per finished run and window: the share of wrong responses and of each ERROR_KINDS among them."""
    from lld_monitor.backend.config import config_from_dict
    from lld_monitor.backend.world import build_world
    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    out, worlds = [], {}
    for _, run in r.runs().sort_values("name").iterrows():
        if run.status != "finished":
            continue
        raw = r.run(run.run_id)["config"]
        cfg = config_from_dict(json.loads(raw) if isinstance(raw, str) else raw)
        key = json.dumps(cfg.world.to_dict(), sort_keys=True)
        if key not in worlds:
            worlds[key] = {q.question: q for q in build_world(cfg.world).questions}
        by_text = worlds[key]
        s = r.samples(run.run_id)
        last = int(s.step.max())
        for name, lo, hi in ERROR_WINDOWS:
            lo_, hi_ = (last + 1 + lo, last + 1) if lo < 0 else (lo, hi)
            w = s[(s.step >= lo_) & (s.step < hi_)]
            wrong = w[w.reward <= 0]
            kinds = [error_kind(t, by_text[q]) for t, q in zip(wrong.text, wrong.question)]
            row = {"run": run["name"], "mode": run["mode"], "window_name": name, "window": f"{name} ({lo_}-{hi_ - 1})",
                   "responses": len(w), "wrong": len(wrong) / max(len(w), 1)}
            row.update({k: kinds.count(k) / max(len(kinds), 1) for k in ERROR_KINDS})
            out.append(row)
    r.close()
    return out


GROUP_KINDS = ("A0 correct", "A0 wrong", "Â > 0", "Â < 0")


def group_rows(store: str, block: int = 20) -> list[dict]:
    """Per finished run and block of `block` steps: share and mean Δ of each GROUP_KINDS (module doc)."""
    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    out = []
    for _, run in r.runs().sort_values("name").iterrows():
        if run.status != "finished":
            continue
        s = r.samples(run.run_id)
        s = s.assign(d=s.logp_new_sum - s.logp_old_sum, blk=s.step // block * block,
                     kind=[GROUP_KINDS[0] if a == 0 and w > 0 else GROUP_KINDS[1] if a == 0 else
                           GROUP_KINDS[2] if a > 0 else GROUP_KINDS[3] for a, w in zip(s.advantage, s.reward)])
        for blk, g in s.groupby("blk"):
            row = {"run": run["name"], "mode": run["mode"], "steps": f"{blk}-{blk + block - 1}"}
            for k in GROUP_KINDS:
                gk = g[g.kind == k]
                row[k] = (len(gk) / len(g), float(gk.d.mean()) if len(gk) else math.nan)
            out.append(row)
    r.close()
    return out


def groups_markdown(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: (_mode_rank(r["mode"]), len(r["run"]), r["run"], int(r["steps"].split("-")[0])))
    out = ["| run | steps | " + " | ".join(f"{k}: share, Δ" for k in GROUP_KINDS) + " |", "|---" * (2 + len(GROUP_KINDS)) + "|"]
    for r in rows:
        cells = [f"{r[k][0]:.0%}, " + ("–" if r[k][1] != r[k][1] else f"{r[k][1]:+.3f}") for k in GROUP_KINDS]
        out.append(f"| {r['run']} | {r['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def errors_markdown(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: (_mode_rank(r["mode"]), len(r["run"]), r["run"], r["window"]))
    out = ["| run | window | wrong | " + " | ".join(ERROR_KINDS) + " |", "|---" * (3 + len(ERROR_KINDS)) + "|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['window']} | {r['wrong']:.0%} | "
                   + " | ".join(f"{r[k]:.0%}" for k in ERROR_KINDS) + " |")
    return "\n".join(out)


def copy_error_summary(rows: list[dict]) -> str:
    """Per arm and window: median (range) over runs of the wrong share and of the copy-error rate."""

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0%} ({min(xs):.0%}-{max(xs):.0%})"

    out = ["| arm | window | runs | wrong responses | copy-error rate (of the wrong) | copy errors (of all) |",
           "|---|---|---|---|---|---|"]
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((_mode_rank(r["mode"]), r["mode"], r["window_name"]), []).append(r)
    order = [w for w, _, _ in ERROR_WINDOWS]
    for (_, mode, window), rs in sorted(by.items(), key=lambda kv: (kv[0][0], order.index(kv[0][2]))):
        rate = [sum(r[k] for k in COPY_ERRORS) for r in rs]
        out.append(f"| {mode} | {window} | {len(rs)} | {cell([r['wrong'] for r in rs])} | {cell(rate)} | "
                   f"{cell([x * r['wrong'] for x, r in zip(rate, rs)])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="the run table of docs/backend.md")
    ap.add_argument("--goal", action="store_true", help="the per-run goal table and the counts against the testbed's goal")
    ap.add_argument("--bar", action="store_true", help="the per-seed table and the counts against issue 28's restated bar")
    ap.add_argument("--errors", action="store_true", help="what the wrong responses got wrong, early and late (module doc)")
    ap.add_argument("--groups", action="store_true", help="what each step's updates do to each kind of response (module doc)")
    ap.add_argument("--block", type=int, default=20, help="steps per row of --groups (default 20)")
    ap.add_argument("--stopped", action="store_true",
                    help="also summarize runs stopped before their last step (marked so; their outcome is partial)")
    a = ap.parse_args()
    logging.getLogger("lld_monitor.detect").setLevel(logging.ERROR)  # the replayed alerts are not this table
    if a.errors:
        rows = error_rows(a.store)
        print(errors_markdown(rows))
        print()
        print(copy_error_summary(rows))
        return
    if a.groups:
        print(groups_markdown(group_rows(a.store, a.block)))
        return
    rows = summarize(a.store, a.window, a.stopped)
    if a.bar:
        print(bar(rows, a.store))
        return
    if a.goal:
        print(goal_markdown(rows))
        print()
        print(goal(rows))
        return
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
