"""Import figures: offline .wandb import rows/s, online import rows/s (wandb.Api stand-in), and the time the
dashboard's compare function takes on an imported run next to a local one.

    .venv/bin/python bench/import_bench.py [--steps 20000] [--reps 3]

Each figure is the median of --reps repetitions; each has a baseline measured in the same run:
- offline import vs only parsing the .wandb file (the reader's share of the import);
- online import vs only iterating the stand-in's rows (the stand-in's own cost);
- compare(imported, local) vs compare(local, local) with the same number of steps.
The .wandb file is written by the real wandb SDK in offline mode, in a subprocess (no key, no network).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERL_KEYS = ["critic/score/mean", "critic/score/max", "critic/score/min", "actor/grad_norm", "actor/entropy_loss",
             "actor/pg_clipfrac", "actor/kl_loss", "actor/pg_loss", "actor/ppo_kl", "actor/loss_noreduce",
             "actor/mean_reduce_chunk", "actor/lr", "env/number_of_valid_search", "response_length/mean",
             "timing_s/step"]

WRITER = r"""
import math, sys, wandb
steps, keys = int(sys.argv[1]), sys.argv[2].split(",")
run = wandb.init(project="bench", name="verl-bench", id="benchrun",
                 config={"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.2}}})
for s in range(steps):
    run.log({k: math.sin(s * 0.01 + i) for i, k in enumerate(keys)}, step=s)
run.finish()
"""


def write_offline(root: Path, steps: int) -> Path:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "cfg"),
               WANDB_CACHE_DIR=str(root / "cache"), WANDB_DATA_DIR=str(root / "data"), WANDB_CONSOLE="off")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", WRITER, str(steps), ",".join(VERL_KEYS)], check=True, env=env, cwd=root)
    print(f"(wrote a {steps}-step offline run with the wandb SDK in {time.perf_counter() - t0:.1f} s)")
    return root / "wandb"


class _FakeRun:
    def __init__(self, n: int):
        self.id, self.name, self.project, self.entity = "big", "big", "bench", "e"
        self.config, self.state, self.created_at, self.summary = {}, "finished", None, {}
        self.lastHistoryStep = n - 1
        self.n = n
        self.rows = [{**{k: (s * 7 + i) % 1000 / 1000.0 for i, k in enumerate(VERL_KEYS[:6])}, "_step": s,
                      "_timestamp": 1.8e9 + s} for s in range(n)]

    def scan_history(self, keys=None, page_size=1000, min_step=0, max_step=None, use_cache=True):
        for s in range(min_step, self.n, page_size):
            yield from self.rows[s : s + page_size]


class _FakeApi:
    def __init__(self, run):
        self._run = run

    def run(self, path):
        return self._run


def median_time(fn, reps: int) -> tuple[float, list[float]]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--online-rows", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import numpy as np

    from lld_monitor.integrations.wandb.importer import import_offline, import_online
    from lld_monitor.integrations.wandb.offline_file import read_offline_runs
    from lld_monitor.logger import LoggerOptions, RunLogger
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import queries

    tmp = Path(tempfile.mkdtemp(prefix="lld-import-bench-"))
    wdir = write_offline(tmp, args.steps)
    size = sum(f.stat().st_size for f in wdir.rglob("*.wandb"))

    # --- offline
    parse_t, _ = median_time(lambda: read_offline_runs(wdir), args.reps)
    store = tmp / "store"
    res_holder = {}

    def do_import():
        res_holder["r"] = import_offline(str(store), wdir, progress=False)[0]

    imp_t, imp_all = median_time(do_import, args.reps)
    rows = res_holder["r"].rows
    print(f"offline .wandb ({size / 1e6:.1f} MB, {rows} rows x {len(VERL_KEYS) + 2} keys):")
    print(f"  parse only      {parse_t:.3f} s  = {rows / parse_t:,.0f} rows/s   (baseline)")
    print(f"  import to store {imp_t:.3f} s  = {rows / imp_t:,.0f} rows/s   "
          f"({imp_t / parse_t:.2f}x parse; reps {', '.join(f'{t:.2f}' for t in imp_all)})")

    # --- online (stand-in API)
    fake = _FakeRun(args.online_rows)
    iter_t, _ = median_time(lambda: sum(1 for _ in fake.scan_history()), args.reps)
    on_t, on_all = median_time(
        lambda: import_online(str(tmp / "store-online"), "e", "bench", ["big"], api=_FakeApi(fake), progress=False),
        args.reps)
    print(f"online (wandb.Api stand-in, {args.online_rows} rows x 8 keys):")
    print(f"  iterate rows    {iter_t:.3f} s   (baseline)")
    print(f"  import to store {on_t:.3f} s  = {args.online_rows / on_t:,.0f} rows/s   "
          f"(reps {', '.join(f'{t:.2f}' for t in on_all)})")

    # --- dashboard compare: imported vs local run, same number of steps
    rng = np.random.default_rng(0)
    local_ids = []
    for name in ("local-a", "local-b"):
        with RunLogger(str(store), name, "vanilla", {}, flush_every_steps=1000, detector=False,
                       handle_signals=False, options=LoggerOptions(queue_size=args.steps + 1)) as log:
            for s in range(args.steps):
                log.log_step(s, scalars={"reward_mean": float(rng.random()), "grad_norm": float(rng.random()),
                                         "entropy": float(rng.random()), "clip_frac": float(rng.random())})
            local_ids.append(log.run_id)
    imported_id = res_holder["r"].run_id
    pair_local, pair_mixed = (local_ids, ["a", "b"]), ([imported_id, local_ids[0]], ["imported", "local"])
    cold = {}
    for label, (ids, names) in (("local", pair_local), ("mixed", pair_mixed)):
        ts = []
        for _ in range(args.reps):  # a fresh reader each time: nothing cached
            with open_store_reader(store) as r:
                t0 = time.perf_counter()
                queries.compare_frames(r, ids, names)
                ts.append(time.perf_counter() - t0)
        cold[label] = statistics.median(ts)
    with open_store_reader(store) as r:
        queries.compare_frames(r, *pair_local)
        queries.compare_frames(r, *pair_mixed)  # warm the reader's result cache
        base_t, _ = median_time(lambda: queries.compare_frames(r, *pair_local), max(args.reps, 9))
        cmp_t, _ = median_time(lambda: queries.compare_frames(r, *pair_mixed), max(args.reps, 9))
    print(f"dashboard compare_frames ({args.steps} steps each; cold = fresh StoreReader, warm = its result cache):")
    print(f"  local vs local      cold {cold['local'] * 1000:.0f} ms, warm {base_t * 1000:.1f} ms   (baseline)")
    print(f"  imported vs local   cold {cold['mixed'] * 1000:.0f} ms, warm {cmp_t * 1000:.1f} ms   "
          f"({cold['mixed'] / cold['local']:.2f}x cold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
