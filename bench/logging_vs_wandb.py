"""Logging cost on the training thread: RunLogger vs `wandb.log` (offline) vs a plain pandas-to-Parquet write.

The same per-step payload goes through each: ~20 step scalars plus 40 samples x 200 tokens
(token id, text, role, action index, log-prob old / new / ref, entropy). What counts for a training
loop is the time the *training thread* spends in the call, so that is the headline figure; the
RunLogger's background work (Arrow batches, flushes, compaction, detector) is reported beside it as
the time `close()` takes to drain, and bytes on disk are measured for all three.

    python -m bench.logging_vs_wandb [--steps 30]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import Figure, dir_bytes, median, p95

N_SAMPLES, N_TOKENS = 40, 200
log = logging.getLogger(__name__)


def make_payload(step: int, rng: np.random.Generator) -> tuple[dict, dict, dict]:
    """scalars, samples, tokens for one step (the shapes a GRPO step of 8 prompts x 5 rollouts gives)."""
    n, t = N_SAMPLES, N_TOKENS
    scalars = {
        "entropy": float(rng.random()), "grad_norm": float(rng.random() * 3), "clip_frac": float(rng.random() * 0.1),
        "kl": float(rng.random() * 0.01), "pg_loss": float(rng.normal()), "llds_loss": 0.0,
        "response_length": float(t), "searches_per_response": 1.2, "lr": 1e-5, "step_time": 1.0,
    }
    scalars.update({f"extra/metric_{i}": float(rng.random()) for i in range(10)})
    reward = (rng.random(n) < 0.4).astype(np.float64)
    samples = {
        "reward": reward,
        "advantage": rng.normal(size=n),
        "group_id": np.repeat(np.arange(n // 5), 5).astype(str),
        "prompt_id": np.repeat(np.arange(n // 5), 5).astype(str),
        "correct": reward > 0,
        "n_actions": np.full(n, 3),
        "n_searches": np.full(n, 2),
        "text": np.array(["<search> who wrote war and peace </search> ... <answer> tolstoy </answer>"] * n, dtype=object),
    }
    role = np.zeros((n, t), dtype=np.int8)
    role[:, 60:110] = 1  # an observation block
    role[:, -8:] = 2  # the answer span
    action_idx = np.where(role == 1, -1, np.where(np.arange(t) < 60, 0, 1)).astype(np.int32)
    logp_old = -rng.random((n, t)).astype(np.float32) * 2
    tokens = {
        "token_id": rng.integers(0, 500, size=(n, t)).astype(np.int32),
        "mask": np.ones((n, t), dtype=bool),
        "role": role,
        "action_idx": action_idx,
        "logp_old": logp_old,
        "logp_new": logp_old + rng.normal(scale=0.05, size=(n, t)).astype(np.float32),
        "logp_ref": logp_old + rng.normal(scale=0.02, size=(n, t)).astype(np.float32),
        "entropy": rng.random((n, t)).astype(np.float32),
    }
    return scalars, samples, tokens


VOCAB = [f"tok{i}" for i in range(500)]


def bench_runlogger(payloads: list, root: Path) -> dict:
    from lld_monitor.logger import RunLogger

    store = root / "store"
    calls = []
    logger = RunLogger(store, "bench", "vanilla", {"bench": True}, vocab=VOCAB, handle_signals=False)
    for step, (scalars, samples, tokens) in enumerate(payloads):
        t0 = time.perf_counter()
        logger.log_step(step, scalars=scalars, samples=samples, tokens=tokens)
        calls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    logger.close()
    drain = time.perf_counter() - t0
    return {"calls": calls, "drain_s": drain, "bytes": dir_bytes(store)}


def _token_frame(tokens: dict, step: int):
    import pandas as pd

    n, t = tokens["token_id"].shape
    return pd.DataFrame({
        "step": step,
        "sample_idx": np.repeat(np.arange(n), t),
        "position": np.tile(np.arange(t), n),
        "token_id": tokens["token_id"].ravel(),
        "token_text": np.asarray(VOCAB, dtype=object)[tokens["token_id"].ravel()],
        "role": tokens["role"].ravel(),
        "action_idx": tokens["action_idx"].ravel(),
        "logp_old": tokens["logp_old"].ravel(),
        "logp_new": tokens["logp_new"].ravel(),
        "logp_ref": tokens["logp_ref"].ravel(),
        "entropy": tokens["entropy"].ravel(),
    })


def bench_wandb(payloads: list, root: Path, with_table: bool = True) -> dict:
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    os.environ.setdefault("WANDB_DISABLE_GIT", "true")
    import wandb

    wdir = root / "wandb_dir"
    wdir.mkdir()
    run = wandb.init(project="lld-bench", dir=str(wdir), mode="offline", config={"bench": True})
    calls = []
    for step, (scalars, samples, tokens) in enumerate(payloads):
        t0 = time.perf_counter()
        # what a user does to keep per-token data in W&B: the scalars plus a Table of the tokens
        row = dict(scalars)
        row["reward"] = float(np.mean(samples["reward"]))
        if with_table:
            row["tokens"] = wandb.Table(dataframe=_token_frame(tokens, step))
        wandb.log(row, step=step)
        calls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    run.finish()
    drain = time.perf_counter() - t0
    return {"calls": calls, "drain_s": drain, "bytes": dir_bytes(wdir)}


def bench_parquet(payloads: list, root: Path) -> dict:
    import pandas as pd

    out = root / "parquet"
    out.mkdir()
    calls = []
    for step, (scalars, samples, tokens) in enumerate(payloads):
        t0 = time.perf_counter()
        _token_frame(tokens, step).to_parquet(out / f"tokens_{step:05d}.parquet")
        pd.DataFrame({k: v for k, v in samples.items()}).assign(step=step).to_parquet(out / f"samples_{step:05d}.parquet")
        pd.DataFrame([dict(scalars, step=step)]).to_parquet(out / f"steps_{step:05d}.parquet")
        calls.append(time.perf_counter() - t0)
    return {"calls": calls, "drain_s": 0.0, "bytes": dir_bytes(out)}


def run(steps: int = 30, seed: int = 0) -> list[Figure]:
    rng = np.random.default_rng(seed)
    payloads = [make_payload(s, rng) for s in range(steps)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="lld-bench-log-") as tmp:
        root = Path(tmp)
        benches = (("runlogger", bench_runlogger), ("parquet", bench_parquet), ("wandb", bench_wandb),
                   ("wandb_scalars", lambda p, r: bench_wandb(p, r, with_table=False)))
        for name, fn in benches:
            sub = root / name
            sub.mkdir()
            log.info("logging bench: %s, %d steps", name, steps)
            results[name] = fn(payloads, sub)
    ours = results["runlogger"]
    figs = []
    for base, base_name, goal in (("wandb", "wandb.log offline (scalars + wandb.Table of tokens)", "ratio >= 5"),
                                  ("wandb_scalars", "wandb.log offline, step scalars only (no tokens)", ""),
                                  ("parquet", "pandas DataFrame.to_parquet per step", "")):
        b = results[base]
        ratio = median(b["calls"]) / median(ours["calls"])
        figs.append(Figure(
            group="logging", name=f"training-thread time per step vs {base}", ours=median(ours["calls"]) * 1e3,
            unit="ms", baseline=median(b["calls"]) * 1e3, baseline_name=base_name, goal=goal,
            met=(ratio >= 5) if goal else None, reps=steps,
            notes=f"p95 ours {p95(ours['calls'])*1e3:.2f} ms, baseline {p95(b['calls'])*1e3:.2f} ms; "
                  f"drain at close: ours {ours['drain_s']:.2f} s, baseline {b['drain_s']:.2f} s",
        ))
        if base != "wandb_scalars":  # that baseline stores no tokens: its bytes are not comparable
            figs.append(Figure(
                group="logging", name=f"bytes on disk for {steps} steps vs {base}", ours=ours["bytes"] / 2**20,
                unit="MiB", baseline=b["bytes"] / 2**20, baseline_name=base_name, reps=1,
            ))
    return figs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    for f in run(args.steps):
        print(f.as_dict())


if __name__ == "__main__":
    main()
