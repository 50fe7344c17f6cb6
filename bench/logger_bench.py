"""RunLogger figures: log_step latency (caller thread) and writer throughput vs raw DuckDB ingest.

    .venv/bin/python bench/logger_bench.py [--steps 150] [--reps 3]

Payload per step: 40 samples x 200 tokens (8,000 token rows, all columns filled, a vocab for
token text), like a Search-R1 step of 8 prompts x 5 samples. Figures are medians over --reps
repetitions, each in a fresh temporary store; the baseline (DuckDB `INSERT ... SELECT` of the same
Arrow token rows into a .duckdb file, one batch per step) is measured in the same run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

N, T, VOCAB = 40, 200, 300


def payload(step: int, rng: np.random.Generator):
    role = np.zeros((N, T), np.int64)
    role[:, 60:100] = 1
    aidx = np.where(role == 1, -1, np.where(np.arange(T) < 60, 0, 1))
    samples = {"reward": (rng.random(N) > 0.5).astype(float), "advantage": rng.normal(size=N),
               "group_id": np.repeat(np.arange(N // 5), 5), "prompt_id": np.repeat(np.arange(N // 5), 5),
               "n_searches": rng.integers(0, 3, N), "text": ["some decoded response text " * 8] * N}
    tokens = {"token_id": rng.integers(0, VOCAB, (N, T)), "mask": np.ones((N, T), bool), "role": role,
              "action_idx": np.broadcast_to(aidx, (N, T)).copy(),
              "logp_old": rng.normal(size=(N, T)).astype(np.float32),
              "logp_new": rng.normal(size=(N, T)).astype(np.float32),
              "logp_ref": rng.normal(size=(N, T)).astype(np.float32),
              "entropy": rng.random((N, T)).astype(np.float32)}
    return samples, tokens


def as_torch(d):
    import torch

    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def bench_logger(steps: int, use_torch: bool, rng, gap_s: float = 0.0) -> dict[str, float]:
    """Log `steps` steps; `gap_s` = simulated training compute between steps (sleep: releases the GIL
    like torch kernels do). gap_s=0 is the worst case: the writer thread competes for every cycle."""
    from lld_monitor.logger import LoggerOptions, RunLogger

    data = [payload(s, rng) for s in range(steps)]
    if use_torch:
        data = [(as_torch(s), as_torch(t)) for s, t in data]
    vocab = [f"tok{i}" for i in range(VOCAB)]
    with tempfile.TemporaryDirectory() as d:
        lg = RunLogger(Path(d) / "s", "bench", "vanilla", {}, vocab=vocab, flush_every_steps=10, flush_every_s=2.0,
                       handle_signals=False, options=LoggerOptions(queue_size=1024))
        lat = []
        t0 = time.perf_counter()
        for s, (smp, tok) in enumerate(data):
            a = time.perf_counter()
            lg.log_step(s, scalars={"grad_norm": 1.0, "lr": 1e-6}, samples=smp, tokens=tok)
            lat.append(time.perf_counter() - a)
            if gap_s:
                time.sleep(gap_s)
        lg.flush()
        t_flushed = time.perf_counter() - t0
        lg.close()
        t_closed = time.perf_counter() - t0
    rows = steps * N * T
    return {"lat_median_ms": 1e3 * statistics.median(lat), "lat_p95_ms": 1e3 * float(np.percentile(lat, 95)),
            "rows_s_flushed": rows / t_flushed, "rows_s_closed": rows / t_closed}


def token_tables(steps: int, rng) -> list[pa.Table]:
    """The exact token rows the logger stores, as Arrow tables (one per step), built once up front."""
    from lld_monitor.roles import ROLES
    from lld_monitor.store import schema

    out = []
    vocab = np.asarray([f"tok{i}" for i in range(VOCAB)], dtype=object)
    for s in range(steps):
        _, tok = payload(s, rng)
        r, c = np.nonzero(tok["mask"])
        tool = tok["role"][r, c] == 1
        cols = {"run_id": pa.array(["bench"] * r.size), "step": pa.array(np.full(r.size, s)),
                "rank": pa.array(np.zeros(r.size, np.int32)), "sample_idx": pa.array(r.astype(np.int32)),
                "position": pa.array(c.astype(np.int32)), "token_id": pa.array(tok["token_id"][r, c].astype(np.int32)),
                "token_text": pa.array(vocab[tok["token_id"][r, c]].tolist()),
                "role": pa.array(np.asarray(ROLES, dtype=object)[tok["role"][r, c]].tolist()),
                "action_idx": pa.array(tok["action_idx"][r, c].astype(np.int32))}
        for k in ("logp_old", "logp_new", "logp_ref", "entropy"):
            cols[k] = pa.array(tok[k][r, c], mask=tool)
        out.append(pa.Table.from_pydict(cols, schema=schema.TOKENS))
    return out


def bench_writer(tables: list[pa.Table]) -> float:
    from lld_monitor.store import RunWriter

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        w = RunWriter.create(Path(d) / "s", "bench", "vanilla")
        for i, t in enumerate(tables):
            w.append("tokens", t)
            if (i + 1) % 10 == 0:
                w.flush()
        w.finish()
        return sum(t.num_rows for t in tables) / (time.perf_counter() - t0)


def bench_duckdb(tables: list[pa.Table]) -> float:
    import duckdb

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        con = duckdb.connect(str(Path(d) / "raw.duckdb"))
        first_t = tables[0]  # noqa: F841 - referenced by the SQL below (replacement scan)
        con.execute("CREATE TABLE tokens AS SELECT * FROM first_t WITH NO DATA")
        for t in tables:
            con.execute("INSERT INTO tokens SELECT * FROM t")
        con.close()
        return sum(t.num_rows for t in tables) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.1, help="simulated training step (s) for the latency-in-a-loop figure")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        import torch

        torch.set_num_threads(1)
        have_torch = True
    except ImportError:
        have_torch = False
    rng = np.random.default_rng(0)
    res: dict[str, list[float]] = {}
    from tqdm import tqdm

    for _ in tqdm(range(args.reps), desc="reps"):
        for use_torch in ([False, True] if have_torch else [False]):
            r = bench_logger(args.steps, use_torch, rng)
            for k, v in r.items():
                res.setdefault(f"{'torch' if use_torch else 'numpy'}_{k}", []).append(v)
        r = bench_logger(args.steps, have_torch, rng, gap_s=args.gap)
        for k, v in r.items():
            res.setdefault(f"gap_{k}", []).append(v)
        tables = token_tables(args.steps, rng)
        res.setdefault("writer_rows_s", []).append(bench_writer(tables))
        res.setdefault("duckdb_rows_s", []).append(bench_duckdb(tables))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"payload: {N} samples x {T} tokens per step, {args.steps} steps, median of {args.reps} reps")
    print(f"log_step latency in a loop with a {args.gap}s training step ({'torch' if have_torch else 'numpy'} inputs): "
          f"median {med['gap_lat_median_ms']:.3f} ms, p95 {med['gap_lat_p95_ms']:.3f} ms")
    for kind in (["numpy", "torch"] if have_torch else ["numpy"]):
        print(f"log_step latency back-to-back, no training work ({kind} inputs): median "
              f"{med[f'{kind}_lat_median_ms']:.3f} ms, p95 {med[f'{kind}_lat_p95_ms']:.3f} ms")
        print(f"RunLogger pipeline ({kind}): {med[f'{kind}_rows_s_flushed']:,.0f} token rows/s to flushed, "
              f"{med[f'{kind}_rows_s_closed']:,.0f} incl. close (final compaction)")
    print(f"RunWriter (prebuilt Arrow token tables, flush every 10 steps, finish): {med['writer_rows_s']:,.0f} rows/s")
    print(f"raw DuckDB Arrow INSERT of the same rows into a .duckdb file:        {med['duckdb_rows_s']:,.0f} rows/s")
    print(f"ratio raw DuckDB / RunWriter: {med['duckdb_rows_s'] / med['writer_rows_s']:.2f}x; "
          f"raw DuckDB / RunLogger pipeline (numpy): {med['duckdb_rows_s'] / med['numpy_rows_s_flushed']:.2f}x")


if __name__ == "__main__":
    main()
