"""`python -m bench` (or `lld-monitor bench`): every benchmark of the project, one table.

Each figure is ours vs a baseline measured in the same run (medians of several repetitions); the
table is printed and written as JSON (and Markdown) with the date and the machine.

    python -m bench [--only logging,ingest] [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Figure, machine  # noqa: E402

log = logging.getLogger("bench")

# group -> (module, kwargs for a full run, kwargs for --quick)
SUITES: dict[str, tuple[str, dict, dict]] = {
    "logging": ("bench.logging_vs_wandb", {"steps": 30}, {"steps": 8}),
    "ingest": ("bench.suites", {"steps": 100, "reps": 3}, {"steps": 20, "reps": 1}),
    "queries": ("bench.suites", {"sizes_m": (1, 10), "reps": 5}, {"sizes_m": (1,), "reps": 2}),
    "end-to-end": ("bench.suites", {"steps": 5, "reps": 2}, {"steps": 2, "reps": 1}),
    "lld": ("bench.suites", {"reps": 7}, {"reps": 2}),
    "scale": ("bench.suites", {"sizes": (20_000, 200_000), "reps": 3, "rounds": 3},
              {"sizes": (20_000,), "reps": 1, "rounds": 1}),
    # a store in a bucket vs the same store in a folder (SeaweedFS on loopback behind a +20 ms proxy, or --store)
    "bucket": ("bench.bucket_bench", {"reps": 5}, {"reps": 2, "first_look_steps": 2_000, "log_steps": 20}),
}
# groups whose run function is not called `run`
ENTRY = {"ingest": "ingest", "queries": "queries", "end-to-end": "end_to_end", "lld": "lld_overhead",
         "scale": "scale"}


def fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x == 0 or 0.01 <= abs(x) < 100000:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:.3g}"


def to_markdown(figs: list[Figure], meta: dict) -> str:
    lines = [
        f"Measured {meta['date']} on {meta['machine'].get('cpu_model', '?')} "
        f"({meta['machine'].get('cpus')} cores, {meta['machine'].get('memory_gib', '?')} GiB), "
        f"`python -m bench{' --quick' if meta['quick'] else ''}`.",
        "",
        "| group | figure | ours | baseline | baseline is | ours better by (x) | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        met = "" if f.met is None else ("yes" if f.met else "**no**")
        lines.append(
            f"| {f.group} | {f.name} | {fmt(f.ours)} {f.unit} | {fmt(f.baseline)}{' ' + f.unit if f.baseline is not None else ''} "
            f"| {f.baseline_name} | {fmt(f.ratio)} | {f.goal} | {met} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated groups out of: {', '.join(SUITES)}")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sizes (a smoke run)")
    p.add_argument("--out", default="bench/results", help="folder for bench.json and bench.md")
    p.add_argument("--sizes", default="", help="queries group: store sizes in millions of token rows, e.g. 1,10,100")
    p.add_argument("--store", default="", help="bucket group: an s3://bucket/prefix (AWS_* variables) to measure "
                   "instead of a SeaweedFS started on loopback behind a +20 ms proxy")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    groups = [g for g in (args.only.split(",") if args.only else SUITES) if g]
    unknown = [g for g in groups if g not in SUITES]
    if unknown:
        p.error(f"unknown group(s) {unknown}; choose from {list(SUITES)}")
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "quick": args.quick, "groups": groups}
    figs: list[Figure] = []
    for g in groups:
        module, full, quick = SUITES[g]
        t0 = time.perf_counter()
        fn = getattr(importlib.import_module(module), ENTRY.get(g, "run"))
        kwargs = dict(quick if args.quick else full)
        if g == "queries" and args.sizes:
            kwargs["sizes_m"] = tuple(int(x) for x in args.sizes.split(","))
        if g == "bucket" and args.store:
            kwargs["store"] = args.store
        figs.extend(fn(**kwargs))
        log.info("%s done in %.1f s", g, time.perf_counter() - t0)
    md = to_markdown(figs, meta)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"meta": meta, "figures": [f.as_dict() for f in figs]}, indent=2))
    (out / "bench.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
