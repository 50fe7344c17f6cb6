"""A store in a bucket against the same store in a folder, measured side by side (issue 38).

    .venv/bin/python -m bench.bucket_bench [--reps 5] [--delay-ms 20] [--store s3://bucket/prefix]
    .venv/bin/python -m bench --only bucket          # the same rows in the bench table

Without --store, SeaweedFS is started on loopback (bench/local_s3.py) and the readers and writers reach it through
a loopback proxy that adds --delay-ms to every request (a bucket that far away); with --store, the bucket the AWS_*
variables point to is used as the network gives it. Figures (medians of --reps):

- **live refresh, 10 new segments**: a live run gets two flushes of 5 tables (steps, metrics, samples, tokens,
  alerts); then what a dashboard refresh reads: the run list, the run's steps, metrics, alerts and the last step's
  samples and tokens, on a warm reader (bucket: its mirror syncs). Baseline: the same on the folder.
- **first look at a 20,000-step run**: a reader that never saw the store (bucket: an empty mirror) opens it and
  computes Live health (`queries.run_overview` + `figures.live_health_figure`), as bench/first_look.py's first load.
  The bucket holds the same files as the folder (uploaded once). Baseline: the folder.
- **log_step on the training thread**: RunLogger into the bucket vs into a folder, 40 samples x 200 tokens a step, a
  50 ms training step, a flush every 10 steps, the two loggers interleaved step by step in one loop. And what one flush
  costs the writer thread (informational: it is not the training thread).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Figure  # noqa: E402

log = logging.getLogger("bench.bucket")
TABLES_PER_FLUSH = 5


@contextlib.contextmanager
def _env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Bucketside:
    """Where the bucket is: a SeaweedFS started here behind a DelayProxy, or the --store given."""

    def __init__(self, store: str | None, delay_ms: float, root: Path):
        self.server = self.proxy = None
        if store:
            self.url = store.rstrip("/")
            self.direct: dict[str, str] = {}
            self.remote: dict[str, str] = {}
            self.delay_ms = 0.0
            return
        from bench.local_s3 import DelayProxy, LocalS3

        self.server = LocalS3.start(root / "seaweedfs")
        self.proxy = DelayProxy(target=self.server.ports["s3"], delay_s=delay_ms / 1e3).start()
        self.url = f"s3://{self.server.bucket}/bench-{secrets.token_hex(3)}"
        self.direct = self.server.env()
        self.remote = self.server.env(self.proxy.endpoint)
        self.delay_ms = delay_ms

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.server is not None:
            self.server.stop(grace_s=2.0)  # its data is in the bench's temporary folder


def _append_flush(w, step: int, rng) -> None:
    """One step's rows in each of 5 tables, then a flush: 5 new segments."""
    w.append("steps", {"step": [step], "reward_mean": [float(rng.random())], "grad_norm": [1.0]})
    w.append("metrics", {"step": [step, step], "key": ["lr", "kl"], "value": [1e-6, float(rng.random())]})
    n = 20
    w.append("samples", {"step": [step] * n, "sample_idx": np.arange(n), "reward": rng.random(n),
                         "advantage": rng.normal(size=n), "group_id": np.arange(n) // 5})
    k = n * 100
    w.append("tokens", {"step": [step] * k, "sample_idx": np.arange(k) // 100, "position": np.arange(k) % 100,
                        "token_id": rng.integers(0, 300, k), "logp_old": rng.normal(size=k),
                        "logp_new": rng.normal(size=k)})
    w.append("alerts", {"step": [step], "phase": ["healthy"], "severity": ["info"], "signal": ["bench"],
                        "value": [0.0], "threshold": [0.0], "message": ["bench"]})
    w.flush()


def _refresh(r, rid: str, last: int) -> None:
    """A dashboard refresh: one sync of the mirror (the dashboard refreshes every 2 s, the mirror syncs at most every
    poll_s = 1 s), then the queries of Live health."""
    if r._mirror is not None:
        r._mirror.invalidate()
    r.runs()
    r.steps(rid)
    r.metrics(rid)
    r.alerts(rid)
    r.samples(rid, step=last)
    r.tokens(rid, last)


def live_refresh(side: Bucketside, root: Path, reps: int) -> dict[str, float]:
    from lld_monitor.store import RunWriter, open_store_reader
    from lld_monitor.store.writer import WriterConfig

    cfg = WriterConfig(background_compaction=False)
    rng = np.random.default_rng(0)
    with _env(side.direct):
        wb = RunWriter.create(side.url, "live", "vanilla", run_id="live", writer_config=cfg)
    wl = RunWriter.create(root / "folder-live", "live", "vanilla", run_id="live", writer_config=cfg)
    step = 0
    for _ in range(10):
        for w in (wb, wl):
            _append_flush(w, step, rng)
        step += 1
    with _env(side.remote):
        rb = open_store_reader(side.url, poll_s=60.0, mirror_dir=root / "mirror-live")
    rl = open_store_reader(root / "folder-live")
    for r in (rb, rl):
        _refresh(r, "live", step - 1)
    tb, tl, reqs, idle, idle_reqs = [], [], [], [], []
    for _ in range(reps):
        for _ in range(10 // TABLES_PER_FLUSH):
            for w in (wb, wl):
                _append_flush(w, step, rng)
            step += 1
        n0 = rb._mirror.bucket.requests
        t = time.perf_counter()
        _refresh(rb, "live", step - 1)
        tb.append(time.perf_counter() - t)
        reqs.append(rb._mirror.bucket.requests - n0)
        t = time.perf_counter()
        _refresh(rl, "live", step - 1)
        tl.append(time.perf_counter() - t)
        n0 = rb._mirror.bucket.requests
        t = time.perf_counter()
        _refresh(rb, "live", step - 1)  # a poll with nothing new
        idle.append(time.perf_counter() - t)
        idle_reqs.append(rb._mirror.bucket.requests - n0)
    with _env(side.direct):
        wb.finish()
    wl.finish()
    return {"bucket": 1e3 * statistics.median(tb), "folder": 1e3 * statistics.median(tl),
            "requests": statistics.median(reqs), "idle": 1e3 * statistics.median(idle),
            "idle_requests": statistics.median(idle_reqs)}


def _upload_folder(folder: Path, url: str) -> None:
    from lld_monitor.store.bucket import Bucket

    b = Bucket(url)
    files = [f for f in sorted(folder.rglob("*")) if f.is_file() and not f.name.startswith(".")]
    b.map(lambda f: b.put(f.relative_to(folder).as_posix(), f.read_bytes()), files)


def first_look(side: Bucketside, root: Path, reps: int, steps: int) -> dict[str, float]:
    import pandas as pd

    from bench import first_look as fl
    from lld_monitor.store import open_store_reader
    from lld_monitor.ui import figures, queries
    from lld_monitor.ui import phase_bands as ph

    folder = fl.build(Path(tempfile.gettempdir()) / "lld_first_look", steps)
    url = f"{side.url}-first-look"
    with _env(side.direct):
        _upload_folder(folder, url)
    logging.getLogger("lld_monitor").setLevel(logging.ERROR)
    with open_store_reader(folder) as r0:
        runs = queries.runs_table(r0)
    row = runs[runs["name"] == "big"].iloc[0].to_dict()
    row = {k: (None if v is pd.NA or v is pd.NaT else v) for k, v in row.items()}
    rid = str(row["run_id"])

    def look(store, **kw) -> float:
        t = time.perf_counter()
        with open_store_reader(store, **kw) as r:
            queries.runs_table(r)
            ov = queries.run_overview(r, rid, tracker=ph.DetectionTracker(), run=row)
            figures.live_health_figure(ov.signals, ov.bands, ph.filter_alerts(ov.alerts), 0.6, run_label="big",
                                       phase_ii_step=ov.phase_ii_step)
        return time.perf_counter() - t

    tb, tl = [], []
    for i in range(reps):
        with _env(side.remote):
            tb.append(look(url, mirror_dir=root / f"mirror-first-{i}"))  # never opened: an empty mirror
        tl.append(look(folder))
    return {"bucket": 1e3 * statistics.median(tb), "folder": 1e3 * statistics.median(tl)}


def log_step_cost(side: Bucketside, root: Path, steps: int) -> dict[str, float]:
    from bench.logger_bench import VOCAB, payload
    from lld_monitor.logger import LoggerOptions, RunLogger

    rng = np.random.default_rng(1)
    data = [payload(s, rng) for s in range(steps)]
    vocab = [f"tok{i}" for i in range(VOCAB)]
    kw = dict(vocab=vocab, flush_every_steps=10, flush_every_s=2.0, handle_signals=False, detector=False,
              options=LoggerOptions(queue_size=1024))
    with _env(side.remote):
        lb = RunLogger(side.url, "log_step", "vanilla", {}, run_id="log-step", **kw)
    ll = RunLogger(root / "folder-log", "log_step", "vanilla", {}, run_id="log-step", **kw)
    flushes: dict[str, list[float]] = {"bucket": [], "folder": []}
    for name, lg in (("bucket", lb), ("folder", ll)):
        w, real = lg._writer, lg._writer.flush

        def timed(real=real, name=name):
            t = time.perf_counter()
            real()
            flushes[name].append(time.perf_counter() - t)

        w.flush = timed
    lat: dict[str, list[float]] = {"bucket": [], "folder": []}
    for s, (smp, tok) in enumerate(data):
        for name, lg in (("bucket", lb), ("folder", ll)) if s % 2 else (("folder", ll), ("bucket", lb)):
            t = time.perf_counter()
            lg.log_step(s, scalars={"grad_norm": 1.0}, samples=smp, tokens=tok)
            lat[name].append(time.perf_counter() - t)
        time.sleep(0.05)
    for lg in (lb, ll):
        lg.close()
    out = {}
    for name in ("bucket", "folder"):
        out[f"{name}_median"] = 1e3 * statistics.median(lat[name])
        out[f"{name}_p95"] = 1e3 * float(np.percentile(lat[name], 95))
        out[f"{name}_flush"] = 1e3 * statistics.median(flushes[name]) if flushes[name] else float("nan")
    return out


def run(reps: int = 5, delay_ms: float = 20.0, store: str | None = None, first_look_steps: int = 20_000,
        log_steps: int = 60) -> list[Figure]:
    """The `bucket` group of `python -m bench`."""
    with tempfile.TemporaryDirectory(prefix="lld-bucket-bench-") as d:
        root = Path(d)
        side = Bucketside(store, delay_ms, root)
        try:
            with _env({"LLD_MONITOR_CACHE": str(root / "cache")}):
                lr = live_refresh(side, root, reps)
                fl = first_look(side, root, max(1, reps // 2 + 1), first_look_steps)
                ls = log_step_cost(side, root, log_steps)
        finally:
            side.close()
    net = f"+{side.delay_ms:.0f} ms per request" if side.server else "the --store bucket"
    where = f"bucket ({'SeaweedFS on loopback, ' if side.server else ''}{net})"
    return [
        Figure("bucket", f"live refresh, 10 new segments, {where}", lr["bucket"], "ms", baseline=lr["folder"],
               baseline_name="the same refresh on a folder", goal="< 250 ms", met=lr["bucket"] < 250, reps=reps,
               notes=f"{lr['requests']:.0f} requests; a poll with nothing new: {lr['idle']:.0f} ms, "
                     f"{lr['idle_requests']:.0f} requests"),
        Figure("bucket", f"first look at a {first_look_steps:,}-step run (empty mirror), {where}", fl["bucket"], "ms",
               baseline=fl["folder"], baseline_name="the same run in a folder (fresh reader)",
               goal="<= 2x the folder", met=fl["bucket"] <= 2 * fl["folder"], reps=max(1, reps // 2 + 1)),
        Figure("bucket", f"log_step on the training thread (median), {where}", ls["bucket_median"], "ms",
               baseline=ls["folder_median"], baseline_name="RunLogger into a folder, same loop",
               goal="unchanged (within 1.5x + 0.5 ms)",
               met=ls["bucket_median"] <= 1.5 * ls["folder_median"] + 0.5, reps=log_steps,
               notes=f"p95 {ls['bucket_p95']:.2f} vs {ls['folder_p95']:.2f} ms"),
        Figure("bucket", f"one flush on the writer thread (median), {where}", ls["bucket_flush"], "ms",
               baseline=ls["folder_flush"], baseline_name="RunLogger into a folder", reps=log_steps // 10,
               notes="informational: the writer thread, not the training thread"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bucket_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--store", default=None, help="an s3:// prefix to use instead of a local SeaweedFS")
    p.add_argument("--first-look-steps", type=int, default=20_000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from bench.__main__ import to_markdown
    from bench.common import machine

    figs = run(args.reps, args.delay_ms, args.store, args.first_look_steps)
    import datetime as dt

    print(to_markdown(figs, {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                             "machine": machine(), "quick": False}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
