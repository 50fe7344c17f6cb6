"""A seed and a config are one run, bit for bit, whoever launches it.

The same 15 steps of the spiral setting are launched three ways at once, on purpose competing for the
CPU with each other and with a busy neighbour process: as `lld-monitor demo` starts its live trainers
(with `--threads 2` added), as `scripts/run_spiral_experiment.py` starts a run, and under
`torchrun --nproc_per_node 1`. Every step signal, metric, sample (with its text) and logged token
must be equal to the last bit; only wall-clock columns may differ (`lld_monitor.store.compare`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 15
SEED = 4
BUSY = "import time\nt = time.time()\nwhile time.time() - t < 600:\n    sum(i * i for i in range(10000))\n"


def _experiment_command(mode: str, store: Path, config: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("run_spiral_experiment", ROOT / "scripts" / "run_spiral_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.train_command(mode, SEED, store, config, STEPS)


@pytest.mark.slow
def test_same_seed_and_config_give_the_same_run_from_every_launcher(tmp_path):
    from lld_monitor.commands.demo import SPIRAL_CONFIG, trainer_command
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import run_differences

    config = str(SPIRAL_CONFIG)
    torchrun = Path(sys.executable).with_name("torchrun")
    launches = {
        "demo": trainer_command("vanilla", tmp_path / "demo", STEPS, SEED, config) + ["--threads", "2"],
        "experiment": _experiment_command("vanilla", tmp_path / "experiment", config),
        "torchrun": [str(torchrun), "--nproc_per_node", "1", "--master_port", str(free_port()), "-m", "lld_monitor.cli", "train",
                     "--mode", "vanilla", "--seed", str(SEED), "--steps", str(STEPS), "--store", str(tmp_path / "torchrun"),
                     "--config", config, "--no-progress"],
    }
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for name, cmd in launches.items()}
        for name, p in procs.items():
            _, err = p.communicate(timeout=900)
            assert p.returncode == 0, f"{name}: {err[-3000:]}"
    finally:
        busy.kill()
    readers = {name: open_store_reader(tmp_path / name) for name in launches}
    runs = {name: r.runs() for name, r in readers.items()}
    for name, df in runs.items():
        assert len(df) == 1 and int(df.steps[0]) == STEPS and df.status[0] == "finished", (name, df)
    ref = readers["experiment"]
    ref_id = runs["experiment"].run_id[0]
    assert ref.token_steps(ref_id), "the spiral config logs tokens; nothing to compare"
    for name in ("demo", "torchrun"):
        diff = run_differences(ref, ref_id, readers[name], runs[name].run_id[0])
        assert diff == [], f"{name} differs from the experiment's launch:\n" + "\n".join(diff)
    for r in readers.values():
        r.close()
