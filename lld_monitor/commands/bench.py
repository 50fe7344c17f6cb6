"""`lld-monitor bench`: run the benchmark suite in bench/ (a checkout is needed: bench/ is not installed)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HELP = "run the benchmarks (ours vs baselines, medians) and print/write the table"
REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default="", help="comma-separated groups (see `python -m bench --help`)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes")
    p.add_argument("--out", default="bench/results", help="folder for bench.json / bench.md")
    p.add_argument("--sizes", default="", help="queries group: store sizes in millions of token rows, e.g. 1,10,100")
    p.add_argument("--store", default="", help="bucket group: measure this s3://bucket/prefix (AWS_* variables) "
                   "instead of a SeaweedFS started on loopback behind a +20 ms proxy")


def run(args: argparse.Namespace) -> int:
    if not (REPO / "bench" / "__main__.py").exists():
        print("lld-monitor bench needs a source checkout (bench/ is not part of the installed package)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "bench", "--out", args.out] + (["--only", args.only] if args.only else [])
    cmd += ["--quick"] if args.quick else []
    cmd += ["--sizes", args.sizes] if args.sizes else []
    cmd += ["--store", args.store] if args.store else []
    return subprocess.call(cmd, cwd=REPO)
