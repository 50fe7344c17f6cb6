"""Adapters: each room's benchmark script, run as one group of the `python -m bench` table.

The scripts stay runnable on their own (they print more detail); these functions call the same
measuring functions and return `Figure` rows.
"""

from __future__ import annotations

import logging
import statistics

import numpy as np

from bench.common import Figure

log = logging.getLogger(__name__)


def ingest(steps: int = 100, reps: int = 3) -> list[Figure]:
    """Writer token rows/s vs a raw DuckDB Arrow insert of the same rows; log_step latency on the caller thread."""
    from bench import logger_bench as lb

    rng = np.random.default_rng(0)
    writer, raw, pipeline, lat, lat95 = [], [], [], [], []
    for _ in range(reps):
        tables = lb.token_tables(steps, rng)
        writer.append(lb.bench_writer(tables))
        raw.append(lb.bench_duckdb(tables))
        r = lb.bench_logger(steps, False, rng, gap_s=0.05)
        pipeline.append(r["rows_s_flushed"])
        lat.append(r["lat_median_ms"])
        lat95.append(r["lat_p95_ms"])
    w, d, p = (statistics.median(x) for x in (writer, raw, pipeline))
    return [
        Figure("ingest", "RunWriter token rows/s (Arrow batches, flush every 10 steps, finish)", w, "rows/s",
               baseline=d, baseline_name="raw DuckDB INSERT of the same Arrow rows into a .duckdb file",
               goal="ratio >= 0.5 (within 2x)", met=w / d >= 0.5, reps=reps, higher_is_better=True),
        Figure("ingest", "RunLogger pipeline token rows/s (numpy in, flushed)", p, "rows/s", baseline=d,
               baseline_name="raw DuckDB INSERT of the same Arrow rows", goal="ratio >= 0.5 (within 2x)",
               met=p / d >= 0.5, reps=reps, higher_is_better=True),
        Figure("ingest", f"log_step latency, {lb.N} samples x {lb.T} tokens, in a loop with a 50 ms step",
               statistics.median(lat), "ms", reps=reps, notes=f"p95 {statistics.median(lat95):.2f} ms"),
    ]
