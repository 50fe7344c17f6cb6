"""The golden fingerprint: the first 20 steps of the demo's vanilla and LLDS runs hash to the committed values
on this machine, whatever its CPU (pinned numerics). On a CPU not listed yet the test must pass all the same
(that is its point); then add the model with `scripts/golden_fingerprint.py --add-cpu`.

A failure means the trainer computes other bits than when the hashes were recorded: on a listed CPU, a code
change altered the numerics (record new ones deliberately with `--write`, and regenerate sample_runs/); on a
new CPU, the pins do not hold there (docs/backend.md, "Reproducibility").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("golden_fingerprint", ROOT / "scripts" / "golden_fingerprint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_first_steps_of_the_demo_runs_match_the_golden_fingerprint(tmp_path):
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    g = _script()
    golden = g.load_golden()
    cpu = g.cpu_model()
    print(f"\nCPU: {cpu} (golden fingerprints reproduced on: {', '.join(golden['cpus'])})")
    assert golden["config_sha256"] == g.config_digest(SPIRAL_CONFIG) and golden["seed"] == DEMO_SEED, (
        "the demo's config or seed changed since the golden fingerprints were recorded: record them again with "
        "`scripts/golden_fingerprint.py --write` (and regenerate sample_runs/)")
    got = g.train_and_hash(tmp_path / "store", SPIRAL_CONFIG, DEMO_SEED, golden["steps"])
    bad = g.mismatches(got, golden, g.load_golden_steps())
    assert not bad, "; ".join(
        f"the {mode} run's first {golden['steps']} steps differ from the golden fingerprint on {cpu!r}, first at {where} "
        f"({'a CPU they were reproduced on: the numerics changed' if cpu in golden['cpus'] else 'a new CPU: the pins do not hold here'};"
        " docs/backend.md, 'Reproducibility', says how to find the op: scripts/golden_fingerprint.py --trace)"
        for mode, where in bad.items())
    if cpu not in golden["cpus"]:
        print(f"new CPU {cpu!r} reproduces the golden fingerprints: add it with `scripts/golden_fingerprint.py --add-cpu`")
