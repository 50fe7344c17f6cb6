"""The first look at a long run (issue 30): a 20,000- and a 200,000-step run opened on the dashboard.

    .venv/bin/python bench/first_look.py [--root /tmp/lld_first_look] [--sizes 20000,200000] [--reps 3]
    .venv/bin/python bench/first_look.py --baseline bc39611     # the same figures for that commit, interleaved

Stores (built once with bench/synth_store.py through the real RunWriter, detector online as RunLogger runs it:
alerts + checkpoints): a 200-step run `small` and a vanilla run `big` of N steps (20 samples per step, tokens of
every sample on every N/10-th step: 26 MB at 20,000 steps). Figures, medians of --reps:

- data functions, in this process, each on a fresh StoreReader and detector (a run never opened):
  *first load* = `queries.run_overview` + `figures.live_health_figure` (what the server computes for Live
  health); *zoomed view* = the figure for a 2,000-step window (every point drawn); *refresh* = the overview when
  one step arrived (warm detector); *first load without checkpoints* (an imported or older run: full detector
  replay, 20,000 steps only) and the *next load from the cache* it leaves beside the run.
- the browser (headless Chromium, Playwright, /usr/bin/chromium), each on a fresh `lld-monitor serve`:
  *cold serve -> first chart* (`/live?run=small`, the server warmed up as `lld-monitor serve` does it); then on that warm server *picker switch*: choose `big` in the
  sidebar's run picker of the open tab -> its charts drawn; on another fresh server, after `small`, a *new tab*
  `/live?run=big` -> charts drawn, and a new tab on `small` (what any page pays to load Streamlit and Plotly).
  New tabs open in the same browser profile as the first (Streamlit's JavaScript in its HTTP cache, as in a
  person's browser); *first visit* is `small` in a fresh profile (empty cache), what a first-time visitor pays.

`--baseline REV` exports REV with `git archive` and measures it in subprocesses, alternating with the checkout,
on the same stores (a store newer than REV understands is given to it as a hard-linked copy with the older
version number: v2 only added a table that older code does not read).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.first_look")

ZOOM_STEPS = 2000
VIEW = {"width": 1400, "height": 1000}
CACHE_SIZES = (20_000,)  # full replays at 200,000 steps take ~45 s each: measured at 20,000 only


# ------------------------------------------------------------------ stores (built with the checkout's code)
def build(root: Path, steps: int) -> Path:
    """The store for one size: `small` (200 steps) + `big` (`steps`); reused when it is already there."""
    sys.path.insert(0, str(REPO))
    from bench.synth_store import SynthConfig, write_run
    from lld_monitor.store import open_store_reader

    store = root / f"steps_{steps}"
    if (store / "store.json").exists():
        with open_store_reader(store) as r:
            runs = r.runs()
        if sorted(runs["name"]) == ["big", "small"] and int(runs.set_index("name").loc["big", "steps"]) == steps:
            return store
        shutil.rmtree(store)
    write_run(store, SynthConfig(name="small", steps=200, seed=3))
    write_run(store, SynthConfig(name="big", steps=steps, token_every=max(1, steps // 10), seed=1,
                                 flush_every=200), progress=True)
    return store


def shadow(store: Path, version: int, where: Path) -> Path:
    """A hard-linked copy of `store` whose metadata says `version` (JSON files written anew, never through a link)."""
    dst = where / f"{store.name}_v{version}"
    if dst.exists():
        return dst
    shutil.copytree(store, dst, copy_function=os.link)
    for meta in [dst / "store.json", *dst.glob("runs/*/run.json")]:
        rec = json.loads(meta.read_text())
        rec["schema_version"] = min(int(rec.get("schema_version", version)), version)
        meta.unlink()
        meta.write_text(json.dumps(rec))
    return dst


def without_checkpoints(store: Path, where: Path) -> Path:
    """A hard-linked copy of `store` in which `big` has no detector state (a W&B import, a run of an older version,
    `synth_store.py --single`): its detector_state table and any detector cache are left out."""
    dst = where / f"{store.name}_nockpt"
    if not dst.exists():
        shutil.copytree(store, dst, copy_function=os.link)
    from lld_monitor.store import open_store_reader

    with open_store_reader(dst) as r:
        rid = str(r.runs().set_index("name").loc["big", "run_id"])
    run = dst / "runs" / rid
    for sub in ("detector_state", "detector_cache"):
        shutil.rmtree(run / sub, ignore_errors=True)
    for manifest in run.glob("manifest-*.json"):  # written anew, never through the link
        rec = json.loads(manifest.read_text())
        if rec.get("segments", {}).pop("detector_state", None) is not None:
            manifest.unlink()
            manifest.write_text(json.dumps(rec))
    return dst


# ------------------------------------------------------------------ measuring (runs against whichever code is on sys.path)
def _ms(fn, reps: int, setup=None) -> float:
    """Median wall time in ms; one repetition only when it takes over 10 s (a full replay of 200,000 steps)."""
    times: list[float] = []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - t0) * 1000)
        if times[0] > 10_000:
            break
    return statistics.median(times)


def data_timings(store: Path, reps: int, with_cache: bool) -> dict[str, float | None]:
    import pandas as pd

    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import figures, queries
    from lld_monitor.ui import phase_bands as ph

    logging.getLogger("lld_monitor").setLevel(logging.ERROR)
    with open_store_reader(store) as r0:
        runs = queries.runs_table(r0)
        row = runs[runs["name"] == "big"].iloc[0].to_dict()
        row = {k: (None if v is pd.NA or v is pd.NaT else v) for k, v in row.items()}
        rid = str(row["run_id"])
        sigs = r0.signals(rid)
        ov0 = queries.run_overview(r0, rid, run=row)
    n = int(sigs["step"].max())
    zoom = (n // 2, n // 2 + ZOOM_STEPS - 1)
    can_zoom = "step_range" in inspect.signature(figures.live_health_figure).parameters
    out: dict[str, float | None] = {}

    def first_load(_):
        with open_store_reader(store) as r:
            ov = queries.run_overview(r, rid, tracker=ph.DetectionTracker(), run=row)
            figures.live_health_figure(ov.signals, ov.bands, ph.filter_alerts(ov.alerts), 0.6, run_label="big",
                                       phase_ii_step=ov.phase_ii_step)

    def overview_only(_):
        with open_store_reader(store) as r:
            queries.run_overview(r, rid, tracker=ph.DetectionTracker(), run=row)

    out["first load (overview + figure)"] = _ms(first_load, reps)
    out["  of which overview (store + detector)"] = _ms(overview_only, reps)
    alerts = ph.filter_alerts(ov0.alerts)
    out["  of which figure"] = _ms(lambda _: figures.live_health_figure(ov0.signals, ov0.bands, alerts, 0.6), reps)
    out[f"zoomed view ({ZOOM_STEPS:,} steps, every point)"] = _ms(
        lambda _: figures.live_health_figure(ov0.signals, ov0.bands, alerts, 0.6, step_range=zoom), reps) \
        if can_zoom else None

    def refresh_setup():
        tr = ph.DetectionTracker()
        tr.update(sigs.iloc[:-1])  # warm: every step but the newest
        return tr, open_store_reader(store)

    def refresh(arg):
        tr, r = arg
        queries.run_overview(r, rid, tracker=tr, run=row)
        r.close()

    out["refresh (one new step, warm detector)"] = _ms(refresh, reps, setup=refresh_setup)
    if with_cache:
        out.update(_uncheckpointed(store, rid, row, reps))
    return out


def _uncheckpointed(store: Path, rid: str, row: dict, reps: int) -> dict[str, float | None]:
    """An imported / older run: no usable checkpoint. The first load replays it (and caches the result beside the
    run); the next reader restores the cache. The run's own checkpoints are hidden from the reader."""
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import phase_bands as ph
    from lld_monitor.ui import queries

    cache_dir = store / "runs" / rid / "detector_cache"

    class NoCheckpoints:
        def __init__(self):
            self.r = open_store_reader(store)

        def __getattr__(self, name):
            return getattr(self.r, name)

        def detector_state(self, run_id):  # what an imported run has: at most the cache a first load left
            ck = self.r.detector_state(run_id)
            return ck[ck["lineage"].astype(str).str.startswith("cache")].reset_index(drop=True)

    def fresh():
        shutil.rmtree(cache_dir, ignore_errors=True)
        return NoCheckpoints()

    def load(r):
        queries.run_overview(r, rid, tracker=ph.DetectionTracker(), run=row)

    out: dict[str, float | None] = {"first load without checkpoints (full replay, cached after)": _ms(load, reps, fresh)}
    has_cache = hasattr(ph, "CACHE_MIN_ROWS")
    if has_cache:
        load(fresh())  # leaves the cache
        out["next load of that run (from the cache beside it)"] = _ms(load, reps, NoCheckpoints)
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def browser_timings(store: Path, big_steps: int) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    from bench.browser_check import APP_IDLE, CHART, launch
    from lld_monitor.commands.serve import start_server, stop_server, wait_ready

    def free_port() -> int:  # not bench.common's: a --baseline worker imports bench from REV, which may lack it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def shows(page, steps: int, timeout_s: float = 600) -> None:
        """Wait until the page shows the run with `steps` steps, its chart drawn and the script idle."""
        deadline = time.perf_counter() + timeout_s
        want = str(steps)
        while time.perf_counter() < deadline:
            vals = page.locator('[data-testid="stMetricValue"]').all_inner_texts()
            if want in [v.replace(",", "").strip() for v in vals] and page.locator(CHART).count() \
                    and page.locator(APP_IDLE).count():
                return
            page.wait_for_timeout(20)
        raise TimeoutError(f"the page did not show the {steps}-step run")

    out: dict[str, float] = {}
    views = ("picker", "new tab") + (("fresh profile, no checkpoints",) if big_steps in CACHE_SIZES else ())
    for first_view in views:
        if first_view.startswith("fresh"):
            store = without_checkpoints(store, store.parent)  # (a cache an earlier round left is removed again)
        pt = free_port()
        t0 = time.perf_counter()
        proc = start_server(store, "127.0.0.1", pt, quiet=True, open_run="small")  # its warm-up opens small
        try:
            # outside Playwright: its sync API runs an event loop in this thread, and warm_up needs asyncio.run
            wait_ready("127.0.0.1", pt, timeout=120, proc=proc)
            with sync_playwright() as p:
                browser = launch(p)
                try:
                    # one browser profile, as a person has: a new tab shares the HTTP cache of the first
                    ctx = browser.new_context(viewport=VIEW)
                    page = ctx.new_page()
                    page.goto(f"http://127.0.0.1:{pt}/live?run=small", wait_until="domcontentloaded")
                    shows(page, 200)
                    if first_view.startswith("fresh"):
                        # issue 37: a new tab in a fresh browser profile (empty cache) on a long run that has no
                        # checkpoints (charts first, its detector replayed in the background), against the same on
                        # the 200-step run
                        for name, run, steps in (
                                ("fresh profile, new tab on the 200-step run (s)", "small", 200),
                                ("fresh profile, new tab on big without checkpoints -> charts (s)", "big", big_steps)):
                            page.close()
                            page = browser.new_context(viewport=VIEW).new_page()
                            t1 = time.perf_counter()
                            page.goto(f"http://127.0.0.1:{pt}/live?run={run}", wait_until="domcontentloaded")
                            shows(page, steps)
                            out[name] = time.perf_counter() - t1
                        t1 = time.perf_counter()
                        deadline = t1 + 120
                        while page.get_by_text("are being computed", exact=False).count() \
                                and time.perf_counter() < deadline:
                            page.wait_for_timeout(50)
                        out["  then phases, alerts and forecast filled in after (s)"] = time.perf_counter() - t1
                    elif first_view == "picker":
                        out["cold serve -> first chart (s)"] = time.perf_counter() - t0
                        page.get_by_role("combobox", name="Run").click()  # the sidebar's run picker
                        page.get_by_role("option").first.wait_for()
                        t1 = time.perf_counter()
                        page.get_by_role("option").filter(has_text="big").first.click()
                        shows(page, big_steps)
                        out["warm server, picker switch to big -> charts (s)"] = time.perf_counter() - t1
                    else:
                        for name, run, steps, context in (
                                ("warm server, new tab /live?run=big -> charts (s)", "big", big_steps, ctx),
                                ("  new tab on the 200-step run (page + Plotly load) (s)", "small", 200, ctx),
                                ("  first visit, empty browser cache, on the 200-step run (s)", "small", 200,
                                 browser.new_context(viewport=VIEW))):
                            page.close()
                            page = context.new_page()
                            t1 = time.perf_counter()
                            page.goto(f"http://127.0.0.1:{pt}/live?run={run}", wait_until="domcontentloaded")
                            shows(page, steps)
                            out[name] = time.perf_counter() - t1
                    page.close()
                finally:
                    browser.close()
        finally:
            stop_server(proc)
    return out


def worker(code: Path, store: Path, big_steps: int, reps: int, browser: bool) -> dict:
    """One measurement of `code` (a checkout) on `store`, in this process."""
    sys.path.insert(0, str(code))
    sys.path.insert(1, str(REPO))  # bench.browser_check from this checkout
    res = data_timings(store, reps, with_cache=big_steps in CACHE_SIZES)
    if browser:
        res.update(browser_timings(store, big_steps))
    return res


# ------------------------------------------------------------------ driver
def _run_worker(code: Path, store: Path, big_steps: int, reps: int, browser: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(code), "--store", str(store),
                        "--big-steps", str(big_steps), "--reps", str(reps), "--out-json", f.name]
                       + ([] if browser else ["--no-browser"]), check=True, env=env, cwd=code)
        return json.loads(Path(f.name).read_text())


def _schema_version(code: Path) -> int:
    text = (code / "lld_monitor" / "store" / "schema.py").read_text()
    return int(text.split("SCHEMA_VERSION = ", 1)[1].split()[0])


def measure(sizes: list[int], root: Path, reps: int, rounds: int, browser: bool, baseline: str | None) -> dict:
    """{size: {"ours": {figure: median}, "baseline": {...}}}; with a baseline, checkout and baseline alternate."""
    root.mkdir(parents=True, exist_ok=True)
    from bench.common import export_revision

    base_code = export_revision(baseline, root / f"code-{baseline}", REPO) if baseline else None
    result: dict = {}
    for n in sizes:
        store = build(root, n)
        codes = [("ours", REPO, store)]
        if base_code is not None:
            bv = _schema_version(base_code)
            codes.append(("baseline", base_code, shadow(store, bv, root) if bv < _schema_version(REPO) else store))
        runs: dict[str, list[dict]] = {k: [] for k, _, _ in codes}
        for i in range(rounds):
            for label, code, st in (codes if i % 2 == 0 else codes[::-1]):
                log.info("%s steps: %s, round %d", n, label, i + 1)
                runs[label].append(_run_worker(code, st, n, reps, browser))
        result[n] = {k: {f: statistics.median([v[f] for v in vs if v.get(f) is not None])
                         if any(v.get(f) is not None for v in vs) else None for f in vs[0]} for k, vs in runs.items()}
    return result


def to_markdown(result: dict, meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['cpu']} ({meta['cpus']} cores), "
             f"`python bench/first_look.py {meta['args']}`; medians.", ""]
    has_base = any("baseline" in v for v in result.values())
    head = "| figure | " + " | ".join((f"{n:,} steps: before | after" if has_base else f"{n:,} steps") for n in result) + " |"
    lines += [head, "|---" * (1 + len(result) * (2 if has_base else 1)) + "|"]
    figs = list(dict.fromkeys(f for v in result.values() for f in v["ours"]))
    for f in figs:
        cells = []
        for v in result.values():
            for k in (("baseline", "ours") if has_base else ("ours",)):
                x = v.get(k, {}).get(f)
                unit = "" if f.endswith("(s)") else " ms"
                cells.append("n/a" if x is None else (f"{x:.2f} s" if f.endswith("(s)") else f"{x:,.0f}{unit}"))
        lines.append(f"| {f.replace(' (s)', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/lld_first_look")
    ap.add_argument("--sizes", default="20000,200000")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each data function per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each a fresh process, and fresh servers)")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--baseline", default=None, help="a git revision measured alternately with the checkout")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--big-steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out-json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.worker:
        res = worker(Path(a.worker), Path(a.store), a.big_steps, a.reps, not a.no_browser)
        Path(a.out_json).write_text(json.dumps(res))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.common import machine

    sizes = [int(x) for x in a.sizes.split(",")]
    result = measure(sizes, Path(a.root), a.reps, a.rounds, not a.no_browser, a.baseline)
    m = machine()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": m.get("cpu_model", "?"),
            "cpus": m.get("cpus"), "loadavg_at_start": m.get("loadavg_at_start"),
            "args": " ".join(sys.argv[1:] if argv is None else argv)}
    md = to_markdown(result, meta)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "result": {str(k): v for k, v in result.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
