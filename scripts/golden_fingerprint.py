"""The golden fingerprint: what the first steps of the demo's two runs compute, on every CPU.

The demo's vanilla and LLDS runs (scripts/spiral_config.json, the demo's seed) are trained for STEPS steps,
as `lld-monitor demo` launches them, and each run's values are hashed (`store.compare.run_fingerprint`:
step rows, metrics, samples, tokens; wall-clock columns left out). With pinned numerics the hashes are the
same on any x86-64 CPU with AVX2; `tests/golden_fingerprint.json` holds them and the CPU models they have
been reproduced on, and `tests/test_golden_fingerprint.py` checks this machine against them.

    .venv/bin/python scripts/golden_fingerprint.py             # check this machine
    .venv/bin/python scripts/golden_fingerprint.py --add-cpu   # ... and record its CPU model when it matches
    .venv/bin/python scripts/golden_fingerprint.py --write     # record new hashes (after a deliberate change)
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
GOLDEN = ROOT / "tests" / "golden_fingerprint.json"
STEPS = 20
MODES = ("vanilla", "llds")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def config_digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()


def fingerprints(store: Path, config: Path, seed: int, steps: int = STEPS) -> dict[str, str]:
    """Train each mode for `steps` steps (side by side, as the demo starts them) and hash its run."""
    sys.path.insert(0, str(ROOT))
    from lld_monitor.commands.demo import trainer_command
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import run_fingerprint

    procs = {m: subprocess.Popen(trainer_command(m, store, steps, seed, str(config)), cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for m in MODES}
    for m, p in procs.items():
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"training the {m} run failed:\n{err[-3000:]}")
    r = open_store_reader(store)
    try:
        runs = r.runs().set_index("mode")
        return {m: run_fingerprint(r, runs.run_id[m], steps) for m in MODES}
    finally:
        r.close()


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


def main() -> int:
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record this machine's hashes as the golden ones")
    ap.add_argument("--add-cpu", action="store_true", help="record this CPU model when its hashes match")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        got = fingerprints(Path(d) / "store", SPIRAL_CONFIG, DEMO_SEED)
    cpu = cpu_model()
    print(f"CPU: {cpu}")
    for m, h in got.items():
        print(f"{m:8s} {h}")
    if args.write:
        from importlib.metadata import version

        GOLDEN.write_text(json.dumps({
            "config": str(SPIRAL_CONFIG.relative_to(ROOT)), "config_sha256": config_digest(SPIRAL_CONFIG),
            "seed": DEMO_SEED, "steps": STEPS, "torch": version("torch"), "fingerprints": got, "cpus": [cpu],
        }, indent=2) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    golden = load_golden()
    same = golden["fingerprints"] == got
    print("matches the golden fingerprints" if same else "DIFFERS from the golden fingerprints")
    if same and args.add_cpu and cpu not in golden["cpus"]:
        golden["cpus"].append(cpu)
        GOLDEN.write_text(json.dumps(golden, indent=2) + "\n")
        print(f"added {cpu!r} to {GOLDEN}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
