"""Where a new tab's time goes: the browser's main thread, sampled while Live health opens in a new tab.

    .venv/bin/python bench/new_tab_profile.py [--store sample_runs] [--run NAME] [--reps 3]

On a fresh `lld-monitor serve` of STORE, a first tab opens the run (so Streamlit's JavaScript is in the browser's
HTTP cache, as in a person's browser); then each repetition opens `/live?run=NAME` in a new tab of the same browser
profile under Chrome's CPU profiler (CDP `Profiler`, 0.5 ms sampling) and records when the script started and
finished (the app's `data-test-script-state`) and when the chart's SVG appeared. Printed: medians over --reps of
the wall time to the chart and of the main thread's sampled time by script (Plotly's chunk, V8's own work as
"(program)", React, ...). What is not "(idle)" is the page's JavaScript work on this machine's CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.browser_check import CHART, launch  # noqa: E402
from bench.common import free_port, machine  # noqa: E402

MARKS = """
window.__marks = {};
new MutationObserver(() => {
  const m = window.__marks, now = performance.now();
  const a = document.querySelector('[data-testid="stApp"]');
  const st = a ? a.getAttribute('data-test-script-state') : null;
  if (st && !m['script ' + st]) m['script ' + st] = now;
  if (!m['chart drawn'] && document.querySelector(%s)) m['chart drawn'] = now;
}).observe(document, {subtree: true, childList: true, attributes: true});
""" % json.dumps(CHART)


def bucket(url: str, fn: str) -> str:
    name = url.rsplit("/", 1)[-1]
    if not name:
        return fn or "(native)"  # (program), (idle), (garbage collector), DOM calls
    return name.split(".", 1)[0] + ".js"  # Streamlit's chunks carry a content hash: PlotlyChart.<hash>.js


def profile(store: str, run: str, reps: int) -> dict:
    from playwright.sync_api import sync_playwright

    from lld_monitor.commands.serve import start_server, stop_server, wait_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}/live?run={run}"
    proc = start_server(store, "127.0.0.1", port, quiet=True)
    walls: list[float] = []
    marks: dict[str, list[float]] = collections.defaultdict(list)
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    try:
        if not wait_ready("127.0.0.1", port, timeout=120, proc=proc):
            raise RuntimeError("lld-monitor serve did not start")
        with sync_playwright() as p:
            browser = launch(p)
            ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            ctx.add_init_script(MARKS)
            first = ctx.new_page()
            first.goto(url)
            first.wait_for_selector(CHART, timeout=120_000)
            first.close()
            for _ in range(reps):
                page = ctx.new_page()
                cdp = ctx.new_cdp_session(page)
                cdp.send("Profiler.enable")
                cdp.send("Profiler.setSamplingInterval", {"interval": 500})
                cdp.send("Profiler.start")
                t0 = time.perf_counter()
                page.goto(url, wait_until="commit")
                page.wait_for_function("() => window.__marks && window.__marks['chart drawn'] && "
                                       "window.__marks['script notRunning']", timeout=120_000, polling=50)
                walls.append(time.perf_counter() - t0)
                prof = cdp.send("Profiler.stop")["profile"]
                for k, v in page.evaluate("window.__marks").items():
                    marks[k].append(v / 1000)
                nodes = {n["id"]: n["callFrame"] for n in prof["nodes"]}
                per: collections.Counter = collections.Counter()
                for sid, dt in zip(prof["samples"], prof["timeDeltas"]):
                    per[bucket(nodes[sid]["url"], nodes[sid]["functionName"])] += dt / 1000
                for k, v in per.items():
                    cpu[k].append(v)
                page.close()
            browser.close()
    finally:
        stop_server(proc)
    med = {k: statistics.median(v + [0.0] * (reps - len(v))) for k, v in cpu.items()}
    return {"wall_s": statistics.median(walls), "marks_s": {k: statistics.median(v) for k, v in marks.items()},
            "cpu_ms": dict(sorted(med.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(REPO / "sample_runs"))
    ap.add_argument("--run", default=None, help="run name or id (default: the store's first vanilla run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    from lld_monitor.store import open_store_reader

    run = a.run
    if run is None:
        with open_store_reader(a.store) as r:
            runs = r.runs()
        van = runs[runs["mode"] == "vanilla"]
        run = str((van if len(van) else runs)["name"].iloc[0])
    res = profile(a.store, run, a.reps)
    m = machine()
    busy = sum(v for k, v in res["cpu_ms"].items() if k != "(idle)")
    print(f"{m.get('cpu_model')} ({m.get('cpus')} cores), store {a.store}, run {run}; medians of {a.reps} new tabs")
    print(f"new tab -> chart drawn and script idle: {res['wall_s']:.2f} s")
    for k, v in sorted(res["marks_s"].items(), key=lambda kv: kv[1]):
        print(f"  {v:6.2f} s  {k}")
    print(f"browser main thread, sampled: {busy:,.0f} ms busy, {res['cpu_ms'].get('(idle)', 0.0):,.0f} ms idle")
    for k, v in list(res["cpu_ms"].items())[: a.top]:
        print(f"  {v:8.0f} ms  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
