"""Live reading: compare mechanisms for "a dashboard reads a run while the trainer writes it".

    .venv/bin/python bench/store_mechanisms.py [--flushes 100] [--interval 0.1] [--poll 0.2] [--reps 3]

A writer process flushes one training step per `--interval` s (1 steps row, 40 samples, 8,000
token rows); a reader process polls every `--poll` s doing what the dashboard does (the run list,
the step curve, the tokens of the newest step). Mechanisms:

- parquet:      lld_monitor's RunWriter (Parquet segments, temp name + os.replace, per-rank manifest,
                compaction as it goes) and StoreReader (in-memory DuckDB over the listed segments).
- duckdb-file:  one .duckdb file; the writer opens / inserts (Arrow) / closes per flush and the
                reader opens read-only / queries / closes per poll, both retrying lock errors
                (50 ms sleep, up to 40 tries).
- duckdb-held:  the writer keeps the .duckdb file open (the natural way to use DuckDB); the reader
                tries read-only opens (no retry: shows why this is not an option).

Printed per mechanism (median over --reps): writer stall per flush (median / p95 / max ms),
writer lock conflicts, reader poll latency (median / p95 ms), reader lock conflicts, errors that
reached the reader after retries, and whether the final counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
RETRIES, SLEEP = 40, 0.05


def _tables(flushes: int):
    import pyarrow as pa
    from logger_bench import N, token_tables

    from lld_monitor.store import schema

    rng = np.random.default_rng(0)
    toks = token_tables(flushes, rng)
    out = []
    for s, tok in enumerate(toks):
        steps = pa.Table.from_pydict({"run_id": ["bench"], "step": [s], "n_samples": pa.array([N], pa.int32()),
                                      "reward_mean": [0.5]}, schema=pa.schema([schema.STEPS.field(c) for c in
                                                                              ("run_id", "step", "n_samples", "reward_mean")]))
        samples = pa.Table.from_pydict({"run_id": ["bench"] * N, "step": [s] * N,
                                        "sample_idx": pa.array(range(N), pa.int32()), "reward": [1.0] * N,
                                        "advantage": [0.0] * N, "group_id": ["g"] * N})
        out.append({"steps": steps, "samples": samples, "tokens": tok})
    return out


def _connect_retry(path: str, read_only: bool, retries: int = RETRIES):
    import duckdb

    conflicts = 0
    for _ in range(retries):
        try:
            return duckdb.connect(path, read_only=read_only), conflicts
        except duckdb.IOException:
            conflicts += 1
            time.sleep(SLEEP)
    raise RuntimeError(f"could not open {path} after {retries} tries")


# ----------------------------------------------------------------------------- writer processes
def writer(mech: str, path: str, flushes: int, interval: float, out: str) -> None:
    data = _tables(flushes)
    stalls, conflicts = [], 0
    Path(path + ".ready").write_text("1")
    if mech == "parquet":
        from lld_monitor.store import RunWriter

        w = RunWriter.create(path, "bench", "vanilla", run_id="bench")
        for d in data:
            t0 = time.perf_counter()
            for t, tbl in d.items():
                w.append(t, tbl)
            w.flush()
            stalls.append(time.perf_counter() - t0)
            time.sleep(interval)
        t0 = time.perf_counter()
        w.finish()
        final = time.perf_counter() - t0
    elif mech == "duckdb-file":
        db = os.path.join(path, "runs.duckdb")
        con, _ = _connect_retry(db, False)
        first = data[0]
        for t, tbl in first.items():  # noqa: B007 - tbl is the replacement scan source
            con.execute(f"CREATE TABLE {t} AS SELECT * FROM tbl WITH NO DATA")
        con.close()
        for d in data:
            t0 = time.perf_counter()
            con, c = _connect_retry(db, False)
            conflicts += c
            for t, tbl in d.items():  # noqa: B007
                con.execute(f"INSERT INTO {t} SELECT * FROM tbl")
            con.close()
            stalls.append(time.perf_counter() - t0)
            time.sleep(interval)
        final = 0.0
    else:  # duckdb-held
        import duckdb

        con = duckdb.connect(os.path.join(path, "runs.duckdb"))
        for t, tbl in data[0].items():  # noqa: B007
            con.execute(f"CREATE TABLE {t} AS SELECT * FROM tbl WITH NO DATA")
        for d in data:
            t0 = time.perf_counter()
            for t, tbl in d.items():  # noqa: B007
                con.execute(f"INSERT INTO {t} SELECT * FROM tbl")
            stalls.append(time.perf_counter() - t0)
            time.sleep(interval)
        con.close()
        final = 0.0
    Path(out).write_text(json.dumps({"stalls": stalls, "conflicts": conflicts, "final_s": final}))


# ----------------------------------------------------------------------------- reader processes
def reader(mech: str, path: str, poll: float, done_file: str, out: str) -> None:
    lat, conflicts, errors, last = [], 0, [], None
    r = None
    while True:
        done = os.path.exists(done_file)
        t0 = time.perf_counter()
        try:
            if mech == "parquet":
                from lld_monitor.store import open_store_reader

                r = r or open_store_reader(path)
                r.runs()
                st = r.steps("bench")
                if len(st):
                    r.tokens("bench", int(st["step"].iloc[-1]))
                c = r.sql("SELECT (SELECT count(*) FROM samples) AS s, (SELECT count(*) FROM tokens) AS t")
                last = [len(st), int(c["s"][0]), int(c["t"][0])]
            else:
                db = os.path.join(path, "runs.duckdb")
                con, c = _connect_retry(db, True, RETRIES if mech == "duckdb-file" else 1)
                conflicts += c
                try:
                    st = con.execute("SELECT step, reward_mean FROM steps ORDER BY step").df()
                    if len(st):
                        con.execute("SELECT * FROM tokens WHERE step = ? ORDER BY rank, sample_idx, position",
                                    [int(st["step"].iloc[-1])]).df()
                    last = [len(st), con.execute("SELECT count(*) FROM samples").fetchall()[0][0],
                            con.execute("SELECT count(*) FROM tokens").fetchall()[0][0]]
                finally:
                    con.close()
            lat.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - what the user would see
            errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        if done:
            break
        time.sleep(poll)
    Path(out).write_text(json.dumps({"lat": lat, "conflicts": conflicts, "errors": errors, "last": last}))


# ----------------------------------------------------------------------------- driver
def one(mech: str, flushes: int, interval: float, poll: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        os.makedirs(path)
        wout, rout, done = os.path.join(d, "w.json"), os.path.join(d, "r.json"), os.path.join(d, "done")
        w = subprocess.Popen([sys.executable, str(HERE), "writer", mech, path, str(flushes), str(interval), wout], env=env)
        while not os.path.exists(path + ".ready"):
            time.sleep(0.01)
        time.sleep(0.5)
        r = subprocess.Popen([sys.executable, str(HERE), "reader", mech, path, str(poll), done, rout], env=env)
        w.wait()
        Path(done).write_text("1")
        r.wait()
        wr, rr = json.loads(Path(wout).read_text()), json.loads(Path(rout).read_text())
    from logger_bench import N, T

    exact = rr["last"] == [flushes, flushes * N, flushes * N * T]
    return {"stall_med": 1e3 * statistics.median(wr["stalls"]), "stall_p95": 1e3 * float(np.percentile(wr["stalls"], 95)),
            "stall_max": 1e3 * max(wr["stalls"]), "w_conflicts": wr["conflicts"], "final_ms": 1e3 * wr["final_s"],
            "poll_med": 1e3 * statistics.median(rr["lat"]) if rr["lat"] else float("nan"),
            "poll_p95": 1e3 * float(np.percentile(rr["lat"], 95)) if rr["lat"] else float("nan"),
            "polls_ok": len(rr["lat"]), "r_conflicts": rr["conflicts"], "r_errors": len(rr["errors"]),
            "exact": exact, "first_error": rr["errors"][0] if rr["errors"] else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flushes", type=int, default=100)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--poll", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mechanisms", default="parquet,duckdb-file,duckdb-held")
    args = ap.parse_args()
    from tqdm import tqdm

    mechs = args.mechanisms.split(",")
    res: dict[str, list[dict]] = {m: [] for m in mechs}
    for _ in tqdm(range(args.reps), desc="reps"):
        for m in mechs:
            res[m].append(one(m, args.flushes, args.interval, args.poll))
    print(f"{args.flushes} flushes every {args.interval}s (1 step, 40 samples, 8,000 token rows each); reader polls "
          f"every {args.poll}s; median of {args.reps} reps")
    hdr = ("mechanism", "stall med ms", "p95", "max", "w-locks", "finish ms", "poll med ms", "p95", "polls ok",
           "r-locks", "user errors", "exact")
    print(" | ".join(hdr))
    for m in mechs:
        med = {k: statistics.median([r[k] for r in res[m]]) for k in res[m][0] if k not in ("exact", "first_error")}
        exact = all(r["exact"] for r in res[m])
        print(" | ".join([m, f"{med['stall_med']:.1f}", f"{med['stall_p95']:.1f}", f"{med['stall_max']:.1f}",
                          f"{med['w_conflicts']:.0f}", f"{med['final_ms']:.0f}", f"{med['poll_med']:.1f}",
                          f"{med['poll_p95']:.1f}", f"{med['polls_ok']:.0f}", f"{med['r_conflicts']:.0f}",
                          f"{med['r_errors']:.0f}", str(exact)]))
        errs = [r["first_error"] for r in res[m] if r["first_error"]]
        if errs:
            print(f"   e.g. {errs[0]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "writer":
        writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "reader":
        reader(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        main()
