"""Live: a writer process appends steps while the Live-health page reruns; the step count grows, no error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: str(m.value) for m in at.metric}


@pytest.mark.timeout(180)
def test_steps_grow_while_a_writer_appends(tmp_path):
    store = tmp_path / "live"
    writer = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "synth_store.py"), str(store), "--single", "vanilla", "--name", "live-run",
         "--steps", "60", "--flush-every", "1", "--step-sleep", "0.25", "--token-every", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (store / "runs").is_dir() or not any((store / "runs").iterdir()):
            assert writer.poll() is None, writer.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer did not create its run"
            time.sleep(0.2)
        time.sleep(1.0)
        at = AppTest.from_file(APP, default_timeout=60)
        at.session_state["store_path"] = str(store)
        at.run()
        seen, statuses = [], []
        for _ in range(40):
            assert not at.exception, [e.value for e in at.exception]
            assert not at.error, [e.value for e in at.error]
            m = _metrics(at)
            if "Steps logged" in m:
                seen.append(int(m["Steps logged"]))
                statuses.append(m["Status"])
            if statuses and statuses[-1] == "finished":
                break
            time.sleep(2.2)  # past the 2 s cache TTL: a refresh tick (AppTest does not simulate run_every)
            at.run()
        assert writer.wait(60) == 0, writer.stderr.read().decode()
        assert "live" in statuses, statuses  # shown as live while the writer ran
        assert len(set(seen)) >= 3 and seen == sorted(seen), seen  # grew, never went back
        # once the writer finished, the next refresh shows the run as finished with all its steps
        time.sleep(2.2)
        at.run()
        assert not at.exception
        m = _metrics(at)
        assert m["Status"] == "finished" and m["Steps logged"] == "60", m
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
