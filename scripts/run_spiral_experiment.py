"""Run the spiral experiment: vanilla / llds / llds-ma x seeds, identical settings except the regularizer.

    .venv/bin/python scripts/run_spiral_experiment.py --store /work/experiments/spiral_store --seeds 1 2 4 5 6 7 [--jobs 3]

Each run is `lld-monitor train --config scripts/spiral_config.json --mode M --seed S` with run id
`spiral-<mode>-seed<S>`; at most `--jobs` runs at a time (each uses one thread). Seed 3 of the
same settings is what `scripts/make_sample_runs.py` writes into sample_runs/ (copy those runs in
with `--copy-from sample_runs`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "scripts" / "spiral_config.json"
MODES = ("vanilla", "llds", "llds-ma")


def train_command(mode: str, seed: int, store: Path, config: str, steps: int | None = None) -> list[str]:
    """The trainer command of one run of the experiment (run id `spiral-<mode>-seed<seed>`)."""
    cmd = [sys.executable, "-m", "lld_monitor.cli", "train", "--mode", mode, "--seed", str(seed), "--store", str(store),
           "--run-name", f"{mode}-seed{seed}", "--run-id", f"spiral-{mode}-seed{seed}", "--config", str(config), "--no-progress"]
    return cmd + ["--steps", str(steps)] if steps else cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--config", default=str(CONFIG), help="training config (default scripts/spiral_config.json)")
    ap.add_argument("--steps", type=int, default=None, help="override the config's steps")
    ap.add_argument("--copy-from", default=None, help="a store whose finished runs are copied in first (e.g. sample_runs)")
    args = ap.parse_args()
    store = Path(args.store)
    if args.copy_from:
        src = Path(args.copy_from)
        (store / "runs").mkdir(parents=True, exist_ok=True)
        if not (store / "store.json").exists():
            shutil.copy2(src / "store.json", store / "store.json")
        for d in sorted((src / "runs").iterdir()):
            if not (store / "runs" / d.name).exists():
                shutil.copytree(d, store / "runs" / d.name)
                print(f"copied {d.name}", flush=True)
    todo = [(m, s) for s in args.seeds for m in args.modes]
    running: list[tuple[subprocess.Popen, str, float]] = []
    logs = store.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed = 0
    while todo or running:
        while todo and len(running) < args.jobs:
            mode, seed = todo.pop(0)
            rid = f"spiral-{mode}-seed{seed}"
            cmd = train_command(mode, seed, store, args.config, args.steps)
            out = open(logs / f"{rid}.log", "w")
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            running.append((p, rid, time.time()))
            print(f"started {rid}", flush=True)
        time.sleep(2)
        for item in list(running):
            p, rid, t0 = item
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)  # the child's own CPU time, not its neighbours'
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                running.remove(item)
                cpu = usage.ru_utime + usage.ru_stime
                print(f"{rid}: exit {p.returncode} after {time.time() - t0:.0f} s ({cpu:.0f} CPU-s)", flush=True)
                with open(logs / "cpu.jsonl", "a") as fh:
                    fh.write(json.dumps({"run_id": rid, "run_name": rid.split("-", 1)[1], "wall_s": time.time() - t0,
                                         "cpu_s": cpu, "returncode": p.returncode}) + "\n")
                failed += p.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
