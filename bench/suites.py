"""Adapters: each room's benchmark script, run as one group of the `python -m bench` table.

The scripts stay runnable on their own (they print more detail); these functions call the same
measuring functions and return `Figure` rows.
"""

from __future__ import annotations

import logging
import statistics

import numpy as np

from bench.common import Figure

log = logging.getLogger(__name__)


def ingest(steps: int = 100, reps: int = 3) -> list[Figure]:
    """Writer token rows/s vs a raw DuckDB Arrow insert of the same rows; log_step latency on the caller thread."""
    from bench import logger_bench as lb

    rng = np.random.default_rng(0)
    writer, raw, pipeline, lat, lat95 = [], [], [], [], []
    for _ in range(reps):
        tables = lb.token_tables(steps, rng)
        writer.append(lb.bench_writer(tables))
        raw.append(lb.bench_duckdb(tables))
        # throughput: steps back to back (the writer thread's pace); latency: inside a loop with a 50 ms
        # training step, as the caller sees it (the sleep releases the GIL like torch kernels do)
        pipeline.append(lb.bench_logger(steps, False, rng)["rows_s_flushed"])
        r = lb.bench_logger(steps, False, rng, gap_s=0.05)
        lat.append(r["lat_median_ms"])
        lat95.append(r["lat_p95_ms"])
    w, d, p = (statistics.median(x) for x in (writer, raw, pipeline))
    return [
        Figure("ingest", "RunWriter token rows/s (Arrow batches, flush every 10 steps, finish)", w, "rows/s",
               baseline=d, baseline_name="raw DuckDB INSERT of the same Arrow rows into a .duckdb file",
               goal="ratio >= 0.5 (within 2x)", met=w / d >= 0.5, reps=reps, higher_is_better=True),
        Figure("ingest", "RunLogger pipeline token rows/s (numpy in, flushed)", p, "rows/s", baseline=d,
               baseline_name="raw DuckDB INSERT of the same Arrow rows", goal="ratio >= 0.5 (within 2x)",
               met=p / d >= 0.5, reps=reps, higher_is_better=True),
        Figure("ingest", f"log_step latency, {lb.N} samples x {lb.T} tokens, in a loop with a 50 ms step",
               statistics.median(lat), "ms", reps=reps, notes=f"p95 {statistics.median(lat95):.2f} ms"),
    ]


def queries(sizes_m: tuple[int, ...] = (1, 10), reps: int = 5, root: str = "/tmp/lld_bench_stores") -> list[Figure]:
    """The dashboard's data functions on generated stores of 1M / 10M (/ 100M) token rows.

    Each store holds a vanilla run with tokens on every step (20 samples x 250 tokens = 5,000 token rows
    per step, so 1M rows = 200 steps) and its LLDS twin without tokens, written through RunWriter.
    The baseline of each row is the same function on the smallest store, measured in the same run, so
    "ours better by" < 1 shows how the time grows with the store (1.0 = flat).
    """
    from pathlib import Path

    from bench import dashboard_queries as dq

    timings: dict[int, dict[str, float]] = {}
    for m in sorted(sizes_m):
        store = Path(root) / f"tokens_{m}M"
        dq.build(store, steps=m * 200)
        timings[m] = dq.page_timings(store, reps)
    smallest = min(timings)
    figs = []
    for m, t in timings.items():
        for name, ms in t.items():
            if name.startswith("  "):
                continue  # the breakdown rows stay in the script's own output
            goal = dq.GOALS_MS.get(name) if m == max(timings) else None  # the goals hold at the largest store
            figs.append(Figure(
                "queries", f"{name} @ {m}M token rows", ms, "ms",
                baseline=timings[smallest][name] if m != smallest else None,
                baseline_name=f"same function @ {smallest}M token rows" if m != smallest else "",
                goal=f"< {goal:.0f} ms" if goal else "", met=(ms < goal) if goal else None,
                reps=reps,
            ))
    return figs


def end_to_end(steps: int = 5, reps: int = 2) -> list[Figure]:
    """Backend seconds per step, default config, token logging on vs off (same seed, same episodes)."""
    import tempfile
    from dataclasses import replace

    from bench.backend_step import time_steps
    from lld_monitor.backend.config import TrainConfig

    base = TrainConfig()
    on = replace(base, log=replace(base.log, token_every=1))
    off = replace(base, log=replace(base.log, token_every=0))
    res: dict[str, list] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(reps):
            order = (("off", off), ("on", on)) if rep % 2 == 0 else (("on", on), ("off", off))
            for label, cfg in order:
                res[label] += time_steps(cfg, d, f"bench-{label}-{rep}", steps)
    figs = []
    for i, what in ((0, "wall"), (1, "process CPU")):
        m_on = statistics.median(t[i] for t in res["on"])
        m_off = statistics.median(t[i] for t in res["off"])
        figs.append(Figure(
            "end-to-end", f"backend step ({what} s), default config, token logging on vs off", m_on, "s",
            baseline=m_off, baseline_name="same step, token logging off", goal="on/off <= 1.03",
            met=m_on / m_off <= 1.03, reps=len(res["on"]),
            notes=f"{base.grpo.prompts_per_step} prompts x {base.grpo.group_size} rollouts",
        ))
    return figs


def lld_overhead(reps: int = 7) -> list[Figure]:
    """The LLDS term's cost on a GRPO forward+backward (bench/lld_overhead.py, run in a subprocess)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "lld.json"
        subprocess.run([sys.executable, "bench/lld_overhead.py", "--reps", str(reps), "--json", str(out)],
                       check=True, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    return _lld_figures(data, reps)


def _lld_figures(data: dict, reps: int) -> list[Figure]:
    cpu = data["median_cpu_s"]
    figs = []
    for k in cpu:
        if k == "vanilla":
            continue
        figs.append(Figure(
            "lld", f"GRPO forward+backward with the {k} term (process CPU)", cpu[k], "s", baseline=cpu["vanilla"],
            baseline_name="same step, plain GRPO loss", reps=reps,
            notes=f"{data['model']}; paired ratio {data['paired_ratio_cpu_vs_vanilla'][k]:.3f}; the term alone "
                  f"{data['term_only_median_cpu_ms'][k]:.2f} ms = {100 * data['term_only_over_vanilla_cpu'][k]:.2f}% of the step",
        ))
    return figs


def scale(sizes: tuple[int, ...] = (20_000, 200_000), reps: int = 3, rounds: int = 3,
          root: str = "/tmp/lld_first_look") -> list[Figure]:
    """The first look at a long run (issue 30; bench/first_look.py): data functions and the browser, per size."""
    from pathlib import Path

    from bench import first_look as fl

    goals_s = {"cold serve -> first chart (s)": {n: 5.0 for n in sizes},
               "warm server, picker switch to big -> charts (s)": {20_000: 1.5, 200_000: 3.0},
               "warm server, new tab /live?run=big -> charts (s)": {20_000: 1.5, 200_000: 3.0}}
    result = fl.measure(list(sizes), Path(root), reps, rounds, browser=True, baseline=None)
    figs = []
    for n, by in result.items():
        for name, v in by["ours"].items():
            if v is None:
                continue
            seconds = name.endswith("(s)")
            goal = goals_s.get(name, {}).get(n)
            figs.append(Figure("scale", f"{name.replace(' (s)', '').strip()} @ {n:,} steps", v, "s" if seconds else "ms",
                               goal=f"< {goal:g} s" if goal else "", met=(v < goal) if goal else None,
                               reps=rounds if seconds else reps * rounds))
    return figs
