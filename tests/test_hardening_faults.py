"""Faults: SIGKILLed writers, a SIGKILLed dashboard, a full disk, damaged files, clock jumps.

After each fault: the store opens, nothing flushed is lost, the run's status is honest (a dead writer
reads as crashed, a live one as running) and the user gets a clear message.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _net import free_port

from bench.soak import payload  # noqa: E402
from lld_monitor.store import (  # noqa: E402
    NotAStoreError,
    RunWriter,
    StoreError,
    WriterConfig,
    layout,  # noqa: E402
    open_store_reader,
)

N_SAMPLES, N_TOKENS = 20, 64


# ----------------------------------------------------------------------------- SIGKILL of a writer
def _kill_child(store: str, seed: int, conn) -> None:
    """A training loop in a forked child: logs steps forever, reports each step it has seen flushed."""
    from lld_monitor.logger import LoggerOptions, RunLogger

    rng = np.random.default_rng(seed)
    # small fanout + short grace: background merges and retirements happen all the time, so kills land in them
    lg = RunLogger(store, f"kill-{seed}", "vanilla", {"seed": seed}, flush_every_steps=3, flush_every_s=0.1,
                   handle_signals=False, options=LoggerOptions(writer=WriterConfig(compact_fanout=2, retire_grace_s=0.1)))
    conn.send(("run_id", lg.run_id))
    step = 0
    while True:
        samples, tokens = payload(step, rng, N_SAMPLES, N_TOKENS)
        lg.log_step(step, scalars={"grad_norm": float(rng.random()), "custom/x": float(step)},
                    samples=samples, tokens=tokens)
        if step % 5 == 4:
            lg.flush()
            conn.send(("flushed", step))
        step += 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_writer_at_random_points_20_times(tmp_path):
    store = tmp_path / "store"
    ctx = mp.get_context("fork")
    rnd = random.Random(20261202)
    shared = None  # one reader kept across kills (the dashboard's situation), plus a fresh one each time
    results = []
    for i in range(20):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_kill_child, args=(str(store), i, child), daemon=True)
        p.start()
        child.close()
        kind, run_id = parent.recv()
        assert kind == "run_id"
        flushed = -1
        delay = rnd.uniform(0.0, 1.5)
        t_end = time.monotonic() + delay
        while time.monotonic() < t_end:
            if parent.poll(0.01):
                k, s = parent.recv()
                flushed = max(flushed, s)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        try:
            while parent.poll():  # a report already in the pipe was flushed before the kill
                k, s = parent.recv()
                flushed = max(flushed, s)
        except EOFError:  # the dead child's end of the pipe is closed
            pass
        parent.close()
        fresh = open_store_reader(store)
        shared = shared or open_store_reader(store)
        for r in (fresh, shared):
            row = r.run(run_id)
            assert row["status"] == "crashed", (i, delay, row["status"])
            steps = r.steps(run_id)["step"].tolist()
            # a prefix of what was logged, no duplicates (a merge killed half-way is never listed twice)
            assert steps == list(range(len(steps))), (i, delay, steps[:20])
            assert len(steps) >= flushed + 1, (i, delay, flushed, len(steps))
            smp = r.samples(run_id)
            per_step = smp.groupby("step").size()
            assert (per_step == N_SAMPLES).all() and set(per_step.index) == set(steps), (i, delay)
            if flushed >= 0:
                assert set(range(flushed + 1)) <= set(r.token_steps(run_id)), (i, delay)
                assert len(r.tokens(run_id, flushed)) == N_SAMPLES * N_TOKENS
                m = r.metrics(run_id, ["custom/x"])
                assert set(range(flushed + 1)) <= set(m["step"].astype(int)), (i, delay)
        runs = fresh.runs()
        assert len(runs) == i + 1 and (runs["status"] == "crashed").all()
        fresh.close()
        results.append((delay, flushed, len(steps)))
    shared.close()
    print("kills (delay s, last step reported flushed, steps stored):",
          [(round(d, 2), f, n) for d, f, n in results])
    # killed before any flush at least once and after many: the random points covered both ends
    assert any(f < 0 for _, f, _ in results) or min(d for d, _, _ in results) < 0.2
    assert max(f for _, f, _ in results) >= 10
    # the store still takes new runs, and leftover temp files of killed writes are never read
    with RunWriter.create(store, "after the kills", "vanilla") as w:
        w.append("steps", {"step": [0, 1]})
    r = open_store_reader(store)
    assert r.run("after the kills")["status"] == "finished" and r.run("after the kills")["steps"] == 2


# ----------------------------------------------------------------------------- SIGKILL of the dashboard
def _writer_script(store: Path, steps: int, sleep: float) -> list[str]:
    code = (
        "import sys, time, numpy as np\n"
        "sys.path.insert(0, %r)\n"
        "from bench.soak import payload\n"
        "from lld_monitor.logger import RunLogger\n"
        "rng = np.random.default_rng(0)\n"
        "with RunLogger(sys.argv[1], 'survivor', 'vanilla', {}, flush_every_steps=2, flush_every_s=0.2) as lg:\n"
        "    for s in range(int(sys.argv[2])):\n"
        "        smp, tok = payload(s, rng, 10, 32)\n"
        "        lg.log_step(s, scalars={'grad_norm': 1.0}, samples=smp, tokens=tok)\n"
        "        time.sleep(float(sys.argv[3]))\n"
        "print('WRITER-DONE', lg.run_id, flush=True)\n"
    ) % str(ROOT)
    return [sys.executable, "-c", code, str(store), str(steps), str(sleep)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_dashboard_leaves_the_writer_alone(tmp_path):
    from lld_monitor.commands.serve import wait_ready

    store = tmp_path / "store"
    writer = subprocess.Popen(_writer_script(store, 60, 0.1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT)
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(store), "--port", str(port)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server_procs: list[psutil.Process] = []
    try:
        assert wait_ready("127.0.0.1", port, timeout=90, proc=serve), "the dashboard did not start"
        server_procs = psutil.Process(serve.pid).children(recursive=True)
        assert server_procs, "serve should run the Streamlit server as a child"
        # a browser-less client polls the app once so the server has the store open
        import urllib.request

        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read()
        os.kill(serve.pid, signal.SIGKILL)  # the dashboard command dies without any cleanup
        serve.wait(10)
        # its server goes with it: nothing keeps serving the runs or holding the port
        gone, alive = psutil.wait_procs(server_procs, timeout=15)
        assert not alive, f"the Streamlit server outlived a SIGKILLed `lld-monitor serve`: {alive}"
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err[-3000:]
        run_id = out.split("WRITER-DONE")[1].split()[0]
        r = open_store_reader(store)
        row = r.run(run_id)
        assert row["status"] == "finished" and row["steps"] == 60
        assert r.steps(run_id)["step"].tolist() == list(range(60))
        assert "Traceback" not in err, err[-3000:]
    finally:
        for p in [*server_procs]:
            if p.is_running():
                p.kill()
        for p in (serve, writer):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_streamlit_server_leaves_the_writer_alone(tmp_path):
    """The dashboard's own process (Streamlit, reading the store) killed while the writer runs."""
    from lld_monitor.commands.serve import start_server, wait_ready

    store = tmp_path / "store"
    writer = subprocess.Popen(_writer_script(store, 50, 0.1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT)
    port = free_port()
    while not (store / "store.json").exists():
        time.sleep(0.1)
        assert writer.poll() is None, writer.stderr.read()
    server = start_server(store, port=port, quiet=True)
    try:
        assert wait_ready("127.0.0.1", port, timeout=90, proc=server)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err[-3000:]
        run_id = out.split("WRITER-DONE")[1].split()[0]
        row = open_store_reader(store).run(run_id)
        assert row["status"] == "finished" and row["steps"] == 50
    finally:
        for p in (server, writer):
            if p.poll() is None:
                p.kill()
                p.wait()


# ----------------------------------------------------------------------------- disk full
class _SmallDisk:
    """A size-limited folder: a tmpfs mount (root), else RLIMIT_FSIZE (a per-file size limit)."""

    def __init__(self, path: Path, size_mb: int):
        self.path = path
        self.size_mb = size_mb
        self.kind = None
        self._old_limit = None
        self._old_xfsz = None

    def __enter__(self) -> "_SmallDisk":
        self.path.mkdir(parents=True, exist_ok=True)
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
                            capture_output=True).returncode if shutil.which("mount") else 1
        if rc == 0:
            self.kind = "tmpfs"
        else:
            self.kind = "rlimit_fsize"
            self._old_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            self._old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.size_mb * 2**20, self._old_limit[1]))
        return self

    def fill(self) -> Path | None:
        """Take the remaining space (tmpfs). Returns the filler file."""
        if self.kind != "tmpfs":
            return None
        filler = self.path / "filler.bin"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        return filler

    def __exit__(self, *exc) -> None:
        if self.kind == "tmpfs":
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._old_limit)
            signal.signal(signal.SIGXFSZ, self._old_xfsz)


@pytest.mark.timeout(180)
def test_disk_full_is_reported_training_goes_on_and_flushed_data_stays(tmp_path, caplog):
    from lld_monitor.logger import RunLogger

    rng = np.random.default_rng(0)
    with _SmallDisk(tmp_path / "small", 16) as disk:
        store = disk.path / "store"
        lg = RunLogger(store, "disk-full", "vanilla", {}, flush_every_steps=2, flush_every_s=0.1,
                       handle_signals=False, detector=False)
        for s in range(10):
            smp, tok = payload(s, rng, 10, 32)
            lg.log_step(s, scalars={"grad_norm": 1.0}, samples=smp, tokens=tok)
        lg.flush()
        before = open_store_reader(store).steps(lg.run_id)["step"].tolist()
        assert before == list(range(10))
        filler = disk.fill()
        with caplog.at_level(logging.ERROR, logger="lld_monitor"):
            step_times = []
            for s in range(10, 60):  # the training loop keeps going while the disk is full
                smp, tok = payload(s, rng, 40, 200)
                t = time.perf_counter()
                lg.log_step(s, scalars={"grad_norm": 1.0}, samples=smp, tokens=tok)
                step_times.append(time.perf_counter() - t)
                time.sleep(0.02)
            deadline = time.monotonic() + 20
            while lg.errors == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert lg.errors > 0, "a flush on a full disk should fail and be counted"
        text = caplog.text
        assert "flush failed" in text and ("No space left on device" in text or "File too large" in text), text[-2000:]
        assert max(step_times) < 2.0, "log_step must not stall on a full disk"
        # a reader opened now sees everything flushed before the disk filled, and the writer as alive
        r = open_store_reader(store)
        assert set(before) <= set(r.steps(lg.run_id)["step"].tolist())
        assert r.run(lg.run_id)["status"] == "running"
        # space comes back: the logger catches up, nothing logged was lost, the run finishes normally
        if filler is not None:
            filler.unlink()
            stray = list(store.rglob(".*.tmp"))
            for f in stray:  # partial temp files of failed writes must not eat the space that came back
                assert f.stat().st_size == 0 or False, f"a failed write left {f} ({f.stat().st_size} bytes)"
            lg.close()
            r = open_store_reader(store)
            row = r.run(lg.run_id)
            assert row["status"] == "finished", row
            assert r.steps(lg.run_id)["step"].tolist() == list(range(60))
            assert len(r.tokens(lg.run_id, 59)) == 40 * 200
        else:
            try:
                lg.close()
            except OSError:
                pass


# ----------------------------------------------------------------------------- damaged files
def _run(store: Path, name: str, steps: int = 6) -> str:
    with RunWriter.create(store, name, "vanilla", config={"lr": 1e-5}) as w:
        for s in range(steps):
            w.append("steps", {"step": [s], "reward_mean": [0.1 * s]})
            w.append("tokens", {"step": [s] * 3, "sample_idx": [0] * 3, "position": [0, 1, 2], "token_id": [1, 2, 3],
                                "role": ["action"] * 3})
            w.flush()
    return w.run_id


def test_truncated_segment_store_opens_other_runs_intact(tmp_path):
    store = tmp_path / "s"
    good, bad = _run(store, "good"), _run(store, "bad")
    seg = next((store / "runs" / bad / "steps").glob("*.parquet"))
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])  # truncated half-way
    r = open_store_reader(store, retries=3, retry_sleep_s=0.01)
    runs = r.runs()  # the store still lists every run
    assert set(runs["run_id"]) == {good, bad}
    assert r.steps(good)["step"].tolist() == list(range(6))
    assert len(r.tokens(good, 5)) == 3
    with pytest.raises(StoreError, match="could not read the store"):
        r.steps(bad)
    # the undamaged tables of the damaged run still read
    assert len(r.tokens(bad, 5)) == 3


def test_garbage_segment_and_corrupt_manifest(tmp_path, caplog):
    store = tmp_path / "s"
    good, bad, worse = _run(store, "good"), _run(store, "bad"), _run(store, "worse")
    seg = next((store / "runs" / bad / "tokens").glob("*.parquet"))
    seg.write_bytes(os.urandom(seg.stat().st_size))
    (store / "runs" / worse / "manifest-r0.json").write_text('{"segments": {"steps": [{"fi')
    r = open_store_reader(store, retries=3, retry_sleep_s=0.01)
    with caplog.at_level(logging.WARNING):
        runs = r.runs().set_index("run_id")
    assert set(runs.index) == {good, bad, worse}
    assert runs.loc[worse, "status"] == "crashed" and "manifest" in caplog.text
    assert r.steps(bad)["step"].tolist() == list(range(6))
    with pytest.raises(StoreError):
        r.tokens(bad, 0)
    assert r.steps(good)["step"].tolist() == list(range(6))


def test_corrupt_run_json_and_store_json(tmp_path, caplog):
    store = tmp_path / "s"
    good, bad = _run(store, "good"), _run(store, "bad")
    (store / "runs" / bad / "run.json").write_bytes(b"\xff\xfe not json")
    with caplog.at_level(logging.WARNING):
        r = open_store_reader(store)
        assert r.runs()["run_id"].tolist() == [good]
    assert "unreadable" in caplog.text and bad in caplog.text
    assert r.steps(good)["step"].tolist() == list(range(6))
    # a writer can still add runs next to the damaged one, and the damaged files are left as they were
    _run(store, "third")
    assert (store / "runs" / bad / "run.json").read_bytes() == b"\xff\xfe not json"
    meta = (store / "store.json").read_bytes()
    (store / "store.json").write_text('{"format": "lld-monitor-st')
    for fn in (lambda: open_store_reader(store), lambda: RunWriter.create(store, "x", "vanilla")):
        with pytest.raises(NotAStoreError, match="corrupt"):
            fn()
    assert sorted(p.name for p in (store / "runs").iterdir()) == sorted([good, bad, r.runs()["run_id"][0]])
    (store / "store.json").write_bytes(meta)
    assert len(open_store_reader(store).runs()) == 2


def test_dashboard_page_on_a_store_with_a_damaged_run(tmp_path):
    from streamlit.testing.v1 import AppTest

    store = tmp_path / "s"
    good, bad = _run(store, "good"), _run(store, "bad")
    seg = next((store / "runs" / bad / "steps").glob("*.parquet"))
    seg.write_bytes(b"PAR1garbage")
    (store / "runs" / good / "run.json").write_text("{")  # and another run with corrupt metadata
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    at.session_state["store_path"] = str(store)
    at.query_params["run"] = bad
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    shown = " ".join(str(e.value) for e in [*at.error, *at.warning, *at.info, *at.caption, *at.markdown])
    assert "could not be read" in shown or "could not read" in shown, shown[:2000]


# ----------------------------------------------------------------------------- clock jumps
def test_clock_jumps_do_not_flip_the_status(tmp_path, monkeypatch):
    import lld_monitor.store.reader as reader_mod
    import lld_monitor.store.writer as writer_mod

    store = tmp_path / "s"
    real_now = layout.utcnow
    # the writer's clock went back a day: every heartbeat it writes is a day old
    monkeypatch.setattr(writer_mod, "_now_iso", lambda: layout.iso(real_now() - timedelta(days=1)))
    live = RunWriter.create(store, "live", "vanilla")
    live.append("steps", {"step": [0]})
    live.flush()
    monkeypatch.undo()
    # a crashed run whose (dead) writer's clock was a day ahead: its last heartbeat is in the future
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_crash_child, args=(str(store),))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    done = RunWriter.create(store, "done", "vanilla")
    done.append("steps", {"step": [0]})
    done.finish()
    r = open_store_reader(store)

    def status() -> dict[str, str]:
        return dict(zip(r.runs()["name"], r.runs()["status"]))

    assert status() == {"live": "running", "future-crash": "crashed", "done": "finished"}
    # the reader's clock jumps forward a day, then back two
    for shift in (timedelta(days=1), timedelta(days=-2)):
        monkeypatch.setattr(reader_mod.layout, "utcnow", lambda shift=shift: real_now() + shift)
        assert status() == {"live": "running", "future-crash": "crashed", "done": "finished"}, shift
    monkeypatch.undo()
    # an old mtime on a fresh manifest (clock went back between two flushes) still shows the new data
    live.append("steps", {"step": [1]})
    live.flush()
    mpath = layout.manifest_path(store, live.run_id, 0)
    os.utime(mpath, (0, 0))
    assert r.steps(live.run_id)["step"].tolist() == [0, 1]
    live.finish()
    assert status()["live"] == "finished"


def _crash_child(store: str) -> None:
    import lld_monitor.store.writer as writer_mod

    real_now = layout.utcnow
    writer_mod._now_iso = lambda: layout.iso(real_now() + timedelta(days=1))
    w = RunWriter.create(store, "future-crash", "vanilla")
    w.append("steps", {"step": [0, 1]})
    w.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def test_clock_skew_of_a_remote_writer_does_not_mark_it_crashed(tmp_path):
    """A writer on another host whose clock is an hour behind: its heartbeat's age is the reader's monotonic time
    since the heartbeat last changed (issue 38), never the writer's timestamp against the reader's clock. The same
    for a bucket: tests/test_store_bucket_faults.py."""
    store = tmp_path / "s"
    w = RunWriter.create(store, "remote", "vanilla", run_id="remote-run")
    w.append("steps", {"step": [0]})
    w.flush()
    mpath = layout.manifest_path(store, "remote-run", 0)
    r = open_store_reader(store)
    # a rank on another host whose clock runs 1 h behind the reader's, heartbeating every 0.2 s
    for _ in range(5):
        man = json.loads(mpath.read_text())
        man["writer"]["host"] = "node-7"
        man["heartbeat"] = layout.iso(layout.utcnow() - timedelta(hours=1))
        layout.write_json_atomic(mpath, man)
        time.sleep(0.2)
        assert r.run("remote-run")["status"] == "running"
    # and once its heartbeat stops, it reads as crashed after stale_after_s of the reader's own time
    r2 = open_store_reader(store, stale_after_s=1.0)
    assert r2.run("remote-run")["status"] == "running"  # first sight: the manifest was written just now (mtime)
    time.sleep(1.3)
    assert r2.run("remote-run")["status"] == "crashed"
    assert r.run("remote-run")["status"] == "running"  # 300 s have not passed for the first reader
