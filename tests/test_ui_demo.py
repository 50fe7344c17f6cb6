"""`lld-monitor demo`: a fresh store with the sample runs, live trainers, the dashboard; Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from _net import free_port

from lld_monitor.commands import demo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _wait_http(port: int, timeout: float = 90) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def test_prepare_store_copies_samples_and_refuses_a_used_folder(tmp_path):
    from bench.synth_store import SynthConfig, write_run
    from lld_monitor.store import open_store_reader

    samples = tmp_path / "samples"
    write_run(samples, SynthConfig(name="historic", steps=5, token_every=0, write_alerts=False))
    fresh = demo.prepare_store(str(tmp_path / "demo"), samples=samples)
    with open_store_reader(fresh) as r:
        assert r.runs()["name"].tolist() == ["historic"]
    with pytest.raises(FileExistsError):
        demo.prepare_store(str(fresh), samples=samples)
    empty = demo.prepare_store(str(tmp_path / "none"), samples=tmp_path / "no-samples")
    with open_store_reader(empty) as r:
        assert r.runs().empty
    cmd = demo.trainer_command("llds", fresh, 7, 3, "cfg.json")
    assert cmd[cmd.index("--mode") + 1] == "llds" and cmd[cmd.index("--steps") + 1] == "7"
    assert cmd[cmd.index("--store") + 1] == str(fresh) and cmd[cmd.index("--config") + 1] == "cfg.json"
    assert "--steps" not in demo.trainer_command("vanilla", fresh, None, 0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_serves_and_ctrl_c_stops_trainer_and_server(tmp_path):
    port = free_port()
    store = tmp_path / "demo"
    # enough steps that the vanilla trainer is still running when a loaded machine has the server up
    proc = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "demo", "--store", str(store), "--port", str(port),
                             "--steps", "100"], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert _wait_http(port), proc.stdout.read().decode() if proc.poll() is not None else "server not up"
        kids = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(k.cmdline()) for k in kids if k.is_running()]
        assert any(" train " in c and "--mode vanilla" in c for c in cmdlines), cmdlines
        assert any("streamlit" in c for c in cmdlines), cmdlines
        assert (store / "store.json").exists()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the demo's process group
        assert proc.wait(60) == 0
        out = proc.stdout.read().decode()
        assert "stopping the demo" in out, out[-2000:]
        _, alive = psutil.wait_procs(kids, timeout=20)
        assert not alive, [a.cmdline() for a in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
