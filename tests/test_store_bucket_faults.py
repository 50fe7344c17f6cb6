"""Faults of a store in a bucket (issue 38), against a real S3 server (SeaweedFS on loopback, tests/conftest.py).

- a writer on another host, its clock an hour behind, shows "running" on the dashboard, then "crashed" once its
  heartbeat stops (liveness on the server's clock: LastModified against the response's Date);
- the server unreachable for 30 s mid-run: the writer buffers and retries with a warning, log_step never waits,
  no step is lost;
- a writer SIGKILLed while it uploads: readers never see a torn segment;
- two ranks under torchrun write one run into the bucket;
- the same seed and config trained into a folder and into the bucket read back identical.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _net import free_port
from test_backend_train import TINY  # the tiny training config of the backend tests

from lld_monitor.store import open_store_reader
from lld_monitor.store.bucket import Bucket

ROOT = Path(__file__).resolve().parents[1]
CHILD = str(Path(__file__).with_name("_bucket_child.py"))


def _child(mode: str, url: str, run_id: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, mode, url, run_id], cwd=ROOT, env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait(cond, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
def test_a_dashboard_on_a_bucket_shows_a_remote_writer_running_then_crashed(s3_store, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("LLD_MONITOR_STALE_AFTER_S", "4")
    child = _child("remote", s3_store, "remote-run")
    try:
        r = open_store_reader(s3_store, poll_s=0)
        _wait(lambda: "remote-run" in set(r.runs().run_id) and r.run("remote-run")["last_step"] is not None,
              60, "the remote writer's first steps")
        # its heartbeats are written an hour in the past by its own clock, and its host is not this one: only the
        # server's clock can tell it is alive
        man = json.loads(Bucket(s3_store).get("runs/remote-run/manifest-r0.json")[0])
        assert man["writer"]["host"] == "node-7" and man["heartbeat"] < man["started_at"]
        for _ in range(10):
            assert r.run("remote-run")["status"] == "running"
            time.sleep(0.3)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
        at.session_state["store_path"] = s3_store
        at.query_params["run"] = "remote-run"
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        status = {m.label: m.value for m in at.metric}
        assert status.get("Status") == "live", status
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    killed = time.monotonic()
    _wait(lambda: r.run("remote-run")["status"] == "crashed", 30, "crashed after the heartbeat stopped", every=0.5)
    waited = time.monotonic() - killed
    assert waited >= 2.0, f"crashed after {waited:.1f} s: not judged on the heartbeat's age"
    time.sleep(2.1)  # the dashboard's run list is cached for 2 s
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    status = {m.label: m.value for m in at.metric}
    assert status.get("Status") == "crashed", status


@pytest.mark.slow
def test_the_server_out_of_reach_for_30_s_loses_no_step_and_never_stops_training(s3_server, s3_store, monkeypatch,
                                                                                  caplog):
    from bench.local_s3 import DelayProxy
    from lld_monitor.logger import RunLogger

    proxy = DelayProxy(target=s3_server.ports["s3"]).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    caplog.set_level(logging.WARNING, logger="lld_monitor.store.bucket_writer")
    log = RunLogger(s3_store, "outage", "vanilla", run_id="outage", flush_every_s=0.5, detector=False,
                    handle_signals=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)  # the test's own reader goes straight to the server
    worst, step, t0 = 0.0, 0, time.monotonic()
    rng = np.random.default_rng(0)

    def train_until(t_end: float) -> None:
        nonlocal worst, step
        while time.monotonic() - t0 < t_end:
            samples = {"reward": rng.random(4), "advantage": rng.normal(size=4), "group_id": np.zeros(4)}
            t = time.perf_counter()
            log.log_step(step, scalars={"grad_norm": 1.0}, samples=samples)
            worst = max(worst, time.perf_counter() - t)
            step += 1
            time.sleep(0.05)  # a 50 ms training step

    try:
        train_until(3.0)
        proxy.down()
        train_until(33.0)  # 30 s with the server out of reach
        during = step
        proxy.up()
        train_until(38.0)
        log.close()
    finally:
        proxy.close()
    assert worst < 0.25, f"log_step waited {worst:.3f} s"
    assert log.errors == 0
    text = caplog.text
    assert "uploaded when it is back" in text, text[-2000:]
    back = re.search(r"reachable again after (\d+) s", text)
    assert back and int(back.group(1)) >= 25, text[-2000:]  # the outage was seen whole (30 s, from its first try)
    r = open_store_reader(s3_store, poll_s=0)
    steps = r.steps("outage").step.tolist()
    assert steps == list(range(step)) and step > during > 300
    assert len(r.samples("outage")) == 4 * step
    assert r.run("outage")["status"] == "finished"


@pytest.mark.slow
def test_a_writer_killed_mid_upload_never_shows_a_torn_segment(s3_store):
    bucket = Bucket(s3_store)
    r = open_store_reader(s3_store, poll_s=0)
    for k, delay in enumerate((1.5, 2.3, 3.1)):
        rid = f"big{k}"
        child = _child("big", s3_store, rid)
        try:
            _wait(lambda: child.stdout.readline().strip() != "", 60, "a first flush")  # noqa: B023
            time.sleep(delay)  # flushes of ~10 MB back to back: the kill lands in an upload most of the time
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        man = json.loads(bucket.get(f"runs/{rid}/manifest-r0.json")[0])
        listed = {f"runs/{rid}/{t}/{s['file']}" for t, segs in man["segments"].items() for s in segs}
        present = {o.key: o.size for o in bucket.list_all(f"runs/{rid}")}
        assert listed <= set(present), "the manifest lists an object that is not there"
        steps = r.steps(rid).step.tolist()
        assert steps == list(range(len(steps))) and steps, steps
        counts = r.token_counts(rid)
        assert counts.step.tolist() == steps and (counts.n == 400_000).all()  # every listed segment whole
        assert r.run(rid)["status"] == "crashed"


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_one_run_into_a_bucket(s3_store):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           CHILD, "ranks", s3_store, "ddp-run"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = open_store_reader(s3_store, poll_s=0)
    run = r.run("ddp-run")
    assert run["world_size"] == 2 and run["status"] == "finished"
    s = r.samples("ddp-run")
    assert sorted(s["rank"].unique().tolist()) == [0, 1] and len(s) == 2 * 3 * 5
    steps = r.steps("ddp-run")
    assert steps.step.tolist() == list(range(5)) and (steps.n_samples == 6).all()
    keys = [o.key for o in Bucket(s3_store).list_all("runs/ddp-run")]
    assert {k.rsplit("/", 1)[-1] for k in keys if "manifest" in k} == {"manifest-r0.json", "manifest-r1.json"}


@pytest.mark.slow
def test_the_same_run_trained_into_a_folder_and_a_bucket_reads_back_identical(s3_store, tmp_path):
    from lld_monitor.cli import main
    from lld_monitor.store.compare import run_differences

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    for store in (str(tmp_path / "folder"), s3_store):
        rc = main(["train", "--mode", "llds", "--steps", "3", "--seed", "1", "--store", store, "--run-name", "same",
                   "--run-id", "same", "--config", str(cfg), "--no-progress"])
        assert rc == 0
    folder, bucket = open_store_reader(tmp_path / "folder"), open_store_reader(s3_store, poll_s=0)
    assert bucket.run("same")["status"] == "finished" and bucket.run("same")["steps"] == 3
    assert bucket.token_steps("same"), "the config logs tokens: compare them too"
    assert run_differences(folder, "same", bucket, "same") == []
