"""`lld-monitor demo`: the sample runs plus a vanilla and an LLDS run training live, in the dashboard.

A fresh demo store gets a copy of sample_runs/ (the historical runs), then two `lld-monitor train`
subprocesses (vanilla and LLDS, same seed and config) write into it while `lld-monitor serve` shows it,
so a newcomer sees finished runs at once and watches the vanilla run drift into the spiral live.
Ctrl-C stops the trainers (their runs end as crashed/stopped, data up to the last flush kept) and the server.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lld_monitor.commands import serve

log = logging.getLogger(__name__)

HELP = "copy the sample runs into a fresh store, train a vanilla and an LLDS run live, and open the dashboard on it"
SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"
# the backend's config that drives the tiny model into the spiral within a couple of hundred steps
SPIRAL_CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "spiral_config.json"
# the live runs' seed: one whose vanilla run collapses and stays down and whose LLDS twin does not collapse
# (docs/results/spiral-10-seeds-2026-12-07.md; tests/test_demo_spiral.py trains both and checks it)
DEMO_SEED = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None,
                   help="demo store: a folder that does not exist yet or is empty, or an empty s3://bucket/prefix "
                   "(default: a fresh temporary folder)")
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps of each live run (default: the config's, 250 in scripts/spiral_config.json)")
    p.add_argument("--config", default=None,
                   help="trainer config file (default: scripts/spiral_config.json, tuned so the vanilla run spirals)")
    p.add_argument("--seed", type=int, default=DEMO_SEED,
                   help=f"seed of both live runs (default {DEMO_SEED}: its vanilla run collapses, its LLDS run holds; docs/backend.md)")
    p.add_argument("--modes", default="vanilla,llds", help="live runs to start, comma-separated (default vanilla,llds)")
    p.add_argument("--no-train", action="store_true", help="only the sample runs, no live training")
    p.add_argument("--host", default="127.0.0.1", help="dashboard address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8501, help="dashboard port (default 8501)")


def prepare_store(store: str | None, samples: Path = SAMPLE_RUNS) -> Path | str:
    """A fresh store folder (or bucket prefix) holding a copy of the sample runs (or an empty store when there are
    none)."""
    from lld_monitor.store.location import is_bucket
    from lld_monitor.store.storedir import open_store_for_write

    if is_bucket(store):
        return _prepare_bucket(str(store), samples)
    if store is None:
        path = Path(tempfile.mkdtemp(prefix="lld-demo-"))
    else:
        path = Path(store).expanduser()
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(f"{path} already exists and is not empty; the demo needs a fresh folder "
                                  "(pass another --store, or leave it out for a temporary one)")
    if (samples / "store.json").exists():
        shutil.copytree(samples, path, dirs_exist_ok=True)
        n = len([d for d in (samples / "runs").iterdir() if d.is_dir()]) if (samples / "runs").is_dir() else 0
        log.info("copied %d sample run(s) from %s", n, samples)
    else:
        log.warning("no sample runs at %s; the demo store starts empty", samples)
    open_store_for_write(path)
    return path


def _prepare_bucket(url: str, samples: Path) -> str:
    """The sample runs uploaded under an empty bucket prefix (create-only PUTs: nothing there is overwritten)."""
    from lld_monitor.store.bucket import Bucket
    from lld_monitor.store.storedir import inspect_bucket_store, open_bucket_store_for_write

    bucket = Bucket(url)
    if inspect_bucket_store(bucket) is not None:
        raise FileExistsError(f"{url} already holds a store; the demo needs a fresh prefix (pass another --store)")
    open_bucket_store_for_write(bucket)
    if (samples / "runs").is_dir():
        files = [f for f in sorted((samples / "runs").rglob("*")) if f.is_file() and not f.name.endswith(".bak")]
        bucket.map(lambda f: bucket.put(f.relative_to(samples).as_posix(), f.read_bytes(), create=True), files)
        log.info("uploaded %d file(s) of the sample runs to %s", len(files), url)
    return url


def trainer_command(mode: str, store: Path | str, steps: int | None, seed: int, config: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "lld_monitor.cli", "train", "--mode", mode, "--store", str(store),
           "--seed", str(seed), "--run-name", f"demo-{mode}-seed{seed}", "--no-progress"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if config is not None:
        cmd += ["--config", str(config)]
    return cmd


def _first_step_logged(store: Path | str) -> bool:
    """True once any live demo run has a step row in the store."""
    from lld_monitor.store import StoreError, open_store_reader

    try:
        with open_store_reader(store) as r:
            runs = r.runs()
    except StoreError:
        return False
    demo = runs[runs["name"].astype(str).str.startswith("demo-")]
    return bool(len(demo)) and bool((demo["steps"] > 0).any())


def _stop(procs: list[tuple[str, subprocess.Popen]], timeout: float = 15.0) -> None:
    """SIGINT first (a trainer finishes its step and closes a readable, finished run), then SIGTERM (the run ends
    as crashed, data up to its last flush kept), then SIGKILL; each signal goes to every process still running at
    once, so stopping the trainers takes as long as the slowest one, not the sum of them."""
    for sig_, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        live = [(name, p) for name, p in procs if p.poll() is None]
        if not live:
            return
        for name, p in live:
            if sig_ is signal.SIGINT:
                log.info("stopping %s (pid %d)", name, p.pid)
            else:
                log.warning("%s did not stop; sending %s", name, sig_.name)
            try:
                os.killpg(p.pid, sig_)
            except ProcessLookupError:
                pass
        deadline = None if wait is None else time.monotonic() + wait
        for _, p in live:
            try:
                p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def run(args: argparse.Namespace) -> int:
    from lld_monitor.store import StoreError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = [m.replace("_", "-") for m in modes]  # llds_ma (the store's spelling) is accepted too
    bad = [m for m in modes if m not in ("vanilla", "llds", "llds-ma")]
    if bad:
        print(f"lld-monitor demo: unknown mode(s) {bad}; use vanilla, llds, llds-ma", file=sys.stderr)
        return 2
    try:
        store = prepare_store(args.store)
    except (FileExistsError, OSError, StoreError) as e:
        print(f"lld-monitor demo: {e}", file=sys.stderr)
        return 2
    config = args.config
    if config is None and SPIRAL_CONFIG.exists():
        config = str(SPIRAL_CONFIG)
    if isinstance(store, Path):
        logs = store.with_name(store.name + "-logs")
        logs.mkdir(exist_ok=True)
    else:  # a bucket: the trainers' logs stay on this machine
        logs = Path(tempfile.mkdtemp(prefix="lld-demo-logs-"))
    log.info("demo store: %s (trainer logs in %s)", store, logs)

    def _term(signum, frame):  # SIGTERM to the demo behaves like Ctrl-C
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    # Ctrl-C must stop the demo even when started from a shell that ignores SIGINT for background jobs
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    children: list[tuple[str, subprocess.Popen]] = []
    server = None
    try:
        env = dict(os.environ, LLD_MONITOR_STORE=str(store), OMP_NUM_THREADS="1")
        pending = [] if args.no_train else list(modes)

        def start_next() -> None:
            mode = pending.pop(0)
            out = open(logs / f"train-{mode}.log", "wb")
            p = subprocess.Popen(trainer_command(mode, store, args.steps, args.seed, config), stdout=out,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
            out.close()
            children.append((f"trainer {mode}", p))
            log.info("started %s training (pid %d, %s steps, config %s)", mode, p.pid,
                     args.steps if args.steps is not None else "the config's", config or "default")

        if pending:
            start_next()
            if pending:
                log.info("the other run(s) start once the first has logged a step (its warm start is then cached "
                         "and shared instead of being trained twice at once)")
        # the first screen: the live vanilla run (the one that spirals); its LLDS twin is one toggle away
        first = f"demo-vanilla-seed{args.seed}" if "vanilla" in modes and not args.no_train else None
        server = serve.start_server(store, args.host, args.port, open_run=first)
        if not serve.wait_ready(args.host, args.port, proc=server):
            log.error("the dashboard did not start (is port %d free? try --port)", args.port)
            return 1
        shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        log.info("dashboard on http://%s:%d  — Ctrl-C stops the demo", shown, args.port)
        reported: set[str] = set()
        next_check = 0.0
        while server.poll() is None:
            if pending and time.monotonic() >= next_check:
                next_check = time.monotonic() + 2.0
                if _first_step_logged(store) or children[0][1].poll() is not None:
                    while pending:
                        start_next()
            for name, p in children:
                rc = p.poll()
                if rc is not None and name not in reported:
                    reported.add(name)
                    (log.info if rc == 0 else log.warning)("%s ended with exit code %d (log: %s)", name, rc,
                                                          logs / f"train-{name.split()[-1]}.log")
            time.sleep(0.5)
        log.error("the dashboard server exited (code %s)", server.returncode)
        return 1
    except KeyboardInterrupt:
        log.info("Ctrl-C: stopping the demo (the store %s is kept)", store)
        return 0
    finally:
        _stop(children)
        if server is not None:
            serve.stop_server(server)
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
