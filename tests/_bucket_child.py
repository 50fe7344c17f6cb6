"""Writers that tests/test_store_bucket_faults.py runs in their own process (then SIGKILLs, or runs under torchrun).

    python tests/_bucket_child.py remote URL RUN_ID    # "on node-7", its clock an hour behind: logs a step every 0.2 s
    python tests/_bucket_child.py big URL RUN_ID       # flushes ~10 MB token segments back to back, forever
    torchrun --nproc_per_node 2 tests/_bucket_child.py ranks URL RUN_ID   # two ranks log one run
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import numpy as np


def remote(url: str, run_id: str) -> None:
    import lld_monitor.store.bucket_writer as bw
    from lld_monitor.store import layout, liveness

    liveness.this_host = lambda: "node-7"  # another host: the reader cannot look up its pid
    bw._now_iso = lambda: layout.iso(layout.utcnow() - timedelta(hours=1))  # its clock an hour behind
    from lld_monitor.logger import RunLogger

    log = RunLogger(url, "remote writer", "vanilla", run_id=run_id, flush_every_s=0.3, flush_every_steps=1,
                    detector=False, handle_signals=False)
    step = 0
    while True:
        log.log_step(step, scalars={"reward_mean": 0.5, "grad_norm": 1.0})
        step += 1
        time.sleep(0.2)


def big(url: str, run_id: str) -> None:
    from lld_monitor.store import RunWriter
    from lld_monitor.store.writer import WriterConfig

    w = RunWriter.create(url, "big", "vanilla", run_id=run_id, writer_config=WriterConfig(background_compaction=False))
    rng = np.random.default_rng(0)
    n = 400_000
    step = 0
    while True:
        w.append("steps", {"step": [step]})
        w.append("tokens", {"step": np.full(n, step), "sample_idx": np.arange(n) // 500, "position": np.arange(n) % 500,
                            "token_id": rng.integers(0, 300, n), "logp_old": rng.normal(size=n),
                            "logp_new": rng.normal(size=n)})
        w.flush()
        print(step, flush=True)
        step += 1


def ranks(url: str, run_id: str) -> None:
    import torch.distributed as dist

    from lld_monitor.logger import RunLogger

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = RunLogger(url, "two ranks", "vanilla", run_id=run_id, rank=rank, world_size=world, detector=False)
    rng = np.random.default_rng(rank)
    for step in range(5):
        n = 3
        samples = {"reward": rng.random(n), "advantage": rng.normal(size=n), "group_id": np.arange(n) + 10 * rank,
                   "sample_idx": np.arange(n)}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, samples)
        all_samples = {k: np.concatenate([g[k] for g in gathered]) for k in samples}
        log.log_step(step, scalars={"grad_norm": 1.0} if rank == 0 else None, samples=samples,
                     all_samples=all_samples if rank == 0 else None)
    log.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"remote": remote, "big": big, "ranks": ranks}[sys.argv[1]](sys.argv[2], sys.argv[3])
