"""Seconds per GRPO step of the built-in trainer: pinned vs native numerics (and an older revision), interleaved.

Each run is a real `python -m lld_monitor.cli train` process (the pins are chosen before torch loads, so a
process has one kind of numerics), training `--steps` steps of one config and seed; the figures come from
the store it writes:
- step time: the trainer's own `step_time` (rollout, forwards, updates; not the logging), median of steps
  3 .. steps-1 (the first steps warm the allocator and the caches);
- start-up: from the process's launch to the start of its first step (imports, warm start, store).
Runs of the different settings alternate (A B C, B C A, ...), so drift of a noisy machine hits all alike.

    .venv/bin/python bench/backend_step.py [--config bench/step_speed_config.json] [--steps 15] [--reps 3]
        [--numerics pinned,native] [--baseline REV]   # REV: a git revision, run from a temporary worktree

`time_steps` (in-process, token logging on/off) serves `lld-monitor bench`'s end-to-end suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lld_monitor.backend.numerics import cpu_model

ROOT = Path(__file__).resolve().parents[1]
# the experiment config issue 28's speed bar was stated on (scripts/spiral_config.json of 2026-12-05)
SPEED_CONFIG = ROOT / "bench" / "step_speed_config.json"


def time_steps(cfg, store: str, name: str, n: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of steps 1..n of an in-process trainer (step 0 warms up), each from the
    start of `Trainer.step` to the return of `RunLogger.log_step`. Pinned numerics where this process can
    still have them (torch not loaded yet), else native."""
    from dataclasses import replace

    from lld_monitor.backend import numerics

    numerics.pin_environment()  # before the trainer (and torch) loads
    from lld_monitor.backend.grpo import Trainer

    cfg = replace(cfg, numerics="pinned" if numerics.pinned_in_effect() else "native")
    tr = Trainer(cfg, store, name, progress=False)
    times: list[tuple[float, float]] = []
    last = [time.perf_counter(), time.process_time()]

    def on_step(step, payload):
        now, cpu = time.perf_counter(), time.process_time()
        times.append((now - last[0], cpu - last[1]))
        last[0], last[1] = now, cpu

    last[0], last[1] = time.perf_counter(), time.process_time()
    tr.train(steps=n + 1, on_step=on_step)
    return times[1:]


def one_run(label: str, src: Path, config: Path, steps: int, seed: int, numerics: str | None) -> dict:
    """Train one run in a fresh process from checkout `src`; its median step time and start-up."""
    from lld_monitor.store import open_store_reader

    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "lld_monitor.cli", "train", "--mode", "llds", "--seed", str(seed), "--steps",
               str(steps), "--store", d, "--config", str(config), "--no-progress"]
        if numerics:
            cmd += ["--numerics", numerics]
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
        env["PYTHONPATH"] = str(src)
        t0 = time.time()
        res = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{label}: training failed:\n{res.stderr[-3000:]}")
        r = open_store_reader(d)
        steps_df = r.steps(r.runs().run_id[0]).sort_values("step")
        r.close()
    st = steps_df.step_time.astype(float).tolist()
    first = steps_df.time.iloc[0].timestamp() - st[0]
    return {"label": label, "step_time": statistics.median(st[3:]), "startup": first - t0, "steps": st}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(SPEED_CONFIG), help="trainer config (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="runs per setting")
    ap.add_argument("--numerics", default="pinned,native", help="settings of this checkout to time (comma-separated)")
    ap.add_argument("--baseline", default=None, help="a git revision to time too (run from a temporary worktree)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = [(f"this checkout, {n}", ROOT, n) for n in args.numerics.split(",") if n]
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="lld-baseline-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        settings.append((f"{args.baseline} (baseline)", worktree, None))
    results: dict[str, list[dict]] = {label: [] for label, _, _ in settings}
    try:
        for rep in range(args.reps):
            k = rep % len(settings)
            for label, src, numerics in settings[k:] + settings[:k]:
                run = one_run(label, src, Path(args.config).resolve(), args.steps, args.seed, numerics)
                results[label].append(run)
                print(f"  rep {rep + 1}: {label}: {run['step_time']:.3f} s/step, start-up {run['startup']:.1f} s",
                      flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    print(f"\n{cpu_model()}, {os.cpu_count()} CPUs; config {Path(args.config).name}, seed {args.seed}, "
          f"median of steps 3-{args.steps - 1}, then the median over {args.reps} runs per setting")
    ref = None
    for label, runs in results.items():
        step = statistics.median(r["step_time"] for r in runs)
        start = statistics.median(r["startup"] for r in runs)
        ref = ref or step
        print(f"{label:40s} {step:.3f} s/step  (x{step / ref:.2f} of the first)   start-up {start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "config": args.config, "results": results}, indent=1))


if __name__ == "__main__":
    main()
