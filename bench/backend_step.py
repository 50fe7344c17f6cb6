"""Seconds per GRPO step of the default backend config, with token logging on vs off.

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
    times: list[float] = []
    last = [time.perf_counter()]

    def on_step(step, payload):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    tr.train(steps=n + 1, on_step=on_step)
    return times[1:]  # drop the first step (warm-up: allocator, lazy imports)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="alternating on/off repetitions")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from lld_monitor.backend.config import LogSettings, TrainConfig

    base = TrainConfig()
    on = replace(base, log=replace(base.log, token_every=1))
    off = replace(base, log=replace(base.log, token_every=0))
    res = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            for label, cfg in (("off", off), ("on", on)) if rep % 2 == 0 else (("on", on), ("off", off)):
                res[label] += time_steps(cfg, d, f"bench-{label}-{rep}", args.steps)
    m_on, m_off = statistics.median(res["on"]), statistics.median(res["off"])
    print(f"default config: {base.grpo.prompts_per_step} prompts x {base.grpo.group_size} rollouts, "
          f"{base.grpo.num_minibatches} updates/step, token_groups={base.log.token_groups}")
    print(f"seconds/step, token logging on : median {m_on:.3f} over {len(res['on'])} steps")
    print(f"seconds/step, token logging off: median {m_off:.3f} over {len(res['off'])} steps")
    print(f"ratio on/off (logger token overhead): {m_on / m_off:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
