"""The golden fingerprint: what the first steps of the demo's two runs compute, on every CPU.

The demo's vanilla and LLDS runs (scripts/spiral_config.json, the demo's seed) are trained for STEPS steps,
as `lld-monitor demo` launches them, and each run's values are hashed (`store.compare.run_fingerprint`:
step rows, metrics, samples, tokens; wall-clock columns left out). With pinned numerics the hashes are the
same on any x86-64 CPU with AVX2 and FMA; `tests/golden_fingerprint.json` holds them and the CPU models they
have been reproduced on, `tests/golden_fingerprint_steps.json` one short digest per step and column (so a
mismatch names the first step and column that differ), and `tests/test_golden_fingerprint.py` checks this
machine against them.

    .venv/bin/python scripts/golden_fingerprint.py             # check this machine
    .venv/bin/python scripts/golden_fingerprint.py --add-cpu   # ... and record its CPU model when it matches
    .venv/bin/python scripts/golden_fingerprint.py --write     # record new hashes (after a deliberate change)
    .venv/bin/python scripts/golden_fingerprint.py --trace OUT.jsonl.gz            # op trace of the first step
    .venv/bin/python scripts/golden_fingerprint.py --diff-trace A.jsonl.gz B.jsonl.gz  # first op that differs

An op trace (`lld_monitor/backend/op_trace.py`) hashes every ATen op's output in one pinned step of the demo's
vanilla run; `tests/op_traces/` holds one per CPU model, so a machine whose fingerprint differs can name the
first op whose bits differ (record at the same commit as the trace it is compared with).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lld_monitor.backend.numerics import cpu_model  # noqa: E402

GOLDEN = ROOT / "tests" / "golden_fingerprint.json"
GOLDEN_STEPS = ROOT / "tests" / "golden_fingerprint_steps.json"
STEPS = 20
MODES = ("vanilla", "llds")


def config_digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()


def train_runs(store: Path, config: Path, seed: int, steps: int | None = STEPS) -> None:
    """Train each mode for `steps` steps (None: the config's), side by side, as the demo starts them."""
    sys.path.insert(0, str(ROOT))
    from lld_monitor.commands.demo import trainer_command

    procs = {m: subprocess.Popen(trainer_command(m, store, steps, seed, str(config)), cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for m in MODES}
    for m, p in procs.items():
        _, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"training the {m} run failed:\n{err[-3000:]}")


def hash_runs(store: Path, steps: int = STEPS) -> dict[str, tuple[str, dict]]:
    """Per mode: the fingerprint and per-step digests of its run's first `steps` steps (the runs may be longer)."""
    sys.path.insert(0, str(ROOT))
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import run_fingerprint, step_digests

    r = open_store_reader(store)
    try:
        runs = r.runs().set_index("mode")
        return {m: (run_fingerprint(r, runs.run_id[m], steps), step_digests(r, runs.run_id[m], steps)) for m in MODES}
    finally:
        r.close()


def train_and_hash(store: Path, config: Path, seed: int, steps: int = STEPS) -> dict[str, tuple[str, dict]]:
    """Train each mode for `steps` steps (side by side, as the demo starts them); per mode, its run's
    fingerprint and per-step digests."""
    train_runs(store, config, seed, steps)
    return hash_runs(store, steps)


def fingerprints(store: Path, config: Path, seed: int, steps: int = STEPS) -> dict[str, str]:
    """Each mode's run fingerprint over its first `steps` steps."""
    return {m: fp for m, (fp, _) in train_and_hash(store, config, seed, steps).items()}


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


def load_golden_steps() -> dict:
    return json.loads(GOLDEN_STEPS.read_text()) if GOLDEN_STEPS.is_file() else {}


def mismatches(got: dict[str, tuple[str, dict]], golden: dict, golden_steps: dict) -> dict[str, str]:
    """Per mode whose fingerprint is not the golden one: the first step and column that differ, in words."""
    from lld_monitor.store.compare import first_difference

    out = {}
    for mode, want in golden["fingerprints"].items():
        fp, digests = got[mode]
        if fp != want:
            where = first_difference(digests, golden_steps[mode]) if mode in golden_steps else None
            out[mode] = where or "no per-step digest differs (the fingerprint's own bytes do: a new column?)"
    return out


def _write_golden(got: dict[str, tuple[str, dict]], cpu: str) -> None:
    from importlib.metadata import version

    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    GOLDEN.write_text(json.dumps({
        "config": str(SPIRAL_CONFIG.relative_to(ROOT)), "config_sha256": config_digest(SPIRAL_CONFIG),
        "seed": DEMO_SEED, "steps": STEPS, "torch": version("torch"), "fingerprints": {m: fp for m, (fp, _) in got.items()},
        "cpus": [cpu],
    }, indent=2) + "\n")
    GOLDEN_STEPS.write_text(json.dumps({m: d for m, (_, d) in got.items()}, indent=0, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record this machine's hashes as the golden ones")
    ap.add_argument("--add-cpu", action="store_true", help="record this CPU model when its hashes match")
    ap.add_argument("--trace", metavar="OUT", type=Path,
                    help="instead: write an op trace of the demo's vanilla run's first step (gzip JSON lines)")
    ap.add_argument("--diff-trace", nargs=2, metavar=("A", "B"), type=Path,
                    help="instead: print the first op whose bits differ between two traces")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    cpu = cpu_model()
    if args.diff_trace:
        from lld_monitor.backend.op_trace import diff

        where = diff(*args.diff_trace)
        print(where or "the traces agree on every hash that is not noise")
        return 0 if where is None else 1
    if args.trace:
        from lld_monitor.backend.op_trace import record

        n, noise = record(args.trace, SPIRAL_CONFIG, DEMO_SEED, "vanilla", steps=1)
        print(f"CPU: {cpu}\n{n} op outputs written to {args.trace} ({noise} hashes differ between two runs here: "
              "marked noise)")
        return 0
    with tempfile.TemporaryDirectory() as d:
        got = train_and_hash(Path(d) / "store", SPIRAL_CONFIG, DEMO_SEED)
    print(f"CPU: {cpu}")
    for m, (fp, _) in got.items():
        print(f"{m:8s} {fp}")
    if args.write:
        _write_golden(got, cpu)
        print(f"wrote {GOLDEN} and {GOLDEN_STEPS}")
        return 0
    golden = load_golden()
    bad = mismatches(got, golden, load_golden_steps())
    for m, where in bad.items():
        print(f"{m}: DIFFERS from the golden fingerprint; first at {where}")
    if not bad:
        print("matches the golden fingerprints")
    if not bad and args.add_cpu and cpu not in golden["cpus"]:
        golden["cpus"].append(cpu)
        GOLDEN.write_text(json.dumps(golden, indent=2) + "\n")
        print(f"added {cpu!r} to {GOLDEN}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
