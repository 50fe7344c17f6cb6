"""The demo's story, end to end: its two live trainers (default seed, config and steps, started as
`lld-monitor demo` starts them, side by side) give a vanilla run that collapses and an LLDS run that does
not (by the detector's written collapse definition; whether LLDS also holds its reward is the testbed's
open goal, docs/backend.md).

Slow (two full runs of the spiral setting, several CPU-minutes each); marked `spiral`. Run alone with
`.venv/bin/python -m pytest -m spiral`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.spiral
@pytest.mark.timeout(2400)
def test_demo_vanilla_collapses_and_llds_does_not(demo_runs):
    from lld_monitor.commands.demo import SPIRAL_CONFIG
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import run_fingerprint

    steps = json.loads(SPIRAL_CONFIG.read_text())["steps"]
    store = demo_runs(None)  # trained here, side by side, as the demo starts its trainers (tests/conftest.py)
    r = open_store_reader(store)
    runs = r.runs().set_index("mode")
    assert set(runs.index) == {"vanilla", "llds"} and (runs.steps == steps).all(), runs
    # numerics first: the runs' first steps must be the golden ones, else the story below is another run's
    golden = json.loads((ROOT / "tests" / "golden_fingerprint.json").read_text())
    for m in ("vanilla", "llds"):
        assert run_fingerprint(r, runs.run_id[m], golden["steps"]) == golden["fingerprints"][m], (
            f"numerics: the demo's {m} run differs from the golden fingerprint in its first {golden['steps']} steps "
            "(tests/test_golden_fingerprint.py says more); its story is not the one the demo seed was chosen for")
    sig = {m: r.signals(runs.run_id[m]) for m in ("vanilla", "llds")}
    van_collapse = reward_collapse_step(sig["vanilla"])
    llds_collapse = reward_collapse_step(sig["llds"])
    assert van_collapse is not None, "story: the demo's vanilla run did not collapse (its numerics are the golden ones)"
    assert llds_collapse is None, f"story: the demo's LLDS run collapsed at step {llds_collapse}"
    r.close()
