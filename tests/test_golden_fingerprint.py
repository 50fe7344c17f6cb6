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
def test_first_steps_of_the_demo_runs_match_the_golden_fingerprint(demo_runs):
    """Trains the demo's runs for the golden length, or reads the first steps of the runs the spiral test trained to
    the end in this session (`demo_runs`, tests/conftest.py): the same runs, step for step."""
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    g = _script()
    golden = g.load_golden()
    cpu = g.cpu_model()
    print(f"\nCPU: {cpu} (golden fingerprints reproduced on: {', '.join(golden['cpus'])})")
    assert golden["config_sha256"] == g.config_digest(SPIRAL_CONFIG) and golden["seed"] == DEMO_SEED, (
        "the demo's config or seed changed since the golden fingerprints were recorded: record them again with "
        "`scripts/golden_fingerprint.py --write` (and regenerate sample_runs/)")
    got = g.hash_runs(demo_runs(golden["steps"]), golden["steps"])
    bad = g.mismatches(got, golden, g.load_golden_steps())
    assert not bad, "; ".join(
        f"the {mode} run's first {golden['steps']} steps differ from the golden fingerprint on {cpu!r}, first at {where} "
        f"({'a CPU they were reproduced on: the numerics changed' if cpu in golden['cpus'] else 'a new CPU: the pins do not hold here'};"
        " docs/backend.md, 'Reproducibility', says how to find the op: scripts/golden_fingerprint.py --trace)"
        for mode, where in bad.items())
    if cpu not in golden["cpus"]:
        print(f"new CPU {cpu!r} reproduces the golden fingerprints: add it with `scripts/golden_fingerprint.py --add-cpu`")


def test_a_mismatch_names_the_first_step_and_column_that_differ():
    """The failure message's locator: per-step digests of a run against the reference's, first difference named."""
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import first_difference, run_fingerprint, step_digests

    g = _script()
    with open_store_reader(ROOT / "sample_runs") as r:
        runs = r.runs().set_index("mode")
        ref = step_digests(r, runs.run_id["vanilla"], 6)
        fp = run_fingerprint(r, runs.run_id["vanilla"], 6)
    assert sorted(ref, key=int) == [str(s) for s in range(6)] and "steps.grad_norm" in ref["0"]
    assert "tokens.logp_new" in ref["0"] and "samples.text" in ref["3"] and "metrics.actor/ppo_kl" in ref["5"]
    assert first_difference(ref, ref) is None
    changed = {s: dict(d) for s, d in ref.items()}
    changed["4"]["samples.reward"] = "0" * 12
    changed["5"]["steps.grad_norm"] = "0" * 12
    assert first_difference(changed, ref) == "step 4, samples.reward (differs)"
    del changed["4"]["samples.reward"]
    assert first_difference(changed, ref) == "step 4, samples.reward (missing here)"
    golden = {"fingerprints": {"vanilla": fp}}
    assert g.mismatches({"vanilla": (fp, ref)}, golden, {"vanilla": ref}) == {}
    assert g.mismatches({"vanilla": ("x" * 64, changed)}, golden, {"vanilla": ref}) == {
        "vanilla": "step 4, samples.reward (missing here)"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_golden_run_is_the_same_with_numpys_avx512_code_turned_off(tmp_path, monkeypatch):
    """numpy picks its SIMD code by CPU: with its AVX-512 targets turned off it runs as on an AVX2-only CPU, and
    the whole golden length must still give the golden fingerprints (the retriever ranked by numpy's top-k
    before: another run from step 0)."""
    from lld_monitor.backend.numerics import numpy_avx512_targets
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    targets = numpy_avx512_targets()
    if not targets:
        pytest.skip("this CPU has no AVX-512: numpy's AVX2 code is what the golden test ran")
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", " ".join(targets))
    g = _script()
    golden = g.load_golden()
    got = g.train_and_hash(tmp_path / "store", SPIRAL_CONFIG, DEMO_SEED, golden["steps"])
    assert not g.mismatches(got, golden, g.load_golden_steps())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_op_trace_records_and_a_diff_names_the_first_op_that_differs(tmp_path):
    import gzip
    import json
    import subprocess
    import sys

    a = tmp_path / "a.jsonl.gz"
    res = subprocess.run([sys.executable, "scripts/golden_fingerprint.py", "--trace", str(a)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in gzip.open(a, "rt")]
    assert len(rows) > 10_000 and {"aten.exp.default", "aten.sqrt.default", "aten.multinomial.default"} <= {
        r["op"] for r in rows}
    same = subprocess.run([sys.executable, "scripts/golden_fingerprint.py", "--diff-trace", str(a), str(a)], cwd=ROOT,
                          capture_output=True, text=True)
    assert same.returncode == 0 and "agree" in same.stdout
    k = next(i for i, r in enumerate(rows) if r["op"] == "aten.sqrt.default" and r["sha"] not in (None, "noise"))
    rows[k]["sha"] = "0" * 16
    b = tmp_path / "b.jsonl.gz"
    with gzip.open(b, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    diff = subprocess.run([sys.executable, "scripts/golden_fingerprint.py", "--diff-trace", str(a), str(b)], cwd=ROOT,
                          capture_output=True, text=True)
    assert diff.returncode == 1 and f"line {k} " in diff.stdout and "output of aten.sqrt.default" in diff.stdout
