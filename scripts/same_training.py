"""Is a change to the trainer a change to its training? Train the golden runs (the demo's vanilla and LLDS, its
seed, the first STEPS steps) at two checkouts and compare them value for value (`store.compare.run_differences`),
then the metrics key by key: steps, samples and tokens must be equal; new metric keys are listed, every other
metric must be equal.

    git worktree add /tmp/before REV
    .venv/bin/python scripts/same_training.py /tmp/before .        # [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG  # noqa: E402
from lld_monitor.store import open_store_reader  # noqa: E402
from lld_monitor.store.compare import WALL_CLOCK_METRIC_PREFIX, run_differences  # noqa: E402

MODES = ("vanilla", "llds")


def train(root: Path, store: Path, steps: int) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "train", "--mode", m, "--store", str(store),
                               "--seed", str(DEMO_SEED), "--run-name", f"demo-{m}-seed{DEMO_SEED}", "--no-progress",
                               "--steps", str(steps), "--config", str(SPIRAL_CONFIG)],
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for m in MODES]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"training at {root} failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        train(args.before.resolve(), Path(d) / "before", args.steps)
        train(args.after.resolve(), Path(d) / "after", args.steps)
        a, b = open_store_reader(Path(d) / "before"), open_store_reader(Path(d) / "after")
        ra, rb = a.runs().set_index("mode"), b.runs().set_index("mode")
        moved = False
        for m in MODES:
            diffs = [x for x in run_differences(a, ra.run_id[m], b, rb.run_id[m]) if not x.startswith("metrics")]
            ma, mb = (r.metrics(i) for r, i in ((a, ra.run_id[m]), (b, rb.run_id[m])))
            new = sorted(set(mb.key) - set(ma.key))
            gone = sorted(set(ma.key) - set(mb.key))
            ma, mb = (x[~x.key.str.startswith(WALL_CLOCK_METRIC_PREFIX) & x.key.isin(set(ma.key) & set(mb.key))]
                      .sort_values(["step", "key"]).reset_index(drop=True) for x in (ma, mb))
            same = (ma.key.equals(mb.key) and ma.step.equals(mb.step)
                    and bool(((ma.value == mb.value) | (ma.value.isna() & mb.value.isna())).all()))
            print(f"{m}: steps, samples, tokens: {'equal' if not diffs else diffs}; metrics: new {new}, gone {gone}, "
                  f"every other one {'equal' if same else 'DIFFERENT'}")
            moved |= bool(diffs) or not same or bool(gone)
    print("the training did not move" if not moved else "the training moved")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
