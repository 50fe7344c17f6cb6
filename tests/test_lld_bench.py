"""The overhead benchmark runs end to end on a tiny configuration and writes sane JSON (not a timing test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "lld_overhead.py"


def test_bench_smoke(tmp_path):
    out = tmp_path / "b.json"
    argv = ["--batch", "5", "--seq", "24", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--intermediate", "64", "--vocab", "64", "--reps", "1", "--warmup", "0", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llds_ma" in proc.stdout and "torch.set_num_threads(1)" in proc.stdout
    res = json.loads(out.read_text())
    assert set(res["median_cpu_s"]) == {"vanilla", "llds", "llds_rgate", "llds_code", "llds_ma"}
    assert res["ratio_cpu_vs_vanilla"]["vanilla"] == 1.0
    assert all(v > 0 for v in res["median_wall_s"].values())
    assert res["action_tokens"] > 0 and all(v > 0 for v in res["term_only_median_cpu_ms"].values())
