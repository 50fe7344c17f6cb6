"""Dashboard data-function timings on a large store, and time from `serve` start to the first chart in Chromium.

    .venv/bin/python bench/dashboard_queries.py [--store /tmp/lld_bench_store] [--reps 5] [--no-browser]

The store (built once, then reused): a vanilla run of 2,000 steps x 20 samples x 250 tokens = 10,000,000
token rows, and its LLDS twin (2,000 steps, samples, no tokens), written through RunWriter. Each page's
data function is what the page calls (lld_monitor.ui.queries), timed cold: a fresh StoreReader per repetition
(opened untimed), so the reader's per-segment-list result cache never hits (the app's repeat views are faster).
Figures printed: median of --reps runs; baseline = the same functions on a small store (200 steps, 100k
token rows) measured in the same run, so the ratio shows how the times scale with the store.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synth_store import SynthConfig, write_run  # noqa: E402
from lld_monitor.store import open_store_reader  # noqa: E402
from lld_monitor.ui import figures  # noqa: E402
from lld_monitor.ui import phase_bands as phases  # noqa: E402
from lld_monitor.ui import queries as q  # noqa: E402
from lld_monitor.ui import series as sig  # noqa: E402

GOALS_MS = {"live health (overview), refresh": 150.0, "token inspector (new step picked)": 300.0,
            "post-mortem (warm detector), drawn before its onsets": 300.0}


def build(store: Path, steps: int, action_tokens=(100, 90), tool_tokens=60, flush_every=50) -> None:
    if (store / "store.json").exists():
        with open_store_reader(store) as r:
            runs = r.runs()
            # reused only when built as RunLogger writes runs today: with the detector's checkpoints
            ok = len(runs) == 2 and (runs["steps"] == steps).all() and all(
                len(r.detector_state(rid)) for rid in runs["run_id"])
        if ok:
            return
        shutil.rmtree(store)
    # the online detector runs as in RunLogger: alerts and state checkpoints stored with the run
    common = dict(steps=steps, groups=4, group_size=5, action_tokens=action_tokens, tool_tokens=tool_tokens,
                  flush_every=flush_every, write_alerts=True)
    write_run(store, SynthConfig(name="bench-vanilla", mode="vanilla", token_every=1, seed=1, **common), progress=True)
    write_run(store, SynthConfig(name="bench-llds", mode="llds", token_every=0, seed=2, **common), progress=True)


def median_ms(fn, reps: int, setup=None) -> tuple[float, float]:
    """(median, first) wall time in ms; `setup` runs before each repetition, untimed."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), times[0]


class Fresh:
    """A new StoreReader per repetition (opened untimed): every query is cold, as after the run grew or when
    the user picks a step not seen before (the reader caches results per segment list)."""

    def __init__(self, store: Path):
        self.store, self.r = store, None

    def __call__(self) -> None:
        if self.r is not None:
            self.r.close()
        self.r = open_store_reader(self.store)


def page_timings(store: Path, reps: int) -> dict[str, float]:
    """Cold timings (fresh reader per repetition, so the reader's result cache never hits)."""
    import pandas as pd

    from lld_monitor.ui.tokens import token_html

    with open_store_reader(store) as r0:
        runs = q.runs_table(r0)
        van = runs[runs["mode"] == "vanilla"]["run_id"].iloc[0]
        twin = runs[runs["mode"] == "llds"]["run_id"].iloc[0]
        sigs = r0.signals(van)
        tsteps = q.token_steps(r0, van)
        ov = q.run_overview(r0, van)
        tv = q.token_view(r0, van, step=tsteps[len(tsteps) // 2], steps=tsteps)
    row = {k: (None if v is None or v is pd.NA else v) for k, v in runs[runs["run_id"] == van].iloc[0].to_dict().items()}
    f = Fresh(store)
    out: dict[str, float] = {}

    # live health, a refresh tick: the warm detector has seen all steps but the newest (the page's steady
    # state while a run is live); the run row comes from the sidebar's runs table
    tr = phases.DetectionTracker()

    def refresh_setup() -> None:
        f()
        tr._reset()  # noqa: SLF001 - the benchmark rewinds the tracker by one step
        tr.update(sigs.iloc[:-1])

    out["live health (overview), refresh"] = median_ms(lambda: q.run_overview(f.r, van, tracker=tr, run=row), reps,
                                                       setup=refresh_setup)[0]
    out["live health (overview), first load (detector restored from the run's checkpoints)"] = median_ms(
        lambda: q.run_overview(f.r, van, run=row, tracker=phases.DetectionTracker()), reps, setup=f)[0]
    out["  of which signals()"] = median_ms(lambda: f.r.signals(van), reps, setup=f)[0]
    out["full detector replay instead (a run without checkpoints; once, then cached)"] = median_ms(
        lambda: phases.detect(sigs), min(reps, 2))[0]
    out["live health figure build"] = median_ms(lambda: figures.live_health_figure(ov.signals, ov.bands, ov.alerts, 0.6), reps)[0]
    out["sidebar (runs table)"] = median_ms(lambda: q.runs_table(f.r), reps, setup=f)[0]
    out["compare runs (2 runs, 6 signals)"] = median_ms(
        lambda: q.compare_frames(f.r, [van, twin], list(sig.COMPARE_DEFAULT)), reps, setup=f)[0]
    picks = iter([tsteps[int(len(tsteps) * x)] for x in (0.1, 0.3, 0.5, 0.7, 0.9)] * (reps // 5 + 1))
    out["token inspector (new step picked)"] = median_ms(
        lambda: q.token_view(f.r, van, step=next(picks), which="all", sort="delta_asc", steps=tsteps), reps, setup=f)[0]
    out["  token steps list (once per run version)"] = median_ms(lambda: q.token_steps(f.r, van), reps, setup=f)[0]
    out["  token view build (html + 2 figures)"] = median_ms(
        lambda: (figures.role_delta_distribution(tv.step_tokens), figures.token_delta_figure(tv.tokens),
                 token_html(tv.tokens, "delta")), reps)[0]
    tr2 = phases.DetectionTracker()
    tr2.update(sigs)
    out["post-mortem (warm detector), drawn before its onsets"] = median_ms(
        lambda: q.post_mortem(f.r, van, tracker=tr2, run=row, with_onsets=False), reps, setup=f)[0]
    ref = q.post_mortem(f.r, van, tracker=tr2, run=row, with_onsets=False).reference_step
    out["post-mortem onsets (change points; once per run version, then cached)"] = median_ms(
        lambda: q.onsets(f.r, van, ref), min(reps, 2), setup=f)[0]
    f.r.close()
    return out


def serve_to_first_chart(store: Path, reps: int) -> tuple[list[float], list[float]]:
    from bench.browser_check import time_to_first_chart
    from bench.common import free_port
    from lld_monitor.commands.serve import start_server, stop_server, wait_ready

    out, ready = [], []
    for _ in range(reps):
        port = free_port()
        t0 = time.perf_counter()
        proc = start_server(store, "127.0.0.1", port, quiet=True)
        try:
            wait_ready("127.0.0.1", port, timeout=120, proc=proc)
            ready.append(time.perf_counter() - t0)
            out.append(time_to_first_chart(f"http://127.0.0.1:{port}", t0))
        finally:
            stop_server(proc)
    return out, ready


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/tmp/lld_bench_store")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--browser-reps", type=int, default=3)
    ap.add_argument("--no-browser", action="store_true")
    a = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    big, small = Path(a.store), Path(a.store + "_small")
    t = time.perf_counter()
    build(big, a.steps)
    build(small, a.steps // 10, action_tokens=(10, 9), tool_tokens=6)
    with open_store_reader(big) as r:
        n_tok = int(r.sql("SELECT count(*) AS n FROM tokens")["n"].iloc[0])
        n_steps = r.runs()["steps"].tolist()
    print(f"store {big}: token rows {n_tok:,}, steps per run {n_steps} (ready in {time.perf_counter() - t:.0f} s)")
    base = page_timings(small, a.reps)
    res = page_timings(big, a.reps)
    print(f"\n{'cold data function (median of %d, ms)' % a.reps:<58}{'10M store':>10}{'small':>9}{'ratio':>7}{'goal':>7}")
    for k, v in res.items():
        goal = GOALS_MS.get(k)
        print(f"{k:<58}{v:>10.1f}{base[k]:>9.1f}{v / base[k] if base[k] else float('nan'):>7.1f}"
              f"{'' if goal is None else ('%.0f' % goal):>7}{'' if goal is None else ('  OK' if v < goal else '  MISSED')}")
    if not a.no_browser:
        print()
        for label, path in (("10M store", big), ("small store", small)):
            ts, ready = serve_to_first_chart(path, a.browser_reps)
            print(f"serve start -> first Plotly chart drawn in Chromium ({label}): median {statistics.median(ts):.1f} s "
                  f"over {len(ts)} runs ({', '.join(f'{x:.1f}' for x in ts)}); "
                  f"of which server up (health endpoint): median {statistics.median(ready):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
