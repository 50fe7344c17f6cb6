"""Soak: a long run compressed into minutes, with the dashboard's data functions polling it all the while.

A *trainer* process logs steps through the real `RunLogger` as fast as it can (realistic payload:
scalars, 40 samples, 200 tokens per sample, tokens kept for 2 groups of 5 as the backend does), a
*reader* process polls it with exactly the functions the dashboard pages call (`lld_monitor.ui.queries`:
runs table, Live-health overview with a warm detector, token view, post-mortem) on one long-lived
`StoreReader`, as the app's `st.cache_resource` keeps it. This process samples both every second:
RSS and open file descriptors (psutil), and the trainer's step.

Why RunLogger and not `lld-monitor train`: the backend's smallest config takes seconds per step on this
CPU, so an hour of it is a few thousand steps at most; the logger alone does more steps in minutes and
exercises the store (flushes, merges, retirements) far harder per second.

    python bench/soak.py --minutes 10            # prints the figures, writes --out JSON
    python bench/soak.py --seconds 45 --json     # what tests/test_hardening_soak.py runs

Figures: memory slope of each process (MiB per 1000 steps, least squares over the second half of the
run, after warm-up), fd counts (first / last / max), reader polls, errors (any exception, lock errors
counted apart), steps logged and the trainer's steps/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.soak")

SAMPLES, TOKENS, GROUP = 40, 200, 5


def payload(step: int, rng: np.random.Generator, n: int = SAMPLES, t: int = TOKENS) -> tuple[dict, dict]:
    """One step's samples and [n, t] token arrays shaped like a Search-R1 rollout batch: action tokens, a block
    of tool (observation) tokens, a second action; log-probs that drift a little with the step."""
    role = np.zeros((n, t), np.int64)
    lo, hi = int(t * 0.3), int(t * 0.5)
    role[:, lo:hi] = 1
    role[:, int(t * 0.9):] = 2
    aidx = np.where(role == 1, -1, np.where(np.arange(t) < lo, 0, 1))
    samples = {
        "reward": (rng.random(n) > 0.5).astype(float), "advantage": rng.normal(size=n),
        "group_id": np.repeat(np.arange(max(1, n // GROUP)), GROUP)[:n], "prompt_id": np.repeat(np.arange(n // GROUP + 1), GROUP)[:n],
        "n_searches": rng.integers(0, 3, n), "text": [f"<search> who wrote step {step} </search> ... <answer> x </answer>"] * n,
    }
    old = rng.normal(-1.0, 0.5, size=(n, t)).astype(np.float32)
    tokens = {
        "token_id": rng.integers(0, 500, (n, t)), "mask": np.ones((n, t), bool), "role": role,
        "action_idx": np.broadcast_to(aidx, (n, t)).copy(), "logp_old": old,
        "logp_new": old + rng.normal(-0.001 * (step % 100), 0.05, size=(n, t)).astype(np.float32),
        "logp_ref": old, "entropy": rng.random((n, t)).astype(np.float32),
    }
    return samples, tokens


# ----------------------------------------------------------------------------- roles (child processes)
def trainer(store: str, seconds: float, progress_every: int, gap_s: float) -> int:
    from lld_monitor.logger import RunLogger

    rng = np.random.default_rng(0)
    step = 0
    deadline = time.monotonic() + seconds
    with RunLogger(store, "soak", "vanilla", {"soak": True}, token_groups=2) as lg:
        print(f"RUN {lg.run_id}", flush=True)
        while time.monotonic() < deadline:
            smp, tok = payload(step, rng)
            lg.log_step(step, scalars={"grad_norm": float(1 + rng.random()), "entropy": float(rng.random()),
                                       "clip_frac": 0.1, "kl": 0.01, "actor/pg_loss": float(rng.normal())},
                        samples=smp, tokens=tok)
            step += 1
            if gap_s > 0:
                time.sleep(gap_s)  # the step's compute (a sleep releases the GIL, as torch kernels do)
            if step % progress_every == 0:
                print(f"STEP {step}", flush=True)
        print(f"TRAINED {step}", flush=True)  # from here on: close() (final flush + compaction)
    print(f"DONE {step} errors={lg.errors}", flush=True)
    return 0


def reader(store: str, poll_s: float) -> int:
    """Poll like the dashboard until the run finishes; prints one JSON line per poll batch and a summary."""
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import phase_bands as ph
    from lld_monitor.ui import queries as q

    while not (Path(store) / "store.json").exists():
        time.sleep(0.05)
    r = open_store_reader(store)  # one long-lived reader, as st.cache_resource keeps it
    tracker = ph.DetectionTracker()
    polls = errors = lock_errors = 0
    last_error = ""
    seen = -1
    t_start = time.monotonic()
    while True:
        try:
            runs = q.runs_table(r)
            if runs.empty:
                time.sleep(poll_s)
                continue
            row = runs.iloc[0].to_dict()
            rid = row["run_id"]
            ov = q.run_overview(r, rid, tracker=tracker, run=row)
            if ov.last_step is not None:
                if ov.last_step < seen:
                    raise AssertionError(f"last step went back: {ov.last_step} < {seen}")
                seen = ov.last_step
            q.token_view(r, rid)
            if polls % 10 == 0:
                q.post_mortem(r, rid, tracker=tracker, run=row)
            polls += 1
            if row["status"] != "running":
                break
        except Exception as exc:  # noqa: BLE001 - counted, reported; the test asserts there are none
            errors += 1
            lock_errors += "lock" in str(exc).lower()
            last_error = f"{type(exc).__name__}: {exc}"[:500]
        if time.monotonic() - t_start > 24 * 3600:
            break
        time.sleep(poll_s)
    print("READER " + json.dumps({"polls": polls, "errors": errors, "lock_errors": lock_errors,
                                  "last_error": last_error, "last_step_seen": seen,
                                  "transient_retries": r.transient_retries}), flush=True)
    r.close()
    return 0


# ----------------------------------------------------------------------------- the driver
def _slope_per_1000(steps: list[float], mib: list[float]) -> float | None:
    if len(steps) < 3 or max(steps) - min(steps) <= 0:
        return None
    a, _ = np.polyfit(np.asarray(steps, float), np.asarray(mib, float), 1)
    return float(a * 1000.0)


def soak(seconds: float, store: str | None = None, poll_s: float = 0.2, sample_s: float = 1.0,
         gap_s: float = 0.02, progress: bool = True) -> dict:
    import psutil

    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="lld-soak-")
        store = str(Path(tmp.name) / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    me = [sys.executable, str(Path(__file__).resolve())]
    logs = tempfile.TemporaryDirectory(prefix="lld-soak-logs-")
    tr_log, rd_log = open(Path(logs.name) / "trainer.err", "w+"), open(Path(logs.name) / "reader.err", "w+")
    tr = subprocess.Popen([*me, "--role", "trainer", "--store", store, "--seconds", str(seconds), "--gap", str(gap_s)],
                          stdout=subprocess.PIPE, stderr=tr_log, text=True, env=env, cwd=ROOT)
    rd = subprocess.Popen([*me, "--role", "reader", "--store", store, "--poll", str(poll_s)],
                          stdout=subprocess.PIPE, stderr=rd_log, text=True, env=env, cwd=ROOT)
    state = {"step": 0, "done": None, "run_id": None, "closing": False}
    tr_lines: list[str] = []

    def pump() -> None:
        for line in tr.stdout:  # type: ignore[union-attr]
            tr_lines.append(line)
            if line.startswith("STEP "):
                state["step"] = int(line.split()[1])
            elif line.startswith("TRAINED "):
                state["step"] = int(line.split()[1])
                state["closing"] = True
            elif line.startswith("DONE"):
                state["done"] = line.strip()
            elif line.startswith("RUN "):
                state["run_id"] = line.split()[1]

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    samples: list[dict] = []
    ptr, prd = psutil.Process(tr.pid), psutil.Process(rd.pid)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(seconds), unit="s", desc="soak", leave=False)
    t0 = time.monotonic()
    while tr.poll() is None:
        row = {"t": time.monotonic() - t0, "step": state["step"], "closing": state["closing"]}
        for tag, p in (("trainer", ptr), ("reader", prd)):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:  # exited, not reaped yet: nothing to measure
                    continue
                row[f"{tag}_rss_mib"] = p.memory_info().rss / 2**20
                row[f"{tag}_fds"] = p.num_fds()
            except psutil.Error:
                pass
        samples.append(row)
        if bar is not None:
            bar.n = min(int(row["t"]), int(seconds))
            bar.set_postfix(step=row["step"])
            bar.refresh()
        time.sleep(sample_s)
    if bar is not None:
        bar.close()
    th.join(10)
    try:
        rd_out, _ = rd.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        rd.kill()
        rd_out, _ = rd.communicate()
    tr_log.seek(0)
    rd_log.seek(0)
    tr_err, rd_err = tr_log.read(), rd_log.read()
    tr_log.close()
    rd_log.close()
    logs.cleanup()
    rep_line = [ln for ln in rd_out.splitlines() if ln.startswith("READER ")]
    rep = json.loads(rep_line[-1][7:]) if rep_line else {"errors": -1, "last_error": rd_err[-2000:]}
    steps = state["step"]
    # slope over the second half (the first half includes imports, caches and arrow pools warming up)
    # over the training window only: once the step stops advancing the trainer is closing (final compaction),
    # whose peak is reported apart (close_rss_mib_max)
    train = [s for s in samples if s["step"] > 0 and not s["closing"] and "trainer_rss_mib" in s and "reader_rss_mib" in s]
    t_lo = (train[0]["t"] + train[-1]["t"]) / 2 if train else 0.0
    half = [s for s in train if s["t"] >= t_lo]
    closing = [s for s in samples if s["closing"] and "trainer_rss_mib" in s]
    out = {
        "seconds": round(samples[-1]["t"], 1) if samples else 0.0,
        "steps": steps,
        "steps_per_s": round(steps / max(samples[-1]["t"], 1e-9), 1) if samples else 0.0,
        "trainer_rc": tr.returncode, "trainer_done": state["done"], "run_id": state["run_id"],
        "reader_report": rep,
        "samples": len(samples),
        "payload": {"samples_per_step": SAMPLES, "tokens_per_sample": TOKENS, "token_groups": 2, "group_size": GROUP,
                    "step_gap_s": gap_s},
        "queue_full_waits": tr_err.count("queue full"),
    }
    for tag in ("trainer", "reader"):
        rss = [s[f"{tag}_rss_mib"] for s in samples if f"{tag}_rss_mib" in s]
        fds = [s[f"{tag}_fds"] for s in samples if f"{tag}_fds" in s]
        out[tag] = {
            "rss_mib_first": round(rss[0], 1) if rss else None,
            "rss_mib_last": round(rss[-1], 1) if rss else None,
            "rss_mib_max": round(max(rss), 1) if rss else None,
            "rss_slope_mib_per_1000_steps": _slope_per_1000([s["step"] for s in half], [s[f"{tag}_rss_mib"] for s in half]),
            "fds_first": fds[0] if fds else None, "fds_last": fds[-1] if fds else None,
            "fds_max": max(fds) if fds else None,
            "fds_second_half_max": max(s[f"{tag}_fds"] for s in half) if half else None,
            "fds_second_half_min": min(s[f"{tag}_fds"] for s in half) if half else None,
            "rss_mib_training_max": round(max(s[f"{tag}_rss_mib"] for s in train), 1) if train else None,
            "fds_first_half_max": max((s[f"{tag}_fds"] for s in train if s["t"] < t_lo), default=None),
        }
    out["trainer"]["close_rss_mib_max"] = round(max(s["trainer_rss_mib"] for s in closing), 1) if closing else None
    out["slope_window_steps"] = [half[0]["step"], half[-1]["step"]] if half else None
    out["trainer_stderr_tail"] = tr_err[-2000:]
    out["reader_stderr_tail"] = rd_err[-2000:]
    out["timeline"] = samples
    if tmp is not None:
        tmp.cleanup()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None, help="length of the run (default 2)")
    ap.add_argument("--seconds", type=float, default=None, help="length in seconds (overrides --minutes)")
    ap.add_argument("--store", default=None, help="store folder (default: a temporary one, deleted afterwards)")
    ap.add_argument("--poll", type=float, default=0.2, help="reader poll interval, s (the app refreshes every 2 s)")
    ap.add_argument("--gap", type=float, default=0.02, help="simulated compute per step, s (default 0.02)")
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    ap.add_argument("--out", default=None, help="also write the result JSON here")
    ap.add_argument("--role", choices=["trainer", "reader"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 60.0 * (args.minutes if args.minutes is not None else 2.0)
    if args.role == "trainer":
        return trainer(args.store, seconds, progress_every=20, gap_s=args.gap)
    if args.role == "reader":
        return reader(args.store, args.poll)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = soak(seconds, args.store, poll_s=args.poll, gap_s=args.gap, progress=not args.json)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "timeline"}, indent=1))
    else:
        print(f"soak: {res['seconds']} s, {res['steps']} steps ({res['steps_per_s']} steps/s), "
              f"reader polls {res['reader_report'].get('polls')}, errors {res['reader_report'].get('errors')} "
              f"(lock errors {res['reader_report'].get('lock_errors')})")
        for tag in ("trainer", "reader"):
            f = res[tag]
            slope = f["rss_slope_mib_per_1000_steps"]
            print(f"  {tag:8s} RSS {f['rss_mib_first']} -> {f['rss_mib_last']} MiB (max {f['rss_mib_max']}), "
                  f"slope {slope if slope is None else round(slope, 2)} MiB/1000 steps; "
                  f"fds {f['fds_first']} -> {f['fds_last']} (max {f['fds_max']})")
        print(f"  trainer close (final compaction) RSS max {res['trainer']['close_rss_mib_max']} MiB; "
              f"slope window steps {res['slope_window_steps']}; queue-full waits {res['queue_full_waits']}")
    ok = res["trainer_rc"] == 0 and res["reader_report"].get("errors") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
