"""The post-mortem's data at 100M token rows, this checkout against a git revision, interleaved (issue 30).

    .venv/bin/python bench/post_mortem_cost.py [--store /tmp/lld_bench_stores/tokens_100M] [--baseline REV]
                                                [--rounds 3] [--reps 5]

The store is the `queries` group's 100M store (20,000 steps, tokens on every step; built here on first use, as
`python -m bench --sizes 100` builds it). Each round runs the checkout and REV (exported with `git archive`) in
fresh processes, in alternating order, on the same store: the token-logged step list (`token_steps`) and the
post-mortem drawn before its onsets (`queries.post_mortem(..., with_onsets=False)` with a warm detector: the
README's row), each on a fresh reader per repetition, so nothing is cached. Printed: medians over rounds of the
per-round medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(store: Path, reps: int) -> dict[str, float]:
    """Runs with REV's lld_monitor first on sys.path, so it uses only the reader and query API both sides have
    (not bench.dashboard_queries' helpers, which an older REV lacks)."""
    import pandas as pd

    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import phase_bands as phases
    from lld_monitor.ui import queries as q

    with open_store_reader(store) as r0:
        runs = q.runs_table(r0)
        van = runs[runs["mode"] == "vanilla"]["run_id"].iloc[0]
        sigs = r0.signals(van)
    row = {k: (None if v is None or v is pd.NA else v) for k, v in runs[runs["run_id"] == van].iloc[0].to_dict().items()}
    tracker = phases.DetectionTracker()
    tracker.update(sigs)
    calls = {"token steps list (token_steps)": lambda r: r.token_steps(van),
             "post-mortem (warm detector), drawn before its onsets":
                 lambda r: q.post_mortem(r, van, tracker=tracker, run=row, with_onsets=False)}
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            r = open_store_reader(store)
            t = time.perf_counter()
            fn(r)
            out[name].append((time.perf_counter() - t) * 1000)
            r.close()
    return {k: statistics.median(v) for k, v in out.items()}


def _run(code: Path, store: Path, reps: int) -> dict[str, float]:
    cmd = [sys.executable, str(REPO / "bench" / "post_mortem_cost.py"), "--worker", str(code), "--store", str(store),
           "--reps", str(reps)]
    res = subprocess.run(cmd, cwd=code, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/tmp/lld_bench_stores/tokens_100M")
    ap.add_argument("--baseline", default=None, help="a git revision measured alternately with the checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    store = Path(a.store)
    if a.worker:
        sys.path.insert(0, a.worker)  # the code under test, ahead of this checkout
        print(json.dumps(worker(store, a.reps)))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.common import export_revision, machine
    from bench.dashboard_queries import build

    build(store, steps=20_000)
    codes = [("ours", REPO)]
    if a.baseline:
        codes.append((a.baseline, export_revision(a.baseline, Path(f"/tmp/lld-post-mortem-{a.baseline}"), REPO)))
    got: dict[str, list[dict[str, float]]] = {k: [] for k, _ in codes}
    for i in range(a.rounds):
        for label, code in (codes if i % 2 == 0 else codes[::-1]):
            got[label].append(_run(code, store, a.reps))
    m = machine()
    print(f"{m.get('cpu_model')} ({m.get('cpus')} cores), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"store {store}; medians of {a.rounds} rounds x {a.reps} cold repetitions")
    names = list(got["ours"][0])
    print("| figure | " + " | ".join(label for label, _ in codes) + " |")
    print("|---" * (1 + len(codes)) + "|")
    for n in names:
        print(f"| {n} | " + " | ".join(f"{statistics.median(r[n] for r in got[label]):,.1f} ms" for label, _ in codes)
              + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
