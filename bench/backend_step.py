"""Seconds per GRPO step (wall and process CPU) of the default backend config, with token logging on vs off.

Both trainers use the same seed, so they roll out the same episodes and do the same updates; the
only difference is whether every step's tokens go to the RunLogger. Each repetition times one
step from the start of `Trainer.step` to the return of `RunLogger.log_step` (what the training
loop waits for); the background writer's CPU use shows up as contention in later steps.

    .venv/bin/python bench/backend_step.py [--steps 5] [--reps 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from dataclasses import replace


def time_steps(cfg, store: str, name: str, n: int) -> list[float]:
    from lld_monitor.backend.grpo import Trainer

    tr = Trainer(cfg, store, name, progress=False)
    times: list[tuple[float, float]] = []
    last = [time.perf_counter(), time.process_time()]

    def on_step(step, payload):
        now, cpu = time.perf_counter(), time.process_time()
        times.append((now - last[0], cpu - last[1]))
        last[0], last[1] = now, cpu

    last[0], last[1] = time.perf_counter(), time.process_time()
    tr.train(steps=n + 1, on_step=on_step)
    return times[1:]  # drop the first step (warm-up: allocator, lazy imports)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="alternating on/off repetitions")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from lld_monitor.backend.config import TrainConfig

    base = TrainConfig()
    on = replace(base, log=replace(base.log, token_every=1))
    off = replace(base, log=replace(base.log, token_every=0))
    res = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            for label, cfg in (("off", off), ("on", on)) if rep % 2 == 0 else (("on", on), ("off", off)):
                res[label] += time_steps(cfg, d, f"bench-{label}-{rep}", args.steps)
    print(f"default config: {base.grpo.prompts_per_step} prompts x {base.grpo.group_size} rollouts, "
          f"{base.grpo.num_minibatches} updates/step, token_groups={base.log.token_groups}")
    for i, what in ((0, "wall"), (1, "CPU (process, all threads incl. the logger's writer)")):
        m_on = statistics.median(t[i] for t in res["on"])
        m_off = statistics.median(t[i] for t in res["off"])
        print(f"{what} seconds/step: token logging on {m_on:.3f}, off {m_off:.3f} (median of {len(res['on'])} steps each); "
              f"ratio on/off {m_on / m_off:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
