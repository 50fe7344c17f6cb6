"""Cross-process guarantees of the store: live reading, SIGKILL durability, several ranks in one run.

The worker processes are this file run as a script (`python tests/test_store_live.py <role> ...`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
N, T = 8, 50  # samples per step x tokens per sample


# ----------------------------------------------------------------------------- worker processes
def _payload(step: int, rank: int = 0):
    rng = np.random.default_rng(step * 7 + rank)
    samples = {"reward": (rng.random(N) > 0.5).astype(float), "advantage": rng.normal(size=N),
               "group_id": np.repeat(np.arange(N // 4), 4) + 100 * rank, "sample_idx": np.arange(N)}
    role = np.zeros((N, T), int)
    role[:, 10:15] = 1
    tokens = {"token_id": rng.integers(0, 100, (N, T)), "mask": np.ones((N, T), bool), "role": role,
              "logp_old": rng.normal(size=(N, T)), "logp_new": rng.normal(size=(N, T))}
    return samples, tokens


def worker_logger(store: str, steps: int, sleep_s: float, rank: int, world: int, run_id: str | None,
                  flush_every: int, report: str | None) -> None:
    from lld_monitor.logger import RunLogger

    lg = RunLogger(store, "live run", "vanilla", {"steps": steps}, run_id=run_id, rank=rank, world_size=world,
                   flush_every_steps=flush_every, flush_every_s=0.5, detector=False)
    print(json.dumps({"run_id": lg.run_id}), flush=True)
    for step in range(steps):
        samples, tokens = _payload(step, rank)
        lg.log_step(step, scalars={"grad_norm": float(step)}, samples=samples, tokens=tokens)
        if report and (step + 1) % flush_every == 0:
            lg.flush()  # everything up to `step` is now durable: say so
            with open(report, "a") as f:
                f.write(f"{step}\n")
        time.sleep(sleep_s)
    lg.close()


def worker_reader(store: str, out: str, poll_s: float, until_file: str) -> None:
    from lld_monitor.store import open_store_reader

    errors: list[str] = []
    polls: list[list[int]] = []
    r = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = os.path.exists(until_file)
        try:
            if r is None:
                r = open_store_reader(store)
            runs = r.runs()
            if len(runs):
                rid = runs["run_id"].iloc[0]
                q = r.sql(
                    "SELECT (SELECT count(*) FROM steps WHERE run_id = ?), (SELECT coalesce(max(step), -1) FROM steps "
                    "WHERE run_id = ?), (SELECT count(*) FROM samples WHERE run_id = ?), (SELECT count(*) FROM tokens "
                    "WHERE run_id = ?), (SELECT count(DISTINCT step) FROM samples WHERE run_id = ?)",
                    [rid] * 5)
                polls.append([int(x) for x in q.iloc[0].tolist()])
                r.steps(rid)  # the dashboard's calls, too
                r.tokens(rid, 0)
        except Exception as e:  # noqa: BLE001 - counted, that is the point of the test
            errors.append(f"{type(e).__name__}: {e}")
        if done:
            break
        time.sleep(poll_s)
    Path(out).write_text(json.dumps({"errors": errors, "polls": polls}))


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "logger":
        store, steps, sleep_s, rank, world, run_id, flush_every, report = rest
        worker_logger(store, int(steps), float(sleep_s), int(rank), int(world), None if run_id == "-" else run_id,
                      int(flush_every), None if report == "-" else report)
    elif role == "reader":
        worker_reader(*rest[:2], float(rest[2]), rest[3])
    sys.exit(0)


# ----------------------------------------------------------------------------- tests
def _spawn(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(HERE), *args], stdout=subprocess.PIPE, text=True, env=env, **kw)


@pytest.mark.slow
def test_reader_process_polls_while_writer_logs_500_steps(tmp_path):
    store, out, done = tmp_path / "store", tmp_path / "reader.json", tmp_path / "done"
    writer = _spawn("logger", str(store), "500", "0.01", "0", "1", "-", "10", "-")
    json.loads(writer.stdout.readline())  # the store exists from here on
    reader = _spawn("reader", str(store), str(out), "0.2", str(done))
    assert writer.wait(timeout=180) == 0
    done.write_text("1")
    assert reader.wait(timeout=60) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == []
    polls = res["polls"]
    assert len(polls) >= 10, "the reader should have polled many times during the run"
    prev = None
    for n_steps, last, n_samples, n_tokens, sample_steps in polls:
        # a prefix: steps 0..n-1 exactly, samples and tokens of the same steps, nothing torn
        assert last == n_steps - 1 and n_samples == N * n_steps and n_tokens == N * T * n_steps
        assert sample_steps == n_steps
        if prev is not None:
            assert n_steps >= prev
        prev = n_steps
    assert polls[-1] == [500, 499, 500 * N, 500 * N * T, 500]
    assert 0 < polls[len(polls) // 2][0] < 500 or polls[0][0] < 500, "reads happened while the run was live"

    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    row = r.runs().iloc[0]
    assert row["status"] == "finished" and row["steps"] == 500
    files = list((store / "runs" / row["run_id"]).rglob("*.parquet"))
    assert sorted(f.parent.name for f in files) == ["samples", "steps", "tokens"], files  # one file per table


@pytest.mark.slow
def test_sigkill_mid_run_keeps_flushed_steps_and_reads_as_crashed(tmp_path):
    from lld_monitor.store import open_store_reader

    store, report = tmp_path / "store", tmp_path / "flushed.txt"
    writer = _spawn("logger", str(store), "100000", "0.002", "0", "1", "-", "10", str(report))
    run_id = json.loads(writer.stdout.readline())["run_id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if report.exists() and len(report.read_text().split()) >= 8:
            break
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
    flushed = [int(x) for x in report.read_text().split()]
    assert flushed, "the writer reported no flush before the kill"
    r = open_store_reader(store)
    row = r.run(run_id)
    assert row["status"] == "crashed"
    steps = r.steps(run_id)["step"].tolist()
    assert steps == list(range(len(steps))), "a prefix of the steps, no hole"
    assert len(steps) >= flushed[-1] + 1, "every step reported flushed is stored"
    assert len(r.samples(run_id)) == N * len(steps)
    # the store stays writable: a new run goes in beside the crashed one
    from lld_monitor.store import RunWriter

    w = RunWriter.create(store, "after the crash", "vanilla")
    w.append("steps", {"step": [0]})
    w.finish()
    assert set(open_store_reader(store).runs()["status"]) == {"crashed", "finished"}


@pytest.mark.slow
def test_two_rank_processes_land_in_one_run(tmp_path):
    from lld_monitor.store import open_store_reader

    store = tmp_path / "store"
    run_id = "ddp-run-1"
    procs = [_spawn("logger", str(store), "60", "0.005", str(rank), "2", run_id, "10", "-") for rank in (1, 0)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    r = open_store_reader(store)
    runs = r.runs()
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["run_id"] == run_id and row["status"] == "finished" and row["world_size"] == 2
    assert row["steps"] == 60
    smp = r.samples(run_id)
    assert len(smp) == 2 * 60 * N
    assert smp.groupby("rank").size().to_dict() == {0: 60 * N, 1: 60 * N}
    tok = r.tokens(run_id, 5)
    assert tok.groupby("rank").size().to_dict() == {0: N * T, 1: N * T}
    assert len(r.samples(run_id, step=7, rank=1)) == N
